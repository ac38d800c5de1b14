"""Typed building of frozen config dataclasses from plain data (YAML), with
every problem collected rather than the first raised: a bad field is
reported, left out, and the instance keeps its default there.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from typing import Any

from hetps.proto.errors import ConfigError


class Problems(list):
    """Config errors found so far, one `key: what is wrong` line each. Building
    goes on past a bad value (the field keeps its default), so a config with
    several mistakes reports them all at once."""

    def add(self, path: str, message: str) -> None:
        self.append(f"{path or '<root>'}: {message}")


def fail(path: str, message: str) -> None:
    raise ConfigError(f"{path or '<root>'}: {message}")


BAD = object()  # a value that failed to build (already reported)
ON_OFF = frozenset({"comm.aggregate"})  # string settings whose values include on and off
_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _build(tp: Any, value: Any, path: str, problems: Problems) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        args = [a for a in args if a is not type(None)]
        # `int | str` (e.g. a size or "auto"): the value's own type when it is one of them
        fits = [a for a in args if type(value) is a]
        return _build(fits[0] if fits else args[0], value, path, problems)
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, path, problems)
    if origin is list:
        if not isinstance(value, list):
            problems.add(path, f"expected a list, got {type(value).__name__} {value!r}")
            return BAD
        (item,) = typing.get_args(tp)
        items = [_build(item, v, f"{path}.{i}", problems) for i, v in enumerate(value)]
        return BAD if any(v is BAD for v in items) else items
    if tp is str and isinstance(value, bool) and path in ON_OFF:
        return "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
        return float(value)  # PyYAML (YAML 1.1) leaves `1e-4` (no dot) a string
    if tp in (int, float, str, bool, dict, list) and (
        not isinstance(value, tp) or (tp is int and isinstance(value, bool))
    ):
        problems.add(path, f"expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return BAD
    return value


def unknown_key(key: Any, names: list[str]) -> str:
    """`unknown key`, with `(did you mean 'NAME'?)` when one of `names` is close to `key`."""
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
    return f"unknown key (did you mean {close[0]!r}?)" if close else "unknown key"


def _required(cls: type) -> list[str]:
    return [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]


def build_dataclass(cls: type, value: Any, path: str, problems: Problems) -> Any:
    """`cls` from a mapping; bad fields are reported and left out, so the
    instance (if it can be made at all) holds defaults there."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        problems.add(path, f"expected a mapping, got {type(value).__name__} {value!r}")
        return BAD
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, v in value.items():
        sub = f"{path}.{key}".lstrip(".")
        if key not in names:
            problems.add(sub, f"{unknown_key(key, names)}; allowed: {', '.join(names) or '(none)'}")
        elif (built := _build(hints[key], v, sub, problems)) is not BAD:
            kwargs[key] = built
    for key in _required(cls):
        if key not in value:
            problems.add(f"{path}.{key}".lstrip("."), "required (it has no default)")
    if any(key not in kwargs for key in _required(cls)):
        return BAD
    try:
        return cls(**kwargs)
    except ConfigError as exc:  # algorithm parameters check their own ranges
        problems.extend(exc.errors)
        return BAD
