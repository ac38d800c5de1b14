"""A simulated worker of the gradient-pushing loop (sync, async, ssp,
grouping, eager, balanced): the real worker's data share, batches and
forward/backward (worker/step.py's `GradientStep`, as the real Trainer
runs it, on one model shared by all simulated workers), and real PUSH/PULL
messages; the simulator (engine.py) carries them on its clock.

What a worker keeps between steps: its clock, plan, data stream (the
indices of its share and a position), the shard versions it holds, a step
timer and its unsent step records. Parameters live only for the instant a
step's gradient is computed (the values a reply brought are loaded into the
shared model at once), and the gradient lives while it is in flight (its
compute time plus the network), so memory grows with the workers in flight,
not with the number of workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetps.proto.messages import Ack, Params, Pull, Push, PushRows
from hetps.proto.plan import ClusterPlan
from hetps.runconfig.schema import NodeConfig, RunConfig
from hetps.training.data import Datasets
from hetps.training.parts import ack_of, join_parts, part_sizes, shard_names, split_for_shards
from hetps.training.state import ModelState
from hetps.training.step import GradientStep
from hetps.training.straggler import straggler_of
from hetps.training.timing import StepTimer

from .events import Link, speed_factor
from .group_rounds import CollectiveCounts


def base_step_s(cfg: RunConfig, node: NodeConfig, batch: int | None = None) -> float:
    """A worker's step at slowdown 1 on `batch` samples (default `data.batch_size`):
    its `step_s` (given for `data.batch_size`, scaled to `batch`), else `sim.sample_s` x the batch."""
    batch = batch or cfg.data.batch_size
    return node.step_s * batch / cfg.data.batch_size if node.step_s else cfg.sim.sample_s * batch


@dataclass(frozen=True)
class SimMember:
    """Who a simulated worker is: its node id (from the coordinator) and rank."""

    node_id: int
    rank: int


class SimClient:
    """The worker's view of the shards: the plan, the versions it holds, bytes
    moved (the engine counts what it sends)."""

    def __init__(self, plan: ClusterPlan):
        self.plan = plan
        self.names = shard_names(plan)
        self.part_sizes = part_sizes(plan)
        self.versions = [0] * len(plan.shards)
        self.bytes_sent = 0
        self.bytes_received = 0

    def adopt(self, plan: ClusterPlan) -> None:
        """Use a newer plan; its placement must be the one the worker started with."""
        if plan.placement_id != self.plan.placement_id:
            raise ValueError(
                f"plan {plan.plan_id} moves tensors; live re-placement is not supported"
            )
        self.plan = plan

    def split(self, tensors: dict) -> list[dict]:
        """Per shard, the tensors it owns; chunked tensors as views of their parts (as the real client)."""
        return split_for_shards(self.plan, tensors, self.part_sizes, self.names)

    def join(self, values: dict) -> dict:
        """Values gathered from the shards with chunked tensors whole again."""
        return join_parts(self.plan, values)


class SimWorker:
    def __init__(
        self,
        cfg: RunConfig,
        node: NodeConfig,
        member: SimMember,
        plan: ClusterPlan,
        state: ModelState,
        data: Datasets,
    ):
        """`state`: the model its gradients are computed on (the engine's, shared)."""
        self.cfg, self.node, self.member, self.state = cfg, node, member, state
        self.client = SimClient(plan)
        # place, group, data share and batch under the plan; forward/backward (worker/step.py)
        self.work = GradientStep(cfg, state, data, member.node_id, plan)
        self.link = Link.of(node)
        self.timer = StepTimer()
        self.clock = 0
        self.staleness = 0
        self.alive = True
        self.known_plan_id = plan.plan_id
        self.records: list[dict] = []
        self.replies: dict[int, Params] = {}
        self.outgoing: dict | None = None  # the gradient in flight
        # sparse tables (rows.py SimRows, set by the engine): the step's row pushes
        self.rows = None
        self.row_pushes: list[dict] = []
        self.step_started = self.pushed_at = 0.0
        self.loss = 0.0
        self.compute_s = 0.0
        # comm.aggregate (group_rounds.py): its last step was reduced with its group, which then
        # agreed on the plan every member switches to before the next (None: stay)
        self.in_group = False
        self.agreed_plan: ClusterPlan | None = None
        # its collective counts once it first reduced (group_rounds.CollectiveCounts), for
        # summary.json's `aggregation`; None: never reduced
        self.collective: CollectiveCounts | None = None

    def use_plan(self, plan: ClusterPlan) -> None:
        """Switch to a newer `plan` between steps (GradientStep.use_plan)."""
        self.client.adopt(plan)
        factor = self.work.use_plan(plan)
        if factor != 1.0:
            self.timer.rescale(factor)

    # ------------------------------------------------------------ the cost model
    def step_compute_s(self, t: float) -> float:
        """Virtual seconds of one step's forward/backward at time `t`."""
        # balanced: the plan's batch; data.accumulate micro-batches per step
        base = base_step_s(self.cfg, self.node, self.work.step_samples)
        extra = 0.0
        n = len(self.cfg.cluster.workers)
        if (
            self.cfg.cluster.straggler > 0
            and n > 1
            and straggler_of(self.cfg.seed, self.clock, n) == self.work.index
        ):
            # the eager-SGD imbalance model (worker/straggler.py)
            extra = self.cfg.cluster.straggler
        return base * speed_factor(self.node, t) * (1.0 + extra)

    # ------------------------------------------------------------ one step
    def first_pulls(self) -> list[tuple[int, Pull]]:
        return [
            (i, Pull(plan_id=self.client.plan.plan_id, clock=0))
            for i in range(len(self.client.plan.shards))
        ]

    def take_reply(self, i: int, reply: Params | Ack, nbytes: int) -> bool:
        """Keep shard `i`'s reply; True once every shard's values have come
        (the ACK of a PUSH_ROWS only counts its bytes)."""
        self.client.bytes_received += nbytes
        if isinstance(reply, Ack):
            return False
        self.client.versions[i] = reply.version
        self.replies[i] = reply
        return len(self.replies) == len(self.client.plan.shards)

    def finish_step(self, now: float) -> None:
        """The step's replies are in: load them, account the step."""
        replies, self.replies = self.replies, {}
        values = {}
        for reply in replies.values():
            values.update(reply.tensors)
        self.state.load(self.client.join(values))
        acks = [ack_of(r) for r in replies.values() if r.ack]
        if self.outgoing is None:  # the first pull: no step to account
            return
        self.outgoing = None
        acked = max((now - held for _, held in acks), default=now)
        push_s, step_s = max(0.0, acked - self.pushed_at), now - self.step_started
        self.clock += 1
        self.staleness = max((a.staleness for a, _ in acks), default=self.staleness)
        self.known_plan_id = max([self.known_plan_id] + [a.plan_id for a, _ in acks])
        self.timer.update(self.compute_s, push_s, step_s)
        self.records.append(
            {
                "t": now,
                "worker": self.member.rank,
                "step": self.clock,
                "loss": round(self.loss, 5),
                "staleness": self.staleness,
                "group": self.work.group,
                "compute_s": round(self.compute_s, 5),
                "step_s": round(step_s, 5),
                **self.work.norm_record(),
            }
        )

    def follow_plan(self, newest: ClusterPlan) -> bool:
        """Between steps, switch to `newest` if this worker knows of a newer
        plan; False (and not alive) when it is not a worker of it. After an aggregated step,
        only to the plan its group agreed on (group_rounds.py), so the members stay together."""
        current = self.client.plan.plan_id
        if self.in_group:
            agreed, self.agreed_plan, self.in_group = self.agreed_plan, None, False
            if agreed is None or agreed.plan_id <= current:
                return True
            newest = agreed
        elif not (self.known_plan_id > current and newest.plan_id > current):
            return True
        if self.member.node_id not in newest.worker_ids():
            self.alive = False
            return False
        self.use_plan(newest)
        return True

    def start_step(self, now: float, newest: ClusterPlan) -> float | None:
        """Compute the next gradient on the loaded values (real forward/backward);
        returns its virtual compute seconds, or None when this worker is not in
        the newest plan it knows of (it stops)."""
        if not self.follow_plan(newest):
            return None
        self.step_started = now
        if self.rows is not None:
            self.rows.client = self.client  # its pulls of rows count on this worker
        self.loss = self.work.compute()
        self.outgoing = {n: t.clone() for n, t in self.state.outgoing().items()}
        if self.rows is not None:
            self.row_pushes = self.rows.take_pushes()
        self.compute_s = self.step_compute_s(now)
        return self.compute_s

    def pushes(self, now: float) -> list[tuple[int, Push | PushRows]]:
        """The step's fused PUSH+PULL to every shard, after its PUSH_ROWS (sparse tables)."""
        self.pushed_at = now
        plan = self.client.plan
        rows, self.row_pushes = self.row_pushes, []
        return [
            (
                i,
                PushRows(
                    plan_id=plan.plan_id,
                    clock=self.clock,
                    n_samples=self.work.step_samples,
                    tensors=part,
                ),
            )
            for i, part in enumerate(rows)
        ] + [
            (
                i,
                Push(
                    plan_id=plan.plan_id,
                    clock=self.clock,
                    base_version=self.client.versions[i],
                    n_samples=self.work.step_samples,
                    pull=True,
                    tensors=part,
                ),
            )
            for i, part in enumerate(self.client.split(self.outgoing))
        ]

    # ------------------------------------------------------------ reporting
    def take_records(self, now: float) -> list[dict]:
        out, self.records = self.records, []
        return [
            {**{k: v for k, v in r.items() if k != "t"}, "ago": round(now - r["t"], 6)} for r in out
        ]

    def stats(self) -> dict:
        bs = self.work.step_samples
        return {
            "steps": self.clock,
            "samples": self.work.samples,
            "bytes_sent": self.client.bytes_sent,
            "bytes_received": self.client.bytes_received,
            "step_time_s": self.timer.step_s,
            "compute_s": self.timer.compute_s,
            "plan_id": self.client.plan.plan_id,
            "group": self.work.group,
            "staleness": self.staleness,
            "speed": self.timer.speed(bs),
            "push_s": self.timer.push_s,
            "samples_per_s": bs / self.timer.step_s if self.timer.step_s else 0.0,
            **(self.collective.stats() if self.collective else {}),
        }
