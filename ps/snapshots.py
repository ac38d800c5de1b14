"""Copies of a shard's tensors for pull replies, one per version, with their
buffers recycled.

Replies leave zero-copy, so a reply must carry a copy that no later in-place
update touches. A fresh copy of a large tensor costs page faults on every
allocation (about six times a copy into memory already mapped), so copies
are made into the buffers of an older copy once it is free: every reply that
carried it reported the transport done with its memory (a zmq
MessageTracker; None when the transport copied the bytes itself), and it is
not the current one. A copy handed out and never tracked (a handler called
in-process, a test) is never reused. Not thread-safe: the shard's loop owns it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

KEEP = 2  # older copies remembered for reuse; more are left to the garbage collector


@dataclass
class _Copy:
    tensors: dict[str, torch.Tensor]
    lent: int = 0                                # handed out, not yet tracked
    trackers: list = field(default_factory=list)

    def free(self) -> bool:
        return self.lent == 0 and all(t.done for t in self.trackers)

    def fits(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        return list(self.tensors) == list(tensors) and all(
            c.shape == t.shape and c.dtype == t.dtype for c, t in zip(self.tensors.values(), tensors.values()))


class SnapshotCopies:
    def __init__(self):
        self.current: _Copy | None = None
        self.older: list[_Copy] = []

    def make(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A new current copy of `tensors` (into a free older copy when there is one)."""
        if self.current is not None:
            self.older.append(self.current)
        spare = next((c for c in self.older if c.free() and c.fits(tensors)), None)
        if spare is None:
            self.current = _Copy({n: t.clone() for n, t in tensors.items()})
        else:
            self.older.remove(spare)
            torch._foreach_copy_(list(spare.tensors.values()), list(tensors.values()))
            self.current = _Copy(spare.tensors)
        self.older = [c for c in self.older if c.lent == 0][-KEEP:]
        return self.current.tensors

    def lend(self) -> dict[str, torch.Tensor]:
        """The current copy, counted as handed out until `track` hears of it."""
        assert self.current is not None, "make() a copy first"
        self.current.lent += 1
        return self.current.tensors

    def track(self, tensors: dict, tracker: Any) -> None:
        """`tensors` (a lent copy) went out in a reply; `tracker.done` says when
        the transport is done with their memory (None: done already)."""
        for c in (self.current, *self.older):
            if c is not None and c.tensors is tensors and c.lent > 0:
                c.lent -= 1
                if tracker is not None:
                    c.trackers.append(tracker)
                return
