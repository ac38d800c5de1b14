"""What every consistency policy shares: the push-acceptance path, the
gradient round and the one way a mean gradient reaches the tensors.

A policy is driven by the shard's single loop (not thread-safe). `on_push`
returns the staleness of the push (shard updates since the version the
gradient was computed on). `pull_ready(worker, clock)` says whether a pull
from a worker that has made `clock` pushes may be answered now; clock -1
(the evaluator) is always ready. Parked pulls are re-checked after a push
that moved `release_mark()` and after a plan change. `adopt(plan)` switches
to a new plan at a round boundary: rounds still open are closed with the
contributions they have, so no pushed gradient is lost or applied twice.

Buffers (BatchNorm statistics) are not gradients: each push carries the
worker's current buffers and the shard keeps a running mean of them
(`TensorStore.mix_buffers`): a round moves the buffers toward the round's mean
with weight (members in the round) / P; async and ssp with weight 1/P.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch

from hetps.proto.codec import ProtocolError
from hetps.proto.messages import Push, Status
from hetps.proto.plan import ClusterPlan
from hetps.ps.policy_state import from_plain, storable, to_plain
from hetps.ps.round_sums import add_to_sum, copy_sum, divide_sum
from hetps.ps.store import TensorStore
from hetps.ps.updater import Updater


@dataclass(frozen=True)
class Accepted:
    """A push that passed the shared checks: its tensors split in two."""

    tensors: dict  # gradients (or a model's parameters), every parameter present
    buffers: dict  # the buffers it carried (optional ones may be missing)
    staleness: int  # shard version minus the version the push was computed on
    duplicate: bool = False  # a re-sent or replayed push: it was taken once already


class Waiting(NamedTuple):
    """A node the shard waits for: since when (the parked pulls' clock,
    seconds) and the workers whose pulls wait for it."""

    node: int
    since: float
    waiters: frozenset = frozenset()


class ConsistencyPolicy(ABC):
    name: ClassVar[str]
    restored = False  # set when restored from a checkpoint: workers may be ahead of this state

    def __init__(self, store: TensorStore, updater: Updater, plan: ClusterPlan, params):
        self.store = store
        self.updater = updater
        self.params = params
        self.workers: list[int] = plan.worker_ids()
        self.plan_id = plan.plan_id
        self.pushed: dict[int, int] = {}  # worker -> clock of its next new push
        self.counts = {"accepted": 0, "duplicates": 0}
        # delay compensation: sender key -> the parameter values right after its last update
        self.served: dict[int, dict] = {}

    # ------------------------------------------------------------ the shared acceptance path
    def accept(self, worker: int, push: Push) -> Accepted:
        """Every push goes through here first: the sender must be a worker of
        the plan (BAD_STATE) and send every parameter (MALFORMED); a push whose
        clock is below the worker's next clock is a duplicate (counted, nothing
        else happens). Otherwise `admit` may still refuse it (raises
        ProtocolError before any state changes), then the worker's clock moves
        past it."""
        self.check_member(worker)
        if push.members:
            self.check_members(worker, push)
        tensors, buffers = self.split(push)
        staleness = self.store.version - push.base_version
        if push.clock < self.pushed.get(worker, 0):
            self.counts["duplicates"] += 1
            return Accepted(tensors, buffers, staleness, duplicate=True)
        self.admit(worker, push)
        self.pushed[worker] = push.clock + 1
        for member, clock in push.members:  # an aggregated push moves every member's clock
            self.pushed[member] = max(self.pushed.get(member, 0), clock + 1)
        self.counts["accepted"] += 1
        if push.members:
            self.counts["aggregated"] = self.counts.get("aggregated", 0) + 1
        return Accepted(tensors, buffers, staleness)

    def check_members(self, worker: int, push: Push) -> None:
        """An aggregated push (Push.members): only where the policy reduces inside groups, with
        the sender among members of one group of the plan (BAD_STATE otherwise)."""
        raise ProtocolError(
            Status.BAD_STATE, f"{self.name} takes no aggregated push (members): groups of one"
        )

    def admit(self, worker: int, push: Push) -> None:
        """Hook: refuse a new push by raising ProtocolError (no state changed yet)."""

    def split(self, push: Push) -> tuple[dict, dict]:
        """The push's gradients (all parameters required) and buffers (optional)."""
        # just the parameters, in order: the push's
        if tuple(push.tensors) == self.store.param_order:
            # own dict, with any runs its decoder found
            return push.tensors, {}
        grads = {n: push.tensors[n] for n in self.store.param_names() if n in push.tensors}
        if len(grads) != len(self.store.param_names()):
            missing = sorted(set(self.store.param_names()) - set(grads))
            raise ProtocolError(Status.MALFORMED, f"PUSH lacks gradients for {missing[:5]}")
        buffers = {n: push.tensors[n] for n in self.store.buffer_names() if n in push.tensors}
        return grads, buffers

    def check_member(self, worker: int) -> None:
        if worker not in self.workers:
            raise ProtocolError(Status.BAD_STATE, f"node {worker} is not a worker of this plan")

    # ------------------------------------------------------------ the one update path for gradients
    def apply_update(
        self,
        grads: dict,
        buffers: dict,
        buffer_weight: float,
        lr_scale: float = 1.0,
        momentum: float | None = None,
        state_key: int | None = None,
        samples: int = 0,
    ) -> None:
        """One optimizer step on `grads` (lr times `lr_scale`; `momentum` instead of the
        configured one, None: as configured; `state_key`: the optimizer state of that group,
        None: the shared one; `samples`: the samples it stands for, the lr schedule's clock),
        buffers moved toward `buffers` with `buffer_weight`, the shard's version bumped."""
        self.updater.apply(
            grads, lr_scale=lr_scale, momentum=momentum, state_key=state_key, samples=samples
        )
        self.store.mix_buffers(buffers, buffer_weight)
        self.store.mark_updated(grads)

    # ------------------------------------------------------------ delay compensation (DC-ASGD)
    def compensated(self, key: int, grads: dict) -> dict:
        """`grads` with `algorithm.delay_compensation` lambda > 0 (Zheng et al., "Asynchronous
        Stochastic Gradient Descent with Delay Compensation", ICML 2017): g + lambda * g * g *
        (w_now - w_stale), w_stale the values right after `key`'s previous update (what the
        shard served it then; `remember_served`). Unchanged without lambda or before `key`'s
        first update. New tensors: a push's memory is only read."""
        lam = getattr(self.params, "delay_compensation", 0.0)
        stale = self.served.get(key) if lam else None
        if stale is None:
            return grads
        now = self.store.tensors
        return {
            n: torch.addcmul(g, g * g, now[n] - stale[n], value=lam) if g.is_floating_point() else g
            for n, g in grads.items()
        }

    def remember_served(self, key: int) -> None:
        """Keep the parameter values after `key`'s update, its next gradient's w_stale."""
        if getattr(self.params, "delay_compensation", 0.0):
            self.served[key] = {
                n: self.store.tensors[n].detach().clone() for n in self.store.param_names()
            }

    # ------------------------------------------------------------ plan changes, stats, checkpoints
    def adopt(self, plan: ClusterPlan) -> None:
        """Switch to `plan` (new worker set or groups)."""
        self.workers = plan.worker_ids()
        self.plan_id = plan.plan_id

    def stats(self) -> dict:
        return dict(self.counts)

    _NOT_STATE = ("store", "updater", "params")

    def state_dict(self) -> dict:
        """What the policy counts and holds (clocks, open rounds, ...), for a
        checkpoint, as plain data (policy_state.py)."""
        return to_plain({k: v for k, v in vars(self).items() if k not in self._NOT_STATE})

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(from_plain(state))

    # ------------------------------------------------------------ stall attribution
    def blockers(self, worker: int, clock: int) -> set[int]:
        """Hook: the nodes whose pushes a pull of `worker` after `clock`
        pushes waits for (the open round's missing members, the workers below
        the ssp bound, ...); empty when it waits for nobody in particular."""
        return set()

    def waiting_for(self, pulls: Iterable[tuple[int, int, float]]) -> list[Waiting]:
        """Read-only: whom the parked pulls (worker, clock, since) wait for,
        one entry per node, `since` the earliest of its waiters (the caller's
        clock). Every open round has parked pulls of the members that pushed,
        so its missing members are named here too."""
        since: dict[int, float] = {}
        waiters: dict[int, set[int]] = {}
        for worker, clock, parked_at in pulls:
            for node in self.blockers(worker, clock) - {worker}:
                since[node] = min(since.get(node, parked_at), parked_at)
                waiters.setdefault(node, set()).add(worker)
        return [Waiting(n, since[n], frozenset(waiters[n])) for n in sorted(since)]

    def release_mark(self):
        """A value that changes whenever a parked pull may have become ready:
        the shard re-checks its parked pulls after a push only when it moved.
        Here any accepted push counts (the safe default); a policy whose pulls
        wait only for the shard's version returns that."""
        return (self.store.version, self.counts["accepted"])

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
    """Running sums of one round of gradient pushes."""

    # the gradients' sum (round_sums.py): a Tensors with its runs, or a plain dict once restored
    grads: Mapping[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict = field(default_factory=dict)
    members: set = field(default_factory=set)
    buffer_counts: dict = field(default_factory=dict)  # buffers are optional: count who sent each
    clock: int = -1  # clock of the push that opened it (used while a restored shard realigns)
    weight: float = 0.0  # sum of the members' weights (balanced: samples)
    samples: int = 0  # the pushes' n_samples: the lr schedule's clock
    # set per round by `add(borrow=True)`: `grads` is a peer's memory
    borrowed: ClassVar[bool] = False

    def add(
        self,
        worker: int,
        grads: dict,
        buffers: dict,
        weight: float = 1.0,
        borrow: bool = False,
        members: Iterable[int] = (),
        samples: int = 0,
    ) -> None:
        """Add a member's push; its gradients count `weight` times (1: plain sum).
        `borrow`: the caller closes the round before the push's memory may
        change (in the same call), so a first push is kept as it is, not
        copied; `means` copies it only if it must divide. `members`: the nodes an
        aggregated push stands for (its gradients their mean, `weight` their total).
        `samples`: the push's n_samples."""
        self.samples += samples
        if weight != 1.0:  # exactly the plain sum when every weight is 1
            grads = {n: t * weight if t.is_floating_point() else t for n, t in grads.items()}
        self.weight += weight
        if self.borrowed:
            self.grads, self.borrowed = copy_sum(self.grads), False
        if self.members:
            self.grads = add_to_sum(self.grads, grads)
        elif borrow:
            self.grads, self.borrowed = grads, True
        else:  # the first push: copied run by run when it came as runs (round_sums.py)
            self.grads = copy_sum(grads)
        for n, t in buffers.items():
            if n not in self.buffers:
                self.buffers[n] = t.clone()
            elif t.is_floating_point():
                self.buffers[n].add_(t)
            else:  # integer buffers (num_batches_tracked): keep the largest
                torch.maximum(self.buffers[n], t, out=self.buffers[n])
        for n in buffers:
            self.buffer_counts[n] = self.buffer_counts.get(n, 0) + 1
        self.members.add(worker)
        self.members.update(members)

    def means(self, over: int = 0) -> tuple[dict, dict]:
        """The mean gradient (sum / `over`, default the members) and the mean
        float buffers (over those who sent each); integer buffers stay the max.
        Divides the sums in place: a round is closed once."""
        k = over or len(self.members)
        if self.borrowed and k != 1:
            self.grads, self.borrowed = copy_sum(self.grads), False
        return (
            divide_sum(self.grads, k),
            {
                n: s.div_(self.buffer_counts[n]) if s.is_floating_point() else s
                for n, s in self.buffers.items()
            },
        )
