"""Consistency policies: how a shard turns pushes into updates and when it
may answer a pull. One class per algorithm, found by name in POLICIES.

A policy is driven by the shard's single loop (not thread-safe). `on_push`
returns the staleness of the push (shard updates since the version the
gradient was computed on). `pull_ready(worker, clock)` says whether a pull
from a worker that has made `clock` pushes may be answered now; clock -1
(the evaluator) is always ready. Parked pulls are re-checked after every push.

Buffers (BatchNorm statistics) are not gradients: each push carries the
worker's current buffers, and the shard keeps a running mean of them
(`TensorStore.mix_buffers`): sync averages the round's buffers; async and ssp
move toward each pushed value with weight 1/P.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from hetps.proto.codec import ProtocolError
from hetps.proto.messages import Push, Status

from .optim import Updater
from .store import TensorStore


class ConsistencyPolicy(ABC):
    name: ClassVar[str]

    def __init__(self, store: TensorStore, updater: Updater, workers: list[int], params):
        self.store = store
        self.updater = updater
        self.workers = list(workers)
        self.params = params

    def split(self, push: Push) -> tuple[dict, dict]:
        """The push's gradients (all parameters required) and buffers (optional)."""
        grads = {n: push.tensors[n] for n in self.store.param_names() if n in push.tensors}
        if len(grads) != len(self.store.param_names()):
            missing = sorted(set(self.store.param_names()) - set(grads))
            raise ProtocolError(Status.MALFORMED, f"PUSH lacks gradients for {missing[:5]}")
        buffers = {n: push.tensors[n] for n in self.store.buffer_names() if n in push.tensors}
        return grads, buffers

    def check_member(self, worker: int) -> None:
        if worker not in self.workers:
            raise ProtocolError(Status.BAD_STATE, f"node {worker} is not a worker of this plan")

    @abstractmethod
    def on_push(self, worker: int, push: Push) -> int: ...

    @abstractmethod
    def pull_ready(self, worker: int, clock: int) -> bool: ...


@dataclass
class Round:
    """Running sums of one synchronous round."""

    grads: dict = field(default_factory=dict)
    buffers: dict = field(default_factory=dict)
    members: set = field(default_factory=set)

    def add(self, worker: int, grads: dict, buffers: dict) -> None:
        for target, values in ((self.grads, grads), (self.buffers, buffers)):
            for n, t in values.items():
                if n not in target:
                    target[n] = t.clone()
                elif t.is_floating_point():
                    target[n].add_(t)
                else:  # integer buffers (num_batches_tracked): keep the largest
                    torch.maximum(target[n], t, out=target[n])
        self.members.add(worker)

    def means(self) -> tuple[dict, dict]:
        k = len(self.members)
        return ({n: s.div_(k) for n, s in self.grads.items()},
                {n: s.div_(k) if s.is_floating_point() else s for n, s in self.buffers.items()})


class SyncPolicy(ConsistencyPolicy):
    """BSP: round r closes when every worker pushed its r-th gradient; the
    mean is applied once; a pull after r+1 pushes waits for round r."""

    name = "sync"

    def __init__(self, *args):
        super().__init__(*args)
        self.rounds: dict[int, Round] = {}
        self.closed = 0  # rounds applied so far

    def on_push(self, worker: int, push: Push) -> int:
        self.check_member(worker)
        grads, buffers = self.split(push)
        staleness = self.store.version - push.base_version
        if push.clock < self.closed:
            return staleness  # replay of a closed round: already applied once
        rnd = self.rounds.setdefault(push.clock, Round())
        if worker in rnd.members:
            return staleness  # duplicate push
        rnd.add(worker, grads, buffers)
        self._close_ready_rounds()
        return staleness

    def _close_ready_rounds(self) -> None:
        while (rnd := self.rounds.get(self.closed)) and rnd.members >= set(self.workers):
            grads, buffers = rnd.means()
            self.updater.apply(grads)
            self.store.mix_buffers(buffers, 1.0)
            self.store.mark_updated(grads)
            del self.rounds[self.closed]
            self.closed += 1

    def pull_ready(self, worker: int, clock: int) -> bool:
        return clock < 0 or self.closed >= clock


class AsyncPolicy(ConsistencyPolicy):
    """ASP: every push is applied at once; pulls are never held."""

    name = "async"

    def __init__(self, *args):
        super().__init__(*args)
        self.clocks = {w: 0 for w in self.workers}

    def on_push(self, worker: int, push: Push) -> int:
        self.check_member(worker)
        grads, buffers = self.split(push)
        if push.clock < self.clocks[worker]:
            return 0  # duplicate or replayed push: applied once already
        staleness = self.store.version - push.base_version
        self.updater.apply(grads)
        self.store.mix_buffers(buffers, 1.0 / len(self.workers))
        self.store.mark_updated(grads)
        self.clocks[worker] = push.clock + 1
        return staleness

    def pull_ready(self, worker: int, clock: int) -> bool:
        return True


class SspPolicy(AsyncPolicy):
    """Stale synchronous parallel: applied like async, but a worker that has
    made `clock` pushes may only read once the slowest worker has made at
    least clock - staleness."""

    name = "ssp"

    def pull_ready(self, worker: int, clock: int) -> bool:
        return clock < 0 or min(self.clocks.values()) >= clock - self.params.staleness


POLICIES: dict[str, type[ConsistencyPolicy]] = {p.name: p for p in (SyncPolicy, AsyncPolicy, SspPolicy)}
