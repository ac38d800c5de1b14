"""Who a shard waits for, as its heartbeat stats carry it (stall attribution).

TRUST BOUNDARY, like records.py (which reads these two fields of NodeStats):

    stats.waiting -> list[WaitingFor]: nodes the shard's open rounds and parked
                     pulls wait for right now, how long (seconds) and who waits;
    stats.held    -> list[HeldUp]: per node, the seconds (cumulative, wall time)
                     the shard's parked pulls were released only by that node's
                     push, and how many workers the last such release freed.

A bad value raises ProtocolError(MALFORMED) naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .read_values import MAX_SECONDS
from .read_values import bad as _bad

MAX_WAITERS = 4096  # workers named in one entry: far above any cluster this runs


def _node(where: str, value: Any) -> int:
    if type(value) is not int or not 0 <= value < 2**63:
        _bad(where, f"must be a node id (int >= 0), got {value!r:.40}")
    return value


def _seconds(where: str, value: Any) -> float:
    # NaN fails both comparisons
    if type(value) not in (int, float) or not 0 <= value <= MAX_SECONDS:
        _bad(
            where, f"must be a finite number of seconds in [0, {MAX_SECONDS:g}], got {value!r:.40}"
        )
    return float(value)


def _entries(where: str, value: Any, keys: tuple[str, ...]) -> list[dict]:
    if type(value) not in (list, tuple):
        _bad(where, f"must be a list, got {type(value).__name__}")
    if len(value) > MAX_WAITERS:
        _bad(where, f"{len(value)} entries, at most {MAX_WAITERS}")
    out = []
    for i, e in enumerate(value):
        if type(e) is not dict or set(e) != set(keys):
            _bad(f"{where}[{i}]", f"want a map with keys {{{', '.join(keys)}}}, got {e!r:.60}")
        out.append(e)
    return out


@dataclass(frozen=True)
class WaitingFor:
    """A node a shard waits for now: for `for_s` seconds, by the workers `waiters`."""

    node: int
    for_s: float
    waiters: tuple[int, ...] = ()

    def to_wire(self) -> dict:
        return {"node": self.node, "for_s": round(self.for_s, 4), "waiters": list(self.waiters)}


@dataclass(frozen=True)
class HeldUp:
    """Seconds (cumulative, wall time) a shard's waiters were released only by `node`."""

    node: int
    seconds: float
    waiters: int = 0  # workers its last release freed

    def to_wire(self) -> dict:
        return {"node": self.node, "s": round(self.seconds, 4), "waiters": self.waiters}


def read_waiting(value: Any) -> tuple[WaitingFor, ...]:
    out = []
    for i, e in enumerate(_entries("stats.waiting", value, ("node", "for_s", "waiters"))):
        where = f"stats.waiting[{i}]"
        waiters = e["waiters"]
        if type(waiters) not in (list, tuple) or len(waiters) > MAX_WAITERS:
            _bad(f"{where}.waiters", f"must be a list of at most {MAX_WAITERS} node ids")
        out.append(
            WaitingFor(
                _node(f"{where}.node", e["node"]),
                _seconds(f"{where}.for_s", e["for_s"]),
                tuple(_node(f"{where}.waiters", w) for w in waiters),
            )
        )
    return tuple(out)


def read_held(value: Any) -> tuple[HeldUp, ...]:
    out = []
    for i, e in enumerate(_entries("stats.held", value, ("node", "s", "waiters"))):
        where = f"stats.held[{i}]"
        waiters = e["waiters"]
        if type(waiters) is not int or not 0 <= waiters <= MAX_WAITERS:
            _bad(f"{where}.waiters", f"must be an int in [0, {MAX_WAITERS}], got {waiters!r:.40}")
        out.append(
            HeldUp(_node(f"{where}.node", e["node"]), _seconds(f"{where}.s", e["s"]), waiters)
        )
    return tuple(out)
