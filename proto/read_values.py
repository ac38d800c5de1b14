"""Checked reads of plain values from a peer: counts, ids, bounded numbers,
and nested plain data (records.py and waits.py build their records on them).
Each raises ProtocolError(MALFORMED) naming the field."""

from __future__ import annotations

import math
from typing import Any, NoReturn

from .errors import ProtocolError
from .ops import Status

MAX_COUNT = 2**62  # steps, bytes, versions: far above any run, far below int64 overflow
# samples/s or bytes/s: far above any machine, far below float overflow in sums
MAX_RATE = 1e15
MAX_SECONDS = 1e9
MAX_DEPTH = 4  # nesting of plain values (lists and maps) in extras and step records
MAX_TEXT = 4096  # characters of a string in a plain value


def bad(where: str, message: str, status: Status = Status.MALFORMED) -> NoReturn:
    raise ProtocolError(status, f"{where}: {message}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_count(where: str, value: Any) -> int:
    """An int in [0, MAX_COUNT] (a bool is no count)."""
    if not is_int(value) or not 0 <= value <= MAX_COUNT:
        bad(where, f"must be an int in [0, {MAX_COUNT}], got {value!r:.40}")
    return int(value)


def read_int(where: str, value: Any) -> int:
    """Any int64 (ids, clocks); a bool is no int."""
    if not is_int(value) or not -(2**63) <= value < 2**63:
        bad(where, f"must be a 64-bit int, got {value!r:.40}")
    return int(value)


def read_number(where: str, value: Any, high: float) -> float:
    """A finite float in [0, high]; ints are accepted and made floats."""
    if not (is_int(value) or isinstance(value, float)) or not (
        math.isfinite(value) and 0 <= value <= high
    ):
        bad(where, f"must be a finite number in [0, {high:g}], got {value!r:.40}")
    return float(value)


def read_plain(where: str, value: Any, depth: int = 0) -> Any:
    """Plain data a node reports and nobody computes with: None, bool, int64,
    any float (a diverged loss is NaN, and worth reporting), short strings,
    and lists and string-keyed maps of these, nested at most MAX_DEPTH deep."""
    kind = type(value)
    if value is None or kind is bool:
        return value
    if isinstance(value, float):
        return float(value)
    if is_int(value):
        return read_int(where, value)
    if kind is str:
        if len(value) > MAX_TEXT:
            bad(where, f"string of {len(value)} characters, at most {MAX_TEXT}")
        return value
    if depth >= MAX_DEPTH or kind not in (list, dict):
        bad(where, f"not a plain value (or nested deeper than {MAX_DEPTH}): {type(value).__name__}")
    if kind is list:
        return [read_plain(where, v, depth + 1) for v in value]
    if not all(type(k) is str for k in value):
        bad(where, "map keys must be strings")
    return {k: read_plain(f"{where}.{k}", v, depth + 1) for k, v in value.items()}


def read_map(where: str, value: Any) -> dict:
    if type(value) is not dict:
        bad(where, f"must be a map, got {type(value).__name__}")
    return read_plain(where, value)
