"""The training worker's loop for gradient-pushing algorithms (sync, async,
ssp): compute a gradient on its data share, push it, pull fresh values.
The step's work (data share, batches, forward/backward, clipping) is
step.py's `GradientStep`, which the simulator runs too; this loop adds the
I/O: PSClient, membership, the wall clock.

Blocking; returns when the scheduler asks the cluster to stop.
"""

from __future__ import annotations

import copy
import logging
import time

from hetps.proto.compression import make_compressor
from hetps.proto.messages import Ack
from hetps.proto.plan import ClusterPlan
from hetps.proto.tensors import Tensors
from hetps.runconfig.algorithms import aggregation_off_because, algorithm, min_aggregated_group
from hetps.runconfig.schema import NodeConfig, RunConfig
from hetps.runtime.emulation import Slowdown, work_clock
from hetps.runtime.membership import Membership
from hetps.training.data import Datasets, stream_share
from hetps.training.state import ModelState
from hetps.training.step import GradientStep, autocast, batch_loss
from hetps.training.straggler import straggle
from hetps.training.task import Classification, Task
from hetps.training.timing import StepTimer
from hetps.worker.collective_group import CollectiveError
from hetps.worker.row_exchange import RowExchange

from .client import PSClient
from .group_reduce import GroupReduce

log = logging.getLogger(__name__)


def profile_speed(
    state: ModelState,
    data: Datasets,
    batch_size: int,
    steps: int,
    slowdown: Slowdown,
    precision: str = "none",
    task: Task | None = None,
    num_workers: int = 0,
) -> float:
    """Samples per second of forward+backward on the real model and data
    (the task's loss; batches read as training reads them, by `num_workers`
    loader processes), stretched by the emulated slowdown (on a copy: the
    model is untouched). `task`: default classification."""
    task = task or Classification(data.num_classes)
    model = copy.deepcopy(state.model).train()
    stream = stream_share(
        data.train, 0, 1, None, batch_size, 0, 0, task.collate, num_workers,
        state.device.type == "cuda",
    )  # fmt: skip
    busy = 0.0
    device = str(state.device)
    for i in range(steps + 1):
        batch = stream.next_batch()
        started = work_clock(device)
        model.zero_grad(set_to_none=True)
        batch = task.to_device(batch, state.device, non_blocking=True)
        with autocast(precision, state.device):
            loss = batch_loss(task, model, batch)
        loss.backward()
        if i:  # the first step warms up allocators and kernels
            busy += work_clock(device) - started
    return steps * batch_size / max(busy * slowdown.factor(), 1e-9)


class Trainer:
    # keep each shard's parameters and gradients in one buffer in the wire's layout (flat_model.py);
    # loops that hand gradients out tensor by tensor (comm.overlap) or step a local optimizer do not
    FLAT = True

    def __init__(
        self,
        cfg: RunConfig,
        node: NodeConfig,
        member: Membership,
        plan: ClusterPlan,
        state: ModelState,
        data: Datasets,
    ):
        self.cfg = cfg
        self.member = member
        self.state = state
        self.data = data
        self.slowdown = Slowdown(node)
        self.device = str(state.device)
        algo = algorithm(cfg.algorithm.name)
        # `comm.compression` applies to gradients; models travel exact
        compressor = (
            make_compressor(cfg.comm.compression, cfg.comm.topk_ratio)
            if algo.pushes == "gradients"
            else None
        )
        self.client = PSClient(
            plan,
            member.node_id,
            cfg.cluster,
            self.should_abort,
            compressor,
            fuse_pull=cfg.comm.fuse_pull and algo.fuses_pull,
            plans=member.newer_plan if cfg.cluster.replicas else None,
            transport=member.transport,
        )
        # sparse tables: rows by id on connections of their own (sparse.py)
        self.rows = (
            RowExchange(
                plan,
                member.node_id,
                cfg.cluster,
                member.transport,
                self.should_abort,
                self.client.address_of if cfg.cluster.replicas else None,
                max_ids=cfg.sparse.max_ids,
            )
            if plan.tables
            else None
        )
        if self.rows is not None:
            self.rows.bind(state.model)
        self.timer = StepTimer()
        self.clock = 0
        self.staleness = 0  # the shards' staleness for our last push
        self.client.adopt(plan)
        # place, group, data share and batch under the plan; forward/backward (step.py)
        self.work = GradientStep(cfg, state, data, member.node_id, plan)
        # the placement never changes for a client (PSClient.adopt)
        if self.FLAT and compressor is None:
            state.lay_out_flat(self.client.names)
        # comm.aggregate: the group reduces before the shards (group_reduce.py); built lazily,
        # at the first step of each group, so that a rendezvous that fails is one step's failure
        self.reducer = (
            GroupReduce(
                member.node_id,
                plan.run_id or "run",
                cfg.comm.collective_timeout_s,
                cfg.data.batch_size,
                weighted=algo.aggregates == "by_samples",
                min_group=min_aggregated_group(cfg),
            )
            if type(self) is Trainer and not aggregation_off_because(cfg)
            else None
        )
        self.agreed_plan = plan.plan_id  # the newest plan the group agreed on (next_plan)
        self.buffer_names = frozenset(
            n for n, (_, kind) in state.tensors.items() if kind != "param"
        )
        # each dense shard's reply: (name, shape, dtype) in its order (the placement is fixed)
        parts = self.client.split(state.values()) if self.reducer is not None else []
        self.reply_layout = {
            i: [(n, t.shape, t.dtype) for n, t in parts[i].items()]
            for i in (self.client.dense if parts else ())
        }

    def use_plan(self, plan: ClusterPlan) -> None:
        """Switch to a newer `plan` between steps: the client's, and this worker's
        group, data share and batch (GradientStep.use_plan)."""
        self.client.adopt(plan)
        if self.rows is not None:
            self.rows.adopt(plan)
        factor = self.work.use_plan(plan)
        if factor != 1.0:
            self.timer.rescale(factor)

    def stats(self) -> dict:
        work = self.work
        rows = self.rows
        return {
            "steps": self.clock,
            "bytes_sent": self.client.bytes_sent + (rows.bytes_sent if rows else 0),
            "bytes_received": self.client.bytes_received + (rows.bytes_received if rows else 0),
            **(rows.stats() if rows else {}),
            "step_time_s": self.timer.step_s,
            "compute_s": self.timer.compute_s,
            "plan_id": self.client.plan.plan_id,
            "group": work.group,
            "staleness": self.staleness,
            "speed": self.timer.speed(work.step_samples),
            "push_s": self.timer.push_s,
            "samples": work.samples,
            **self.client.fault_stats(),
            **self.client.compression_stats(),
            "samples_per_s": work.step_samples / self.timer.step_s if self.timer.step_s else 0.0,
            **(self.reducer.stats() if self.reducer is not None else {}),
        }

    def compute(self) -> float:
        """Forward and backward on the next batch (GradientStep.compute); returns the loss."""
        return self.work.compute()

    def should_abort(self) -> bool:
        """Checked by every wait on a shard: true once the run is stopping."""
        return self.member.stop_requested.is_set()

    def start(self) -> None:
        """Offer initial values, load the shards' (the first offer wins), start the clocks."""
        self.client.init(self.state.values())
        self.state.load(self.client.pull(0))
        self.slowdown.start()

    def exchange(self) -> tuple[list[Ack], float]:
        """Push this step's gradients and buffers, then load the values for the
        next step (blocking). Returns the push ACKs and the seconds until they came.
        The step's row gradients go first: a shard that closes a round with them has them
        before any member's dense values for the next step leave. In a group that
        aggregates (comm.aggregate), the group's mean goes once to each shard
        (`exchange_in_group`)."""
        if self.rows is not None:
            self.rows.push(self.work.step_samples)
        if self.reducer is not None:
            self.reducer.use_plan(self.client.plan)  # blocking: the group's rendezvous, once
            if self.reducer.active():
                return self.exchange_in_group()
        acks, values = self.client.push_pull(
            self.state.outgoing(), self.clock, self.work.step_samples
        )
        self.state.load(values)
        return acks, self.client.last_push_s

    def exchange_in_group(self) -> tuple[list[Ack], float]:
        """One aggregated round (group_reduce.py): reduce with the group, push the slices this
        member pushes, share the replies. Raises CollectiveError; a member whose reduction
        failed pushed nothing."""
        started = time.monotonic()
        red, client = self.reducer, self.client
        got = red.reduce(
            self.state.outgoing(),
            self.clock,
            self.work.step_samples,
            self.member.latest_plan_id,
            self.buffer_names,
        )
        parts = client.split(got.tensors)
        mine = {
            i: client.send_step(i, parts[i], self.clock, got.n_samples, None, members=got.members)
            for pos, i in enumerate(client.dense)
            if red.pusher_of(pos) == red.rank
        }
        replies = {}
        for i, step in mine.items():
            ack, _, fused = client.await_ack(i, step, client.others(i))
            replies[i] = (ack, client.await_values(i, step, fused, client.others(i)))
        acked_s = time.monotonic() - started
        acks, values = [], []
        try:
            for pos, i in enumerate(client.dense):
                ack, version, tensors = red.share(pos, replies.get(i), self.reply_layout[i])
                client.versions[i] = version
                acks.append(ack)
                values.append(tensors)
        except CollectiveError:
            if mine:  # this member's slices were applied; another member's may not have been
                red.counts["partial_rounds"] += 1
            raise
        red.counts["group_rounds"] += 1
        red.counts["pushes_saved"] += len(client.dense) - len(mine)
        self.state.load(client.join(Tensors.merge(values)))
        self.agreed_plan = got.newest_plan  # every member switches after this same step
        return acks, acked_s

    def next_plan(self) -> ClusterPlan | None:
        """A newer plan to switch to before this step, or None. A member of a group that
        aggregates switches only at the step its group agreed on (the newest plan any member
        had heard of at the last reduction), so that none waits in a group the others left."""
        current = self.client.plan.plan_id
        live = self.reducer is not None and self.reducer.group is not None  # a broken one: not
        if live and self.agreed_plan <= current:
            return None
        return self.member.newer_plan(current)

    def recover(self, exc: CollectiveError) -> None:
        """A collective failed (a member died, froze or left): drop the group, wait for a newer
        plan (the scheduler re-plans once it declares the member dead) or, failing that within
        `cluster.dead_after_s` x 2, rebuild the same group; then re-sync from the shards. This
        step's gradient is dropped: a member whose reduction failed pushed nothing."""
        self.reducer.broken()
        deadline = time.monotonic() + 2 * self.cfg.cluster.dead_after_s
        log.info("collective failed (%s): waiting for a newer plan or a rebuilt group", exc)
        newer = None
        while not self.should_abort() and time.monotonic() < deadline:
            newer = self.member.newer_plan(self.client.plan.plan_id)
            if newer is not None:
                break
            self.member.stop_requested.wait(0.1)
        if self.should_abort():
            # a member that stopped first fails the others' last collective: no failure
            return
        self.reducer.counts["failures"] += 1
        log.warning("collective failed (%s); %s", exc, "a newer plan" if newer else "rebuilding")
        if newer is not None and self.member.node_id not in newer.worker_ids():
            return  # not a worker of it: the run loop finds it again (next_plan) and stops
        if newer is not None:
            self.use_plan(newer)
            log.info("switched to plan %d after a failed collective", newer.plan_id)
        self.state.load(self.client.pull(self.clock))

    def record(self, loss: float, compute_s: float, started: float) -> dict:
        """The step record sent to the scheduler."""
        return {
            "worker": self.member.rank,
            "step": self.clock,
            "loss": round(loss, 5),
            "staleness": self.staleness,
            "group": self.work.group,
            "compute_s": round(compute_s, 5),
            "step_s": round(time.perf_counter() - started, 5),
            **self.work.norm_record(),
        }

    def run(self) -> None:
        self.start()
        while not self.member.stop_requested.is_set():
            newer = self.next_plan()
            if newer is not None and self.member.node_id not in newer.worker_ids():
                log.warning("not a worker of plan %d any more: stopping", newer.plan_id)
                break
            if newer is not None:  # between steps: our previous push is fully applied
                self.use_plan(newer)
                log.info("switched to plan %d: group %d", newer.plan_id, self.work.group)
            started, work_started = time.perf_counter(), work_clock(self.device)
            loss = self.compute()
            compute_s = self.slowdown.stretch(work_clock(self.device) - work_started)
            compute_s += straggle(self.cfg, self.work.index, self.clock, compute_s)
            try:
                acks, push_s = self.exchange()
            except CollectiveError as exc:
                self.recover(exc)
                continue
            self.clock += 1
            if acks:
                self.staleness = max(a.staleness for a in acks)
                # a shard that adopted a newer plan says so in its ACK: switch before the next push
                # instead of at the next heartbeat (a push under the old plan is applied alone)
                self.member.note_plan(max(a.plan_id for a in acks))
            self.timer.update(compute_s, push_s, time.perf_counter() - started)
            self.member.add_record(self.record(loss, compute_s, started))

    def close(self) -> None:
        if self.reducer is not None:
            self.reducer.close()
        self.client.close()
        if self.rows is not None:
            self.rows.close()
