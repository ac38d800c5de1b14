"""Pushes made under a plan this shard has not adopted yet.

A worker that already follows a newer plan (a re-plan after a worker joined,
left or was regrouped) may push before this shard's loop has fetched that
plan. Its push must join the new plan's rounds, as on every other shard, so
it waits here -- the handler returns at once, it never fetches the plan
itself -- until the daemon's loop adopts the plan (or gives up on a plan id
the scheduler does not know, and the shard takes the push under the plan it
has). Not thread-safe: the shard's loop thread only.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetps.proto.codec import Envelope


@dataclass
class FuturePush:
    peer: bytes
    env: Envelope
    since: float  # monotonic time it was parked


class FuturePushes:
    def __init__(self):
        self.parked: list[FuturePush] = []
        self.count = 0  # pushes that waited here (for the shard's stats)

    def park(self, peer: bytes, env: Envelope, now: float) -> None:
        """Keep a push; a re-sent one (same sender and request id) replaces
        its original and keeps its place and arrival time."""
        for kept in self.parked:
            if (kept.env.src, kept.env.req_id) == (env.src, env.req_id):
                kept.peer, kept.env = peer, env
                return
        self.parked.append(FuturePush(peer, env, now))
        self.count += 1

    def wanted(self) -> int:
        """The newest plan id a parked push was made under (0: none parked)."""
        return max((p.env.msg.plan_id for p in self.parked), default=0)

    def take(self, plan_id: int | None = None) -> list[FuturePush]:
        """Remove and return, in arrival order, the pushes made under plans up
        to `plan_id` (None: all of them)."""
        ready = [p for p in self.parked if plan_id is None or p.env.msg.plan_id <= plan_id]
        self.parked = [p for p in self.parked if p not in ready]
        return ready
