"""Stall attribution at the shard: who its parked pulls wait for, and for
how long each node held them up (sent in heartbeat stats, read by the
scheduler's stall tracker; wire records in hetps.proto.waits).

The shard's loop calls `released` when a push from `node` made parked pulls
ready: those waiters were held up by `node` from when they parked until now.
Seconds are wall time, counted once where the waits of several releases
overlap, so a node that holds its round up all the time gains about one
second per second. `report` is called from the heartbeat thread: it reads
snapshots (list() of a dict or list is atomic under the GIL) and never writes.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from hetps.proto.waits import HeldUp, WaitingFor

from .policies import ConsistencyPolicy


class HoldLedger:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.held_s: dict[int, float] = {}  # node -> seconds it held waiters up
        self.last_waiters: dict[int, int] = {}  # node -> workers its last release freed
        self.until: dict[int, float] = {}  # node -> end of its last counted hold

    def released(self, node: int, pulls: Iterable) -> None:
        """`node`'s push made `pulls` (ParkedPull-like: worker, since) ready."""
        others = [p for p in pulls if p.worker != node]
        if not others:
            return
        now = self.clock()
        start = max(min(p.since for p in others), self.until.get(node, float("-inf")))
        self.held_s[node] = self.held_s.get(node, 0.0) + max(0.0, now - start)
        self.until[node] = now
        self.last_waiters[node] = len({p.worker for p in others})

    def report(self, policy: ConsistencyPolicy | None, parked: Iterable) -> dict:
        """Stats entries `waiting` and `held` (wire form) for a heartbeat."""
        if policy is None:
            return {}
        now = self.clock()
        try:
            waits = policy.waiting_for([(p.worker, p.clock, p.since) for p in list(parked)])
        # rounds or groups changed under us: the next heartbeat will do
        except (RuntimeError, LookupError):
            waits = []
        waiting = [
            WaitingFor(w.node, max(0.0, now - w.since), tuple(sorted(w.waiters))) for w in waits
        ]
        held = [
            HeldUp(n, s, self.last_waiters.get(n, 0)) for n, s in sorted(list(self.held_s.items()))
        ]
        return {"waiting": [w.to_wire() for w in waiting], "held": [h.to_wire() for h in held]}
