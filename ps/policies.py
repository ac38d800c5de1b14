"""Consistency policies: how a shard turns pushes into updates and when it
may answer a pull. One class per algorithm, found by name in POLICIES.

A policy is driven by the shard's single loop (not thread-safe). `on_push`
returns the staleness of the push (shard updates since the version the
gradient was computed on). `pull_ready(worker, clock)` says whether a pull
from a worker that has made `clock` pushes may be answered now; clock -1
(the evaluator) is always ready. Parked pulls are re-checked after every push
and after a plan change. `adopt(plan)` switches to a new plan at a round
boundary: rounds still open are closed with the contributions they have, so
no pushed gradient is lost or applied twice.

Buffers (BatchNorm statistics) are not gradients: each push carries the
worker's current buffers and the shard keeps a running mean of them
(`TensorStore.mix_buffers`): a round moves the buffers toward the round's mean
with weight (members in the round) / P; async and ssp with weight 1/P.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from hetps.proto.codec import ProtocolError
from hetps.proto.messages import Push, Status
from hetps.proto.plan import ClusterPlan

from .optim import Updater
from .policy_state import from_plain, storable, to_plain
from .store import TensorStore


class ConsistencyPolicy(ABC):
    name: ClassVar[str]
    restored = False  # set when restored from a checkpoint: workers may be ahead of this state

    def __init__(self, store: TensorStore, updater: Updater, plan: ClusterPlan, params):
        self.store = store
        self.updater = updater
        self.params = params
        self.workers: list[int] = plan.worker_ids()
        self.plan_id = plan.plan_id

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

    def adopt(self, plan: ClusterPlan) -> None:
        """Switch to `plan` (new worker set or groups)."""
        self.workers = plan.worker_ids()
        self.plan_id = plan.plan_id

    def stats(self) -> dict:
        return {}

    _NOT_STATE = ("store", "updater", "params")

    def state_dict(self) -> dict:
        """What the policy counts and holds (clocks, open rounds, ...), for a
        checkpoint, as plain data (policy_state.py)."""
        return to_plain({k: v for k, v in vars(self).items() if k not in self._NOT_STATE})

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(from_plain(state))

    def reply_info(self, worker: int) -> dict:
        """Extras for the ACK of `worker`'s push (string keys), e.g. the next period."""
        return {}

    @abstractmethod
    def on_push(self, worker: int, push: Push) -> int: ...

    @abstractmethod
    def pull_ready(self, worker: int, clock: int) -> bool: ...


@storable
@dataclass
class Round:
    """Running sums of one group round."""

    grads: dict = field(default_factory=dict)
    buffers: dict = field(default_factory=dict)
    members: set = field(default_factory=set)
    buffer_counts: dict = field(default_factory=dict)  # buffers are optional: count who sent each

    def add(self, worker: int, grads: dict, buffers: dict) -> None:
        for target, values in ((self.grads, grads), (self.buffers, buffers)):
            for n, t in values.items():
                if n not in target:
                    target[n] = t.clone()
                elif t.is_floating_point():
                    target[n].add_(t)
                else:  # integer buffers (num_batches_tracked): keep the largest
                    torch.maximum(target[n], t, out=target[n])
        for n in buffers:
            self.buffer_counts[n] = self.buffer_counts.get(n, 0) + 1
        self.members.add(worker)

    def means(self) -> tuple[dict, dict]:
        k = len(self.members)
        return ({n: s.div_(k) for n, s in self.grads.items()},
                {n: s.div_(self.buffer_counts[n]) if s.is_floating_point() else s
                 for n, s in self.buffers.items()})


class GroupingPolicy(ConsistencyPolicy):
    """Grouping-SGD: inside a group, a round closes when every member pushed
    once, and the mean gradient is applied; groups never wait for each other.
    A group's update uses lr / staleness, staleness = 1 + updates applied by
    other groups since this group's last update (`scale_lr: false` turns the
    scaling off). A pull after `clock` pushes waits until all of them were
    applied."""

    name = "grouping"

    def __init__(self, store: TensorStore, updater: Updater, plan: ClusterPlan, params):
        super().__init__(store, updater, plan, params)
        self.rounds: dict[int, Round] = {}
        self.pushed: dict[int, int] = {}    # worker -> pushes accepted (clock of the next new push)
        self.applied: dict[int, int] = {}   # worker -> pushes applied in closed rounds
        self.group_updates: dict[int, int] = {}
        # group -> shard version right after its update (a resumed shard starts at its version)
        self.last_update_at: dict[int, int] = {g: store.version for g in range(len(self.groups_of(plan)))}
        self.staleness_sum: dict[int, int] = {}   # group -> sum of its updates' staleness
        self.counts = {"accepted": 0, "duplicates": 0, "contributions": 0}  # pushes in, pushes applied
        self._set_groups(plan)

    def groups_of(self, plan: ClusterPlan) -> list[list[int]]:
        return [list(g) for g in plan.groups] or [plan.worker_ids()]

    def _set_groups(self, plan: ClusterPlan) -> None:
        self.groups = self.groups_of(plan)
        self.group_of = {w: g for g, members in enumerate(self.groups) for w in members}
        for w in self.group_of:
            self.pushed.setdefault(w, 0)
            self.applied.setdefault(w, self.pushed[w])

    def adopt(self, plan: ClusterPlan) -> None:
        for g in list(self.rounds):
            self._close(g)  # flush: partial rounds are applied with the members they have
        super().adopt(plan)
        self._set_groups(plan)
        self.last_update_at = {g: self.store.version for g in range(len(self.groups))}

    def on_push(self, worker: int, push: Push) -> int:
        self.check_member(worker)
        grads, buffers = self.split(push)
        staleness = self.store.version - push.base_version
        if push.clock < self.pushed[worker]:
            self.counts["duplicates"] += 1
            return staleness  # duplicate or replayed push: it was taken once already
        self.counts["accepted"] += 1
        g = self.group_of[worker]
        self.pushed[worker] = push.clock + 1
        if push.plan_id < self.plan_id:
            # made under a plan whose rounds this shard already closed: applied alone, as the
            # flush would have; joining a new round would misalign rounds across shards
            late = Round()
            late.add(worker, grads, buffers)
            self._apply(g, late)
            return staleness
        self.rounds.setdefault(g, Round()).add(worker, grads, buffers)
        if self.rounds[g].members >= set(self.groups[g]):
            self._close(g)
        return staleness

    def _close(self, g: int) -> None:
        self._apply(g, self.rounds.pop(g))

    def _apply(self, g: int, rnd: Round) -> None:
        grads, buffers = rnd.means()
        staleness = 1 + self.store.version - self.last_update_at.get(g, 0)
        scale = 1.0 / staleness if getattr(self.params, "scale_lr", False) else 1.0
        self.updater.apply(grads, lr_scale=scale)
        self.store.mix_buffers(buffers, len(rnd.members) / max(1, len(self.workers)))
        self.store.mark_updated(grads)
        self.last_update_at[g] = self.store.version
        self.group_updates[g] = self.group_updates.get(g, 0) + 1
        self.staleness_sum[g] = self.staleness_sum.get(g, 0) + staleness
        self.counts["contributions"] += len(rnd.members)
        for w in rnd.members:
            self.applied[w] = self.pushed[w]

    def pull_ready(self, worker: int, clock: int) -> bool:
        return clock < 0 or self.applied.get(worker, 0) >= clock

    def stats(self) -> dict:
        return {"group_updates": {str(g): n for g, n in self.group_updates.items()},
                "group_staleness": {str(g): round(s / self.group_updates[g], 3)
                                    for g, s in self.staleness_sum.items()},  # mean per group
                "pending": sum(len(r.members) for r in self.rounds.values()), **self.counts}


class SyncPolicy(GroupingPolicy):
    """BSP: one group of every worker; each round's mean is applied once."""

    name = "sync"

    def groups_of(self, plan: ClusterPlan) -> list[list[int]]:
        return [plan.worker_ids()]


class AsyncPolicy(ConsistencyPolicy):
    """ASP: every push is applied at once; pulls are never held."""

    name = "async"

    def __init__(self, *args):
        super().__init__(*args)
        self.clocks = {w: 0 for w in self.workers}

    def adopt(self, plan: ClusterPlan) -> None:
        super().adopt(plan)
        self.clocks = {w: self.clocks.get(w, min(self.clocks.values(), default=0)) for w in self.workers}

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


POLICIES: dict[str, type[ConsistencyPolicy]] = {
    p.name: p for p in (SyncPolicy, AsyncPolicy, SspPolicy, GroupingPolicy)}
