"""The scheduler's plans (a part of `Coordinator`): the first plan once
every expected node registered (shards ranked fast to slow, tensors placed
bottom layer first, groups formed by speed), a new plan when workers leave
or die, re-grouping when measured speeds drift, and publishing a plan to the
run log, the state file and the nodes waiting for it."""
from __future__ import annotations

import dataclasses
import logging
import time

from hetps.runconfig.algorithms import resolved_params
from hetps.proto.messages import Plan
from hetps.proto.plan import ClusterPlan, NodeEntry, chunk_specs

from . import failover, state
from .grouping import drifted
from .nodes import Node
from .placement import place

log = logging.getLogger(__name__)


class Planning:
    """Plan making for `Coordinator` (it provides cfg, nodes, members, expected,
    specs/schema, resumed_plan, plan, plan_waiters, plan_checked, regroup_votes,
    formation, run_id, runlog, clock, elapsed, reply, begin_stop, stop_reason)."""

    def _maybe_plan(self) -> None:
        if self.plan is not None or self.specs is None:
            return
        shards = sorted(self.members("ps"), key=lambda n: (-n.speed, n.rank))  # fastest first
        workers = sorted(self.members("worker"), key=lambda n: n.rank)
        if len(shards) < self.expected["ps"] or len(workers) < self.expected["worker"]:
            return
        specs, chunks = chunk_specs(self.specs, self.cfg.cluster.chunk_bytes)
        placement = place(specs, [n.speed for n in shards])
        previous = self.resumed_plan
        if previous is not None and previous.schema_hash == self.schema:
            # a resumed run: each shard rank owns what it owned before (its checkpoint holds it)
            order = {s.rank: i for i, s in enumerate(previous.shards)}
            shards.sort(key=lambda n: order.get(n.rank, len(order)))
            specs, chunks, placement = previous.tensors, previous.chunks, previous.placement
        plan = ClusterPlan(
            plan_id=1, algorithm=self.cfg.algorithm.name, algorithm_params=resolved_params(self.cfg.algorithm),
            workers=[NodeEntry(n.node_id, n.rank) for n in workers],
            shards=[NodeEntry(n.node_id, n.rank, n.address) for n in shards],
            tensors=specs, chunks=chunks, placement=placement, schema_hash=self.schema, run_id=self.run_id,
            speeds={str(n.node_id): round(n.speed, 3) for n in shards + workers},
            **self._grouping({n.node_id: n.speed for n in workers}))
        plan = failover.with_backups(plan, self.nodes, self.cfg.cluster.replicas)
        self.started = self.clock()  # the run's clock starts when the plan goes out
        # waiting for the plan is not silence: heartbeats start once it arrives
        for n in shards + workers + self.members("spare"):
            n.last_seen = self.started
        self._publish(plan)

    def live_workers(self) -> list[Node]:
        return sorted((n for n in self.members("worker") if not n.gone), key=lambda n: (n.rank, n.node_id))

    def _replan(self, reason: str) -> None:
        """A new plan for the live workers: same shards and placement, groups
        and data shares recomputed. Shards close the rounds still open when
        they adopt it, so nobody waits for a worker that is gone."""
        workers = self.live_workers()
        if not workers:
            self.begin_stop(f"no live workers left ({reason})")
            return
        speeds = {n.node_id: n.speed for n in workers}
        log.info("re-planning: %s", reason)
        self._publish(dataclasses.replace(
            self.plan, plan_id=self.plan.plan_id + 1, workers=[NodeEntry(n.node_id, n.rank) for n in workers],
            speeds={**self.plan.speeds, **{str(w): round(s, 3) for w, s in speeds.items()}},
            info={"reason": reason}, **self._grouping(speeds)))

    def _detect_dead(self) -> None:
        """Workers silent for longer than dead_after_s leave the plan. A
        silent shard is recorded: its tensors cannot move, so workers retry
        until it comes back (restarted from its checkpoint) or their request
        timeout ends the run."""
        now = self.clock()
        for n in self.members("worker", "ps", "spare"):
            silent = now - n.last_seen
            if n.gone or silent <= self.cfg.cluster.dead_after_s:
                continue
            n.dead = True
            self.failures.append(n.failure("dead", round(self.elapsed(), 3), silent_s=round(silent, 3)))
            log.warning("%s %d (node %d) silent for %.1fs: declared dead", n.role, n.rank, n.node_id, silent)
            if n.role == "worker" and self.plan is not None and self.stop_reason is None:
                self._replan(f"worker {n.rank} dead")
            if n.role in ("ps", "spare"):
                failover.on_shard_dead(self, n)

    def _grouping(self, speeds: dict[int, float]) -> dict:
        """Plan fields for the workers' groups and data shares under this algorithm."""
        return self.formation.plan_fields(speeds, self.cfg.algorithm.params)

    def _publish(self, plan: ClusterPlan) -> None:
        self.plan = plan
        self.plan_checked = self.clock()
        self.runlog.write_plan(plan.to_dict())
        state.save(self)
        self.runlog.record("plan", t=round(self.elapsed(), 4), plan_id=plan.plan_id, groups=plan.groups,
                           speeds=plan.speeds, wall=round(time.time(), 3))  # wall: start-up report
        log.info("plan %d: %d workers in groups %s, %d shards, %d tensors; speeds %s", plan.plan_id,
                 len(plan.workers), plan.groups, len(plan.shards), len(plan.tensors), plan.speeds)
        for peer, req, after in self.plan_waiters:
            if plan.plan_id > after:
                self.reply(peer, req, Plan(plan_id=plan.plan_id, plan=plan))
        self.plan_waiters = [w for w in self.plan_waiters if w[2] >= plan.plan_id]

    def _maybe_regroup(self) -> None:
        """Groups formed by speed: a new plan when measured worker speeds
        drifted beyond the hysteresis and k-means now forms different groups
        (not before every worker of the plan has measured one)."""
        params = self.cfg.algorithm.params
        if (not self.formation.may_regroup(params) or self.stop_reason
                or self.clock() - self.plan_checked < params.regroup_every_s):
            return
        self.plan_checked = self.clock()
        workers = [n for n in self.members("worker") if n.node_id in self.plan.worker_ids()]
        if not all(n.stats.speed for n in workers):
            # a profiled speed (compute alone) and a measured one (compute and push) are not comparable:
            # groups are re-formed once every worker of the plan reported a measured speed
            return
        speeds = {n.node_id: n.speed for n in workers}
        old = {w: self.plan.speeds.get(str(w), 1.0) for w in speeds}
        if not drifted(old, speeds, params.hysteresis):
            return
        fields = self._grouping(speeds)
        proposal = self.formation.proposal(fields, params)
        current = {"groups": self.plan.groups, "shares": self.plan.shares, "batches": self.plan.batches}
        if proposal == self.formation.proposal(current, params):
            self.regroup_votes = []
            return
        # speeds are noisy: act only on a grouping that several checks in a row agree on
        self.regroup_votes = [v for v in self.regroup_votes if v == proposal] + [proposal]
        if len(self.regroup_votes) < params.confirm_checks:
            return
        self.regroup_votes = []
        self._publish(dataclasses.replace(
            self.plan, plan_id=self.plan.plan_id + 1,
            speeds={**self.plan.speeds, **{str(w): round(s, 3) for w, s in speeds.items()}}, **fields))
