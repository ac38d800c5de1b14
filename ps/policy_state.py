"""A consistency policy's state as plain data, so that a shard checkpoint
loads with `torch.load(weights_only=True)`: no pickled class is ever loaded.

The policies keep their counts and open rounds in dicts, lists, sets and a few
small state classes (rounds, period rules) and random.Random. `to_plain` turns an instance of a
class marked `@storable` into `{"__state__": class name, "vars": its fields}`;
`from_plain` makes it again, only ever from the classes marked here.
"""

from __future__ import annotations

import random
from typing import Any

from hetps.proto.tensors import Tensors

STATE_CLASSES: dict[str, type] = {}
_TAG = "__state__"
_RANDOM = "__random_state__"


def storable(cls: type) -> type:
    """Class decorator: instances may appear in a policy's checkpointed state."""
    STATE_CLASSES[cls.__name__] = cls
    return cls


def to_plain(value: Any) -> Any:
    if isinstance(value, random.Random):  # eager's seeded initiator draw
        return {_RANDOM: value.getstate()}
    if STATE_CLASSES.get(type(value).__name__) is type(value):
        return {_TAG: type(value).__name__, "vars": to_plain(vars(value))}
    if isinstance(value, (dict, Tensors)):  # a round's sum is a Tensors: stored as a plain dict
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return type(value)(to_plain(v) for v in value)
    return value


def from_plain(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {_RANDOM}:
        rng = random.Random()
        rng.setstate(value[_RANDOM])
        return rng
    if (
        isinstance(value, dict)
        and value.get(_TAG) in STATE_CLASSES
        and set(value) == {_TAG, "vars"}
    ):
        obj = object.__new__(STATE_CLASSES[value[_TAG]])
        vars(obj).update(from_plain(value["vars"]))
        return obj
    if isinstance(value, dict):
        return {k: from_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return type(value)(from_plain(v) for v in value)
    return value
