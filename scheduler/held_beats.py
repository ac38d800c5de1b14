"""Heartbeats held as long polls.

A node's heartbeat may ask the scheduler to hold its ACK (`hold_s`): the
scheduler answers when it has news for that node -- a plan newer than the
one that was current when the beat came, or `stop` -- or when the hold runs
out, whichever comes first. A node beats again as soon as a held ACK
returns, so it still beats once per `cluster.heartbeat_s`, but a stop or a
new plan reaches it within one scheduler loop instead of up to a whole
heartbeat period later.

At most one beat per node is held: a newer one (the node's last heartbeat
before BYE, or a re-sent one after a timeout) releases the older first. The
table lives only in memory: a restarted scheduler holds nothing, and the
nodes' held requests time out and are sent again, as any request to a
scheduler that went away.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class HeldBeat:
    peer: bytes  # the requester's socket identity
    req_id: int
    until: float  # answer by then at the latest (scheduler clock)
    plan_id: int  # the newest plan when the beat came: a newer one is news


class HeldBeats:
    """node id -> its held heartbeat."""

    def __init__(self) -> None:
        self._held: dict[int, HeldBeat] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, node_id: int, beat: HeldBeat) -> None:
        """Hold `beat` (the caller has answered the node's older one: `release`)."""
        self._held[node_id] = beat

    def release(self, node_id: int) -> HeldBeat | None:
        """The node's held beat, no longer held (None if none)."""
        return self._held.pop(node_id, None)

    def due(
        self, now: float, plan_id: int, has_news: Callable[[int], bool]
    ) -> list[tuple[int, HeldBeat]]:
        """The beats to answer now, taken out of the table: those whose hold
        ran out, those made under an older plan, and those of nodes
        `has_news(node_id)` names (e.g. nodes to tell to stop)."""
        out = [
            (node_id, beat)
            for node_id, beat in self._held.items()
            if now >= beat.until or plan_id != beat.plan_id or has_news(node_id)
        ]
        for node_id, _ in out:
            del self._held[node_id]
        return out
