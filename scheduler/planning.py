"""How the scheduler makes plans, as functions of what a plan is made from:
the first plan once every expected node registered (`first_plan`: shards
ranked fast to slow, tensors placed bottom layer first, groups formed by
speed, a resumed run's placement kept), the next plan for the live workers
when workers join, leave or die (`replanned`), and re-grouping while
training when measured speeds drift (`Regrouping`, which keeps the votes of
consecutive checks). Nothing here publishes a plan or reads a clock: the
coordinator does both (coordinator.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hetps.proto.plan import ClusterPlan, NodeEntry, TensorSpec, chunk_specs
from hetps.runconfig.algorithms import resolved_params
from hetps.runconfig.schema import RunConfig

from . import failover
from .formation import Formation
from .grouping import drifted
from .nodes import Node
from .placement import place, placement_shares


def first_plan(
    cfg: RunConfig,
    formation: Formation,
    shards: list[Node],
    workers: list[Node],
    specs: list[TensorSpec],
    schema: str,
    run_id: str,
    resumed: ClusterPlan | None = None,
) -> ClusterPlan:
    """Plan 1 for the registered `shards` and `workers` (any order) and the
    model's `specs` (schema hash `schema`), with the ring of backups when
    `cfg.cluster.replicas`. `resumed`: the stopped run's last plan when
    resuming; with the same schema each shard rank owns what it owned before
    (its checkpoint holds it)."""
    shards = sorted(shards, key=lambda n: (-n.speed, n.rank))  # fastest first
    workers = sorted(workers, key=lambda n: n.rank)
    # sparse tables are spread row by row over every shard (proto/sparse.py), never placed
    tables = [s for s in specs if s.kind == "table"]
    specs = [s for s in specs if s.kind != "table"]
    specs, chunks = chunk_specs(specs, cfg.cluster.chunk_bytes, len(shards))
    placement = place(specs, [n.speed for n in shards])
    if resumed is not None and resumed.schema_hash == schema:
        order = {s.rank: i for i, s in enumerate(resumed.shards)}
        shards.sort(key=lambda n: order.get(n.rank, len(order)))
        specs, chunks, placement = resumed.tensors, resumed.chunks, resumed.placement
        tables = resumed.tables
    plan = ClusterPlan(
        plan_id=1,
        algorithm=cfg.algorithm.name,
        algorithm_params=resolved_params(cfg.algorithm),
        workers=[NodeEntry(n.node_id, n.rank, n.address) for n in workers],
        shards=[NodeEntry(n.node_id, n.rank, n.address) for n in shards],
        tensors=specs,
        tables=tables,
        chunks=chunks,
        placement=placement,
        schema_hash=schema,
        run_id=run_id,
        speeds={str(n.node_id): round(n.speed, 3) for n in shards + workers},
        **formation.plan_fields({n.node_id: n.speed for n in workers}, cfg.algorithm.params),
    )
    plan = dataclasses.replace(plan, info={**plan.info, "placement": placement_shares(plan)})
    return failover.with_backups(plan, {n.node_id: n for n in shards}, cfg.cluster.replicas)


def replanned(
    plan: ClusterPlan, formation: Formation, params, workers: list[Node], reason: str
) -> ClusterPlan:
    """The plan after `plan` for the live `workers` (in the order given):
    same shards and placement, groups and data shares recomputed from their
    speeds under the algorithm's `params`; `reason` goes into its info."""
    speeds = {n.node_id: n.speed for n in workers}
    return dataclasses.replace(
        plan,
        plan_id=plan.plan_id + 1,
        workers=[NodeEntry(n.node_id, n.rank, n.address) for n in workers],
        speeds={**plan.speeds, **{str(w): round(s, 3) for w, s in speeds.items()}},
        info={"reason": reason},
        **formation.plan_fields(speeds, params),
    )


def with_group_since(plan: ClusterPlan, previous: ClusterPlan | None) -> ClusterPlan:
    """`plan` with `group_since`: for each group of two or more, keyed by its first
    member, the plan since which it has had exactly these members (carried over from
    `previous` when the group is unchanged, else this plan's id). Members name the group's
    collectives by it (worker/group_reduce.py), so a member that skipped plans agrees."""
    before = {}
    if previous is not None:
        for g in previous.groups:
            key = str(g[0]) if g else ""
            if key in previous.group_since:
                before[tuple(g)] = previous.group_since[key]
    since = {str(g[0]): before.get(tuple(g), plan.plan_id) for g in plan.groups if len(g) > 1}
    return dataclasses.replace(plan, group_since=since)


@dataclass
class Regrouping:
    """The re-grouping decision of a formation that may re-form its groups
    while training (formation.py; `params.regroup` on). `check` is called
    every `params.regroup_every_s` by the coordinator, which publishes what
    it returns. Speeds are noisy: a new grouping is acted on only once
    `params.confirm_checks` checks in a row proposed it (`votes`)."""

    formation: Formation
    params: object  # the run's algorithm params (RunConfig.algorithm.params)
    votes: list = field(default_factory=list)  # consecutive checks proposing the same new grouping

    @property
    def enabled(self) -> bool:
        return self.formation.may_regroup(self.params)

    def check(self, plan: ClusterPlan, workers: list[Node]) -> ClusterPlan | None:
        """The next plan when the speeds of `plan`'s `workers` drifted from
        the plan's beyond the hysteresis and the formation now proposes, for
        the `confirm_checks`-th check in a row, the same grouping other than
        the plan's; None otherwise. Not before every worker of the plan
        reported a measured speed."""
        if not all(n.stats.speed for n in workers):
            # a profiled speed (compute alone) and a measured one (compute and push) are not
            # comparable: groups are re-formed once every worker of the plan reported a measured one
            return None
        params = self.params
        speeds = {n.node_id: n.speed for n in workers}
        old = {w: plan.speeds.get(str(w), 1.0) for w in speeds}
        if not drifted(old, speeds, params.hysteresis):
            return None
        fields = self.formation.plan_fields(speeds, params)
        proposal = self.formation.proposal(fields, params)
        current = {"groups": plan.groups, "shares": plan.shares, "batches": plan.batches}
        if proposal == self.formation.proposal(current, params):
            self.votes = []
            return None
        self.votes = [v for v in self.votes if v == proposal] + [proposal]
        if len(self.votes) < params.confirm_checks:
            return None
        self.votes = []
        return dataclasses.replace(
            plan,
            plan_id=plan.plan_id + 1,
            speeds={**plan.speeds, **{str(w): round(s, 3) for w, s in speeds.items()}},
            **fields,
        )
