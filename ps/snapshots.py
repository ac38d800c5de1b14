"""Pull replies without a copy per version: copy-on-write snapshots.

A pull reply carries the shard's tensors as they are when it is answered and
leaves zero-copy: ZeroMQ reads the memory after the handler has returned.
So the shard must not write that memory while such a reply is in flight.
Rather than copying every tensor for every version, a reply carries aliases
of the live tensors (`lend`), and whatever may write the live tensors first
calls `settle`: if a reply may still read their memory (its transport's
tracker is not `done`, or the aliases were handed out and never tracked at
all, e.g. to an in-process caller), the live tensors move to other memory
(a copy, into the memory of an older reply that has finished when there is
one) and the replies keep the old memory, unchanged for good. A store whose
tensors are views of one arena (arena.py) passes it: the arena moves as a
whole and its views are re-seated. In a worker's
push-then-pull loop the previous reply has arrived before the next push, so
no copy is made at all.

The Shard calls `settle` before every handler other than PULL's and before a
plan switch or a restore; any other code that writes a store's tensors must
do the same. Not thread-safe: the shard's loop owns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from hetps.proto.codec import EncodedTensors
from hetps.proto.tensors import Tensors

KEEP = 2  # older memory remembered for reuse; more is left to the garbage collector


@dataclass
class _Lend:
    aliases: Tensors  # views of one generation of the live memory
    untracked: int = 0  # handed out, no tracker heard of yet
    trackers: list = field(default_factory=list)
    memory: torch.Tensor | None = None  # the arena memory they view, if any

    def in_flight(self) -> bool:
        return self.untracked > 0 or not all(t.done for t in self.trackers)

    def fits(self, live: Mapping[str, torch.Tensor]) -> bool:
        return list(self.aliases) == list(live) and all(
            a.shape == t.shape and a.dtype == t.dtype and a.stride() == t.stride()
            for a, t in zip(self.aliases.values(), live.values())
        )


class Snapshots:
    def __init__(self):
        self.current: _Lend | None = None  # aliases of the live memory, lent since the last settle
        self.older: list[_Lend] = []  # memory the live tensors moved away from
        self.moves = 0  # settles that had to copy the live tensors
        self.reused = 0  # of which into older memory

    def lend(
        self,
        live: Mapping[str, torch.Tensor],
        arena=None,
        encode: Callable[[dict[str, torch.Tensor], torch.Tensor | None], EncodedTensors]
        | None = None,
    ) -> Tensors:
        """Aliases of `live` (views of `arena`, if given) for a reply (the same
        value until the next settle), carrying `encode(aliases, arena memory)`
        when given; counted as in flight until `track` hears of it."""
        if self.current is None:
            aliases = {n: t.detach() for n, t in live.items()}
            memory = arena.memory.detach() if arena is not None else None
            encoded = encode(aliases, memory) if encode is not None else None
            self.current = _Lend(Tensors(aliases, encoded=encoded), memory=memory)
        self.current.untracked += 1
        return self.current.aliases

    def track(self, aliases: Mapping[str, torch.Tensor], tracker: Any) -> None:
        """`aliases` (lent) went out in a reply; `tracker.done` says when the
        transport is done with their memory (None: done already)."""
        for lend in (self.current, *self.older):
            if lend is not None and lend.aliases is aliases and lend.untracked > 0:
                lend.untracked -= 1
                if tracker is not None:
                    lend.trackers.append(tracker)
                return

    def settle(self, live: Mapping[str, torch.Tensor], arena=None) -> None:
        """Call before writing `live` (views of `arena`, if given) in place:
        afterwards no reply reads their memory."""
        lend, self.current = self.current, None
        if lend is None or not lend.in_flight():
            return
        if arena is not None:
            self._move_arena(arena, lend)
            return
        spare = next((o for o in self.older if not o.in_flight() and o.fits(live)), None)
        if spare is None:
            targets = [torch.empty_like(t) for t in live.values()]
        else:
            self.older.remove(spare)
            self.reused += 1
            targets = list(spare.aliases.values())
        torch._foreach_copy_(targets, list(live.values()))
        for t, target in zip(live.values(), targets):
            t.set_(target)  # the same tensor objects (the optimizer holds them), other memory
        self.moves += 1
        self.older = [o for o in (*self.older, lend) if o.untracked == 0][-KEEP:]

    def _move_arena(self, arena, lend: _Lend) -> None:
        spare = next(
            (
                o
                for o in self.older
                if not o.in_flight() and o.memory is not None and o.memory.numel() == arena.nbytes
            ),
            None,
        )
        if spare is None:
            target = torch.empty_like(arena.memory)
        else:
            self.older.remove(spare)
            self.reused += 1
            target = spare.memory
        arena.move_to(target)
        self.moves += 1
        self.older = [o for o in (*self.older, lend) if o.untracked == 0][-KEEP:]
