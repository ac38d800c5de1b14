"""Synchronous rounds inside groups: Grouping-SGD and its one-group case,
Sync-SGD (BSP), and balanced (BSP with speed-proportional batches, whose
round mean is weighted by samples). A group's round closes when every member
pushed once; the mean gradient is applied with the shared update path (base.py).
"""

from __future__ import annotations

from hetps.proto.codec import ProtocolError
from hetps.proto.messages import Push, Status
from hetps.proto.plan import ClusterPlan
from hetps.ps.store import TensorStore
from hetps.ps.updater import Updater

from .base import ConsistencyPolicy, Round


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
        self.applied: dict[int, int] = {}  # worker -> pushes applied in closed rounds
        self.group_updates: dict[int, int] = {}
        # group -> shard version right after its update (a resumed shard starts at its version)
        self.last_update_at: dict[int, int] = {
            g: store.version for g in range(len(self.groups_of(plan)))
        }
        self.staleness_sum: dict[int, int] = {}  # group -> sum of its updates' staleness
        self.counts["contributions"] = 0  # pushes applied (accepted: pushes in)
        # worker -> the size of its group in the plan before the current one: a push made under
        # that plan counts as its share of that group's round mean (`on_push`)
        self.late_share: dict[int, int] = {}
        self._set_groups(plan)

    def groups_of(self, plan: ClusterPlan) -> list[list[int]]:
        return [list(g) for g in plan.groups] or [plan.worker_ids()]

    def check_members(self, worker: int, push: Push) -> None:
        """Under this plan: the sender and its group's members. Made under an older plan (it
        arrives after a re-plan, applied as its share of that plan's group): the sender among
        nodes this shard has taken pushes from or serves."""
        g = self.group_of.get(worker)
        nodes = {n for n, _ in push.members}
        if push.plan_id < self.plan_id:
            known = set(self.pushed) | set(self.workers)
            if worker in nodes and nodes <= known:
                return
        if worker not in nodes or any(self.group_of.get(n) != g for n in nodes):
            raise ProtocolError(
                Status.BAD_STATE,
                f"aggregated push from node {worker}: members {sorted(nodes)[:8]} are not "
                f"all of its group {self.groups[g] if g is not None else '?'} in plan {self.plan_id}",
            )

    def _set_groups(self, plan: ClusterPlan) -> None:
        self.groups = self.groups_of(plan)
        self.group_of = {w: g for g, members in enumerate(self.groups) for w in members}
        for w in self.group_of:
            self.pushed.setdefault(w, 0)
            self.applied.setdefault(w, self.pushed[w])

    def adopt(self, plan: ClusterPlan) -> None:
        for g in list(self.rounds):
            self._close(g)  # flush: partial rounds are applied with the members they have
        self.late_share = {w: len(members) for members in self.groups for w in members}
        old_group_of = dict(self.group_of)
        super().adopt(plan)
        self.restored = False  # a new worker set: clocks need not line up any more
        self._set_groups(plan)
        self.last_update_at = {g: self.store.version for g in range(len(self.groups))}
        # the groups' snapshots were of other members: each new group's first update is plain
        self.served = {}
        if self.state_key(0) is not None:
            # a new group steps the mean of its members' old groups' states, by members
            parts = {}
            for g, members in enumerate(self.groups):
                came = [old_group_of[w] for w in members if w in old_group_of]
                parts[g] = [(o, float(came.count(o))) for o in sorted(set(came))]
            self.updater.regroup_states(parts)

    def state_key(self, g: int) -> int | None:
        """The optimizer state group `g`'s updates step: its own with `optimizer_state:
        per_group`, else the shared one (None)."""
        return g if getattr(self.params, "optimizer_state", None) == "per_group" else None

    def on_push(self, worker: int, push: Push) -> int:
        got = self.accept(worker, push)
        if got.duplicate:
            return got.staleness
        g = self.group_of[worker]
        open_round = self.rounds.get(g)
        realigning = (
            self.restored
            and open_round is not None
            and open_round.clock >= 0
            and worker not in open_round.members
        )
        if push.plan_id < self.plan_id or (realigning and push.clock < open_round.clock):
            # made under a plan whose rounds this shard already closed (or, restored, for a
            # round the others' pushes already left): applied alone, as the flush would have;
            # joining a new round would misalign rounds across shards
            late = Round()
            late.add(
                worker,
                got.tensors,
                got.buffers,
                self.weight_of(push),
                True,
                self.members_of(worker, push),
                push.n_samples,
            )
            # its share of the old group's round, not a whole group's update: after a re-plan
            # every member's push in flight arrives late, and 64 of them applied whole, each a
            # step at the group's lr, threw a trained model back to chance (docs/algorithms.md)
            share = self.late_share.get(worker, 1) if push.plan_id < self.plan_id else 0
            self._apply(g, late, share)
            return got.staleness
        if realigning and push.clock > open_round.clock:
            self._close(g)  # restored: this worker's push for the open round was lost
        rnd = self.rounds.setdefault(g, Round(clock=push.clock))
        group = self.groups[g]
        # the set test only where the count says it may close (each push used to build two sets)
        joining = self.members_of(worker, push)
        closes = len(rnd.members) + len(joining) >= len(group) and rnd.members | joining >= set(
            group
        )
        rnd.add(
            worker, got.tensors, got.buffers, self.weight_of(push), closes, joining, push.n_samples
        )
        if closes:
            self._close(g)
            self.restored = False  # a full round again: pushes pair by arrival as before
        return got.staleness

    def _close(self, g: int) -> None:
        self._apply(g, self.rounds.pop(g))

    def _apply(self, g: int, rnd: Round, over: float = 0) -> None:
        """Apply `rnd`'s mean: its sum over `over` (0: the policy's `divisor`)."""
        grads, buffers = rnd.means(over or self.divisor(rnd))
        staleness = 1 + self.store.version - self.last_update_at.get(g, 0)
        self.apply_update(
            self.compensated(g, grads),
            buffers,
            len(rnd.members) / max(1, len(self.workers)),
            # a late push stands for its old group's round (`over` members)
            self.lr_scale(staleness, over or len(rnd.members)),
            self.group_momentum(),
            self.state_key(g),
            rnd.samples,
        )
        self.remember_served(g)
        self.last_update_at[g] = self.store.version
        self.group_updates[g] = self.group_updates.get(g, 0) + 1
        self.staleness_sum[g] = self.staleness_sum.get(g, 0) + staleness
        self.counts["contributions"] += len(rnd.members)
        for w in rnd.members:
            self.applied[w] = self.pushed[w]

    def release_mark(self):
        # a pull waits for its worker's pushes to be applied, and `applied` moves only where a round
        # is applied (the version moves with it) or the plan changes (the shard re-checks then)
        return self.store.version

    @staticmethod
    def members_of(worker: int, push: Push) -> set[int]:
        """The nodes whose gradients `worker`'s push carries: an aggregated push's members, else
        the sender."""
        return {n for n, _ in push.members} if push.members else {worker}

    def weight_of(self, push: Push) -> float:
        """How much a push's gradient counts in its round's mean (1: plain mean; an aggregated
        push is its members' mean, so it counts once per member)."""
        return float(len(push.members)) if push.members else 1.0

    def divisor(self, rnd: Round) -> float:
        """What a round's gradient sum is divided by (0: its members)."""
        return 0

    def lr_scale(self, staleness: int, members: float) -> float:
        """The group update's lr factor: members / P with `lr_share` (the update's share of
        a round of all P workers), times 1 / staleness with `scale_lr`."""
        share = members / max(1, len(self.workers)) if self.params.lr_share else 1.0
        return share / staleness if self.params.scale_lr else share

    def group_momentum(self) -> float | None:
        """A group update's momentum with `momentum_correction`: G groups updating
        asynchronously add about 1 - 1/G of implicit momentum (Mitliagkas et al.,
        "Asynchrony begets momentum", 2016), so the optimizer's own is lowered to keep
        their sum at the configured m: max(0, m - (1 - 1/G)). None: as configured."""
        g = len(self.groups)
        if not getattr(self.params, "momentum_correction", False) or g < 2:
            return None
        return max(0.0, self.updater.momentum - (1.0 - 1.0 / g))

    def pull_ready(self, worker: int, clock: int) -> bool:
        return clock < 0 or self.applied.get(worker, 0) >= clock

    def blockers(self, worker: int, clock: int) -> set[int]:
        """The members of the worker's group missing from its open round."""
        g = self.group_of.get(worker)
        rnd = self.rounds.get(g)
        return (
            set()
            if rnd is None or self.pull_ready(worker, clock)
            else set(self.groups[g]) - rnd.members
        )

    def stats(self) -> dict:
        return {
            "group_updates": {str(g): n for g, n in self.group_updates.items()},
            "group_staleness": {
                str(g): round(s / self.group_updates[g], 3) for g, s in self.staleness_sum.items()
            },  # mean per group
            "pending": sum(len(r.members) for r in self.rounds.values()),
            **self.counts,
        }


class SyncPolicy(GroupingPolicy):
    """BSP: one group of every worker; each round's mean is applied once."""

    name = "sync"

    def groups_of(self, plan: ClusterPlan) -> list[list[int]]:
        return [plan.worker_ids()]

    def lr_scale(self, staleness: int, members: float) -> float:
        return 1.0  # one group: nobody else updates in between

    def group_momentum(self) -> float | None:
        return None  # one group: no asynchrony


class BalancedPolicy(SyncPolicy):
    """Sync with unequal batches: a round's gradient is the sample-weighted
    mean, sum_i n_i g_i / sum_i n_i, with n_i the push's `n_samples` (each
    worker's g_i is the mean over its own batch), i.e. the mean gradient over
    the round's global batch. Equal batches give exactly sync's mean."""

    name = "balanced"

    def weight_of(self, push: Push) -> float:
        # relative to the mean batch of the plan, so equal batches weigh exactly 1.0 each
        mean = self.params.global_batch / max(1, len(self.workers))
        return push.n_samples / mean if push.n_samples > 0 and mean > 0 else 1.0

    def divisor(self, rnd: Round) -> float:
        return rnd.weight
