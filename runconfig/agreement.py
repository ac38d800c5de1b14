"""The settings every host of one run must agree on (docs/deployment.md, "What must be identical
on every host"). Each node sends its values of them when it registers (`agreed_values`); the
scheduler compares them with its own (`differences`) and refuses a node that differs, naming
each key and both values. Everything else may differ from host to host: addresses, devices,
threads, slowdowns and links, data roots, checkpoint directories, ...

To make one more setting agree, add its key path to AGREED_KEYS."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from .schema import RunConfig

# key paths into RunConfig; a key whose section this version of the schema lacks is left out
AGREED_KEYS = (
    "seed",
    "model.name",
    "model.kwargs",
    "data.dataset",
    "data.kwargs",
    "data.batch_size",
    "data.resize",
    "data.synthetic",
    "data.num_classes",
    "data.accumulate",
    "task",
    "optimizer",
    "algorithm.name",
    "algorithm.params",
    "cluster.workers",
    "cluster.shards",
    "cluster.replicas",
    "cluster.nonfinite",
    "cluster.clip_value",
    # the evaluator keeps the best model by the watched metric, the scheduler reports on it
    "stop.target",
    "stop.target_accuracy",
    "eval.metric",
    # which tables are sparse (workers), how their rows start and are updated (shards)
    "sparse",
)
# lists of nodes: their count must agree, each node's own settings may differ
COUNTED = frozenset({"cluster.workers", "cluster.shards"})
_MISSING = object()


class _NotSet:
    def __repr__(self) -> str:
        return "(not set)"


NOT_SET = _NotSet()  # a key the other side does not send


def _lookup(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        cfg = getattr(cfg, part, _MISSING)
        if cfg is _MISSING:
            return _MISSING
    return cfg


def _plain(value: Any) -> Any:
    """`value` as msgpack carries it and JSON writes it: dataclasses as maps, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return json.loads(json.dumps(value, sort_keys=True, default=repr))


def agreed_values(cfg: RunConfig) -> dict[str, Any]:
    """{key path: value} of AGREED_KEYS in `cfg` (COUNTED keys: their count), plain values."""
    out = {}
    for key in AGREED_KEYS:
        value = _lookup(cfg, key)
        if value is not _MISSING:
            out[key] = len(value) if key in COUNTED else _plain(value)
    return out


def differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, my value, their value) for each key of `mine` that `theirs` sets otherwise or not
    at all (a host running another version of hetps), in AGREED_KEYS order. An empty `theirs`
    (a node that sends none: an in-process test client, the simulator) differs in nothing."""
    if not theirs:
        return []
    return [
        (key, value, theirs.get(key, NOT_SET))
        for key, value in mine.items()
        if key not in theirs or theirs[key] != value
    ]


def describe(diffs: list[tuple[str, Any, Any]], mine: str, theirs: str, width: int = 120) -> str:
    """`key: THEIR VALUE (theirs) vs MY VALUE (mine); ...`, each value cut to `width` characters."""

    def show(value: Any) -> str:
        plain = value is NOT_SET or isinstance(value, str)
        text = repr(value) if plain else json.dumps(value, sort_keys=True)
        return text if len(text) <= width else text[: width - 3] + "..."

    return "; ".join(
        f"{key}: {show(their)} ({theirs}) vs {show(my)} ({mine})" for key, my, their in diffs
    )
