"""`hetps simulate`: one process, one event loop on a virtual clock, running
the real coordinator (registration, plans, k-means groups, data shares,
placement, heartbeats, failure detection, re-grouping, stop rules, the run
directory), the real shards (store, consistency policy, torch.optim
updater) and the workers' real forward/backward on real data. Only time is
simulated: compute, links and shard service take the virtual seconds of the
cost model (events.py, docs/simulation.md).

    hetps simulate configs/default.yaml 'cluster.workers={count: 64, speeds: {lognormal: {sigma: 0.5}}}'

Blocking; deterministic for a config and seed on one machine (one torch thread).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

from hetps.proto.codec import decode
from hetps.proto.messages import Bye, Error, Heartbeat, Init, Pull, Push, Register, Report, Status
from hetps.proto.plan import schema_hash
from hetps.proto.records import NodeStats, read_step_records
from hetps.ps.shard import Shard
from hetps.runconfig.algorithms import aggregation_off_because, algorithm, min_aggregated_group
from hetps.runconfig.load import dump_config
from hetps.runconfig.schema import ConfigError, NodeConfig, RunConfig
from hetps.scheduler.coordinator import Coordinator
from hetps.scheduler.runlog import SummaryFile
from hetps.training.data import Datasets, load_datasets
from hetps.training.measure import measure, report_values
from hetps.training.models import build_model
from hetps.training.parts import join_parts, part_sizes, shard_names, split_for_shards
from hetps.training.preflight import model_outputs
from hetps.training.sparse import SparseConfigError
from hetps.training.sparse import install as install_tables
from hetps.training.state import ModelState, model_specs
from hetps.training.step import task_for
from hetps.training.task import watched_metric

from .events import EventQueue, Link, ServiceQueue, nbytes_of, speed_factor, transfer
from .group_rounds import GroupRounds
from .local_workers import SimDilocoWorker, SimLocalWorker
from .model_file import SimModelFiles
from .rows import SimRows
from .wire import SimServer, call, dispatch, node_of, request, request_ids
from .workers import SimMember, SimWorker, base_step_s

log = logging.getLogger(__name__)
# the algorithm table's worker loop -> its simulated worker
SIM_WORKERS = {
    "gradients": SimWorker,
    "local_steps": SimLocalWorker,
    "pseudo_gradients": SimDilocoWorker,
}


class SimulationError(ConfigError):
    """The config asks for something the simulator does not model."""


def sparse_tables(model, cfg: RunConfig) -> None:
    """The tables `sparse.tables` selects, served row by row as in a real run; a setting
    sparse tables cannot work with is a SimulationError naming it."""
    try:
        install_tables(model, cfg)
    except SparseConfigError as exc:
        raise SimulationError([str(exc)]) from None


def check_simulable(cfg: RunConfig) -> None:
    """Refuse, naming the key, what the simulator does not model."""
    problems = []
    algo = algorithm(cfg.algorithm.name)
    if algo.worker_loop not in SIM_WORKERS:
        problems.append(
            f"algorithm.name: {cfg.algorithm.name} (worker loop {algo.worker_loop}) is not simulated; "
            f"simulated worker loops: {', '.join(SIM_WORKERS)}"
        )
    if cfg.comm.overlap or cfg.comm.compression != "none" or not cfg.comm.fuse_pull:
        problems.append(
            "comm: simulate runs comm.overlap=false, comm.compression=none, comm.fuse_pull=true"
        )
    if cfg.cluster.faults.drop or cfg.cluster.faults.delay:
        problems.append(
            "cluster.faults: dropped or delayed messages are not simulated; set drop and delay to 0"
        )
    for i, kill in enumerate(cfg.cluster.kill):
        if not kill.node.startswith("worker") or kill.restart_after_s is not None:
            problems.append(
                f"cluster.kill.{i}: simulate kills workers only, without restart; got {kill.node}"
            )
    if problems:
        raise SimulationError(problems)


class Simulation:
    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path | None,
        data: Datasets | None = None,
        progress: Callable[[], None] | None = None,
    ):
        """`data`: the loaded datasets of `cfg.data` (e.g. shared by the runs of a comparison).
        `progress`: called after every event, in the loop (keep it cheap: `hetps simulate`'s
        progress line looks at the wall clock and returns)."""
        check_simulable(cfg)
        self.cfg, self.run_dir, self.progress = cfg, run_dir, progress
        self.q = EventQueue()
        self.ids = request_ids()
        torch.manual_seed(cfg.seed)
        self.data = data or load_datasets(cfg.data, cfg.seed)
        # the workers' and the evaluator's task (worker/task.py): real losses and metrics
        self.task = task_for(cfg, self.data.num_classes)
        self.watched = watched_metric(cfg, self.task)
        outputs = model_outputs(self.task, self.data)
        model = build_model(cfg.model, self.data.in_shape, outputs)
        sparse_tables(model, cfg)  # rows from the simulated shards (rows.py)
        self.state = ModelState(model, torch.device("cpu"))
        self.eval_model = build_model(cfg.model, self.data.in_shape, outputs)
        sparse_tables(self.eval_model, cfg)
        # model.safetensors, model.json and best.safetensors, as a real run's evaluator writes them
        self.model_files = SimModelFiles(
            cfg, self.task, self.watched, self.eval_model, self.data.in_shape, outputs
        )
        self.coord = Coordinator(
            SimServer("sim://scheduler"), cfg, run_dir, run_id=f"sim{cfg.seed}", clock=self.q.clock
        )
        # its restart file, written per registration and BYE, costs O(N^2) here
        self.coord.keeps_state = False
        self.shard_nodes: list[NodeConfig] = list(cfg.cluster.shards)
        self.shards: dict[int, Shard] = {}  # node id -> shard (ids from the coordinator)
        self.shard_links: dict[int, Link] = {}
        self.queues: dict[int, ServiceQueue] = {}
        # node id -> requests arrived and not yet taken in (src, frames, bytes), in order
        self.waiting: dict[int, deque] = {}
        self.serving: set[int] = set()  # shards taking in a request or applying its step
        self.workers: dict[int, SimWorker] = {}  # node id -> worker
        self.evaluator_id = 0
        # (rank, virtual s)
        self.kills = [(int(k.node[len("worker") :]), k.at_s) for k in cfg.cluster.kill]
        self.stalled = False
        self.left: set[int] = set()  # workers that left on a shard's refusal (`_leave`)
        # comm.aggregate: synchronous groups reduce before the shards (group_rounds.py)
        self.group_rounds = (
            None
            if aggregation_off_because(cfg)
            else GroupRounds(
                algorithm(cfg.algorithm.name).aggregates == "by_samples",
                frozenset(n for n, (_, kind) in self.state.tensors.items() if kind != "param"),
                min_aggregated_group(cfg),
            )
        )

    # ------------------------------------------------------------ start-up: register, plan, INIT
    def start(self) -> None:
        specs = model_specs(self.state.model)
        schema = schema_hash(specs)
        shard_ids = [
            self._register(
                "ps",
                rank,
                address=f"sim://ps{rank}",
                speed=self.cfg.sim.shard_bytes_per_s / node.slowdown,
            )
            for rank, node in enumerate(self.shard_nodes)
        ]
        # a worker registers with the speed its cost gives (the real one profiles its compute)
        worker_ids = [
            self._register(
                "worker",
                rank,
                tensor_specs=specs,
                schema_hash=schema,
                speed=self.cfg.data.batch_size / (base_step_s(self.cfg, node) * node.slowdown),
            )
            for rank, node in enumerate(self.cfg.cluster.workers)
        ]
        if self.cfg.eval.enabled:
            self.evaluator_id = self._register("evaluator", 0)
        plan = self.coord.plan
        if plan is None:
            raise RuntimeError("the coordinator made no plan from the simulated registrations")
        for rank, node_id in enumerate(shard_ids):
            shard = Shard(SimServer(f"sim://ps{rank}"), node_id, plan, self.cfg, clock=self.q.clock)
            self.shards[node_id] = shard
            self.shard_links[node_id] = Link.of(self.shard_nodes[rank])
            self.queues[node_id] = ServiceQueue(
                self.cfg.sim.shard_bytes_per_s,
                self.cfg.sim.shard_message_s,
                self.cfg.sim.shard_apply_bytes_per_s,
                self.cfg.sim.shard_apply_s,
            )
            self.waiting[node_id] = deque()
        # chunked tensors as their parts (cluster.chunk_bytes), as a real worker's INIT
        parts = split_for_shards(plan, self.state.values(), part_sizes(plan), shard_names(plan))
        for entry, part in zip(plan.shards, parts):
            frames, _ = request(Init(plan_id=plan.plan_id, tensors=part), worker_ids[0], self.ids)
            self._expect_ok(dispatch(self.shards[entry.node_id], worker_ids[0], frames))
        for node_id, shard in self.shards.items():
            # what an optimizer step updates: the shard's parameters (its buffers are copied)
            self.queues[node_id].apply_bytes = sum(
                shard.store.tensors[n].nbytes for n in shard.store.param_names()
            )
        make = SIM_WORKERS[algorithm(self.cfg.algorithm.name).worker_loop]
        extra = {} if make is SimWorker else {"clock": self.q.clock}
        for rank, node_id in enumerate(worker_ids):
            self.workers[node_id] = make(
                self.cfg,
                self.cfg.cluster.workers[rank],
                SimMember(node_id, rank),
                plan,
                self.state,
                self.data,
                **extra,
            )
        if plan.tables:
            in_order = [self.shards[e.node_id] for e in plan.shards]
            rows = SimRows(in_order)
            rows.bind(self.state.model)
            SimRows(in_order).bind(self.eval_model)  # the evaluator's reads count on no worker
            for w in self.workers.values():
                w.rows = rows
        self.plan_sent = plan.plan_id
        for w in self.workers.values():
            for i, pull in w.first_pulls():
                self._send(w, i, pull)
        self.q.at(self.cfg.cluster.heartbeat_s, self._heartbeat)
        if self.cfg.eval.enabled:
            self.q.at(self.cfg.eval.every_s, self._evaluate)
        for rank, at_s in self.kills:
            self.q.at(at_s, self._kill, rank)

    def _register(self, role: str, rank: int, **fields) -> int:
        return call(
            self.coord, 0, self.ids, Register(role=role, rank=rank, host="sim", **fields)
        ).node_id

    def _expect_ok(self, replies) -> None:
        for _, frames, _ in replies:
            msg = decode(frames).msg
            if isinstance(msg, Error):
                raise RuntimeError(f"a simulated shard refused a request: {msg.message}")

    # ------------------------------------------------------------ messages on the virtual network
    def _shard_id(self, i: int, w: SimWorker) -> int:
        return w.client.plan.shards[i].node_id

    def _send(self, w: SimWorker, i: int, msg) -> None:
        sid = self._shard_id(i, w)
        frames, nbytes = request(msg, w.member.node_id, self.ids)
        w.client.bytes_sent += nbytes
        arrived = transfer(w.link, self.shard_links[sid], nbytes, self.q.now)
        self.q.at(arrived, self._arrive, sid, w.member.node_id, frames, nbytes)

    # A shard takes its requests one at a time, in arrival order: receiving one costs its
    # message and bytes; if handling it ran optimizer steps (the shard's version moved: a sync
    # round closed, an async push applied, whatever the policy), the shard is held for them
    # before the replies leave and the next request is taken in.
    def _slowdown(self, sid: int) -> float:
        return speed_factor(self.shard_nodes[self.shards[sid].node_rank()], self.q.now)

    def _arrive(self, sid: int, src: int, frames: list, nbytes: int) -> None:
        self.waiting[sid].append((src, frames, nbytes))
        if sid not in self.serving:
            self._take_next(sid)

    def _take_next(self, sid: int) -> None:
        if not self.waiting[sid]:
            self.serving.discard(sid)
            return
        self.serving.add(sid)
        src, frames, nbytes = self.waiting[sid].popleft()
        received = self.queues[sid].finish(self.q.now, nbytes, self._slowdown(sid))
        self.q.at(received, self._handle, sid, src, frames)

    def _handle(self, sid: int, src: int, frames: list) -> None:
        shard = self.shards[sid]
        before = shard.store.version
        replies = dispatch(shard, src, frames)
        steps = max(0, shard.store.version - before)
        if steps:
            applied = self.queues[sid].apply(self.q.now, steps, self._slowdown(sid))
            self.q.at(applied, self._answer, sid, replies)
        else:
            self._answer(sid, replies)

    def _answer(self, sid: int, replies: list) -> None:
        self._deliver_all(sid, replies)
        self._take_next(sid)

    def _deliver_all(self, sid: int, replies) -> None:
        index = {e.node_id: i for i, e in enumerate(self.shards[sid].plan.shards)}[sid]
        for dst, frames, nbytes in replies:
            w = self.workers.get(dst)
            if w is None or not w.alive:
                continue  # a killed worker's replies are lost
            arrived = transfer(self.shard_links[sid], w.link, nbytes, self.q.now)
            self.q.at(arrived, self._reply, dst, index, frames, nbytes)

    def _reply(self, dst: int, i: int, frames: list, nbytes: int) -> None:
        w = self.workers[dst]
        if not w.alive:
            return
        msg = decode(frames).msg
        if isinstance(msg, Error):
            self._leave(w, i, msg)
            return
        if self.group_rounds is not None:
            seconds, members = self.group_rounds.reply_to(dst, i, msg, nbytes)
            if members:  # an aggregated round's reply: every member gets it, broadcast
                self.q.after(seconds, self._share, members, i, msg, nbytes)
                return
        self._take(w, i, msg, nbytes)

    def _take(self, w: SimWorker, i: int, msg, nbytes: int) -> None:
        if w.alive and w.take_reply(i, msg, nbytes):
            w.finish_step(self.q.now)
            self._hear_step_limit()
            self._step(w)

    def _share(self, members: list, i: int, msg, nbytes: int) -> None:
        for w in members:
            self._take(w, i, msg, nbytes)

    def _step(self, w: SimWorker) -> None:
        if self.coord.stop_reason is not None or not w.alive:
            return
        compute_s = w.start_step(self.q.now, self.coord.plan)
        if compute_s is not None:
            self.q.after(compute_s, self._push, w)

    def _push(self, w: SimWorker) -> None:
        if not w.alive or self.coord.stop_reason is not None:
            return
        messages = w.pushes(self.q.now)
        members = self.group_rounds.group(w, self.workers) if self.group_rounds else None
        if w.collective is not None:
            w.collective.aggregate = members is not None
        for i, msg in messages:
            if members is None or not isinstance(msg, Push):  # rows go per worker
                self._send(w, i, msg)
        if members is not None:
            group = self.group_rounds.arrive(w, members)
            if group is not None:
                seconds, pushes = self.group_rounds.reduce(group, self.q.now, self.coord.plan)
                self.q.after(seconds, self._send_group, pushes)
        elif not messages:  # a local step that ends no round: the next one follows at once
            self._hear_step_limit()
            self._step(w)

    def _send_group(self, pushes: list) -> None:
        """An aggregated round's pushes, each by its member; a pusher that died meanwhile
        leaves the others to pull that shard's values (a real group's share fails then)."""
        for w, i, push in pushes:
            if w.alive:
                self._send(w, i, push)
            else:
                for _, members in self.group_rounds.orphaned(w.member.node_id):
                    self._pull_instead(i, members)

    def _pull_instead(self, i: int, members: list) -> None:
        for m in members:
            if m.alive:
                self._send(m, i, Pull(plan_id=m.client.plan.plan_id, clock=m.clock))

    def _hear_step_limit(self) -> None:
        """`stop.max_steps` reached: every node beats now, so the coordinator stops on the
        step that reached it, not up to a heartbeat period of steps later (a real cluster
        hears steps with the heartbeats: there it stops that much later)."""
        limit = self.cfg.stop.max_steps
        if limit and sum(w.stats()["steps"] for w in self.workers.values()) >= limit:
            self._beat()

    # ------------------------------------------------------------ heartbeats, plans, evaluation, faults
    def _heartbeat(self) -> None:
        if self.coord.stop_reason is not None:
            return  # one left in the queue while the final averages are carried
        self._beat()
        if self.coord.stop_reason is None:
            self.q.after(self.cfg.cluster.heartbeat_s, self._heartbeat)

    def _beat(self) -> None:
        """Every live node's heartbeat, then the coordinator's tick."""
        now = self.q.now
        for w in self.workers.values():
            if not w.alive:
                continue
            beat = Heartbeat(
                node_id=w.member.node_id,
                stats=NodeStats.read(w.stats()),
                records=read_step_records(w.take_records(now)),
            )
            ack = call(self.coord, w.member.node_id, self.ids, beat)
            if ack.stop:
                w.alive = False
            w.known_plan_id = max(w.known_plan_id, ack.plan_id)
        for sid, shard in self.shards.items():
            call(self.coord, sid, self.ids, Heartbeat(node_id=sid, stats=self._shard_stats(sid)))
        self.coord.tick()
        # shards learn a new plan from their heartbeat's ACK
        if self.coord.plan.plan_id > self.plan_sent:
            self.plan_sent = self.coord.plan.plan_id
            for sid, shard in self.shards.items():
                shard.adopt(self.coord.plan)  # closes open rounds: parked pulls may be answered now
                self._deliver_all(sid, self._drain(shard))

    def _drain(self, shard: Shard) -> list:
        sent, shard.server.inbox.sent = shard.server.inbox.sent, []
        return [(node_of(peer), frames, nbytes_of(frames)) for peer, frames in sent]

    def _shard_stats(self, sid: int) -> NodeStats:
        # busy_s: the cost model's service seconds (the real handler's CPU time is not virtual time)
        return NodeStats.read(
            {**self.shards[sid].stats(), "busy_s": round(self.queues[sid].busy_s, 6)}
        )

    def _evaluate(self, final: bool = False) -> None:
        if not final and self.coord.stop_reason is not None:
            return
        values, versions = {}, {}
        for sid, shard in self.shards.items():
            frames, _ = request(
                Pull(plan_id=shard.plan.plan_id, clock=-1), self.evaluator_id, self.ids
            )
            for _, reply, _ in dispatch(shard, self.evaluator_id, frames):
                params = decode(reply).msg
                values.update(params.tensors)
                versions[sid] = params.version
        values = join_parts(self.coord.plan, values)  # chunked tensors whole again
        ModelState(self.eval_model, torch.device("cpu")).load(values)
        metrics = measure(self.task, self.eval_model, self.data.test, self.cfg, torch.device("cpu"))
        # each shard's version in the plan's order, as the real evaluator's pull holds them
        self.model_files.measured(
            metrics, [versions[e.node_id] for e in self.coord.plan.shards], final
        )
        call(
            self.coord,
            self.evaluator_id,
            self.ids,
            Report(
                node_id=self.evaluator_id,
                kind="eval",
                values=report_values(self.task, self.watched, metrics, final=final),
            ),
        )
        if not final and self.coord.stop_reason is None:
            self.q.after(self.cfg.eval.every_s + self.cfg.sim.eval_s, self._evaluate)

    def _final_averages(self) -> None:
        """With `final_average` (wpsgd, simuparallel), each worker between
        rounds pushes its model once more; the messages in flight are carried
        to the end (no new step starts), so the final evaluation sees the last
        round's mean when every worker got to push (best effort, as in a real run)."""
        sent = False
        for w in self.workers.values():
            for i, push in w.final_pushes() if w.alive and isinstance(w, SimLocalWorker) else []:
                self._send(w, i, push)
                sent = True
        messages = (self._arrive, self._handle, self._reply)
        # the clock stops at the last message
        while sent and self.q.holds(messages) and self.q.run_next():
            pass

    def _kill(self, rank: int) -> None:
        for w in self.workers.values():
            if w.member.rank == rank:
                # silent from now on: the coordinator declares it dead after dead_after_s
                w.alive = False
                if self.group_rounds is not None:
                    # its group's collective fails: the members waiting push on their own, and
                    # those waiting for a reply it was to share pull it
                    for m in self.group_rounds.release(w.member.node_id):
                        for i, msg in m.pushes(self.q.now):
                            self._send(m, i, msg)
                    for i, members in self.group_rounds.orphaned(w.member.node_id):
                        self._pull_instead(i, members)

    def _leave(self, w: SimWorker, i: int, refusal: Error) -> None:
        """A worker whose request shard `i` refused leaves on that error, as a real worker's
        daemon does (worker/lifecycle.py leave_on_error): silent from now on, its group's
        collective released, and a BYE naming the error and its status, so the coordinator
        re-plans without it or, when it was the last worker, ends the run (diverged for
        NaN/Inf pushes, `cluster.nonfinite: reject`)."""
        self._kill(w.member.rank)
        self.left.add(w.member.node_id)
        status = Status(refusal.status)
        error = f"ps{i} refused a request: {status.name}: {refusal.message}"
        bye = Bye(
            node_id=w.member.node_id,
            stats=NodeStats.read(w.stats()),
            error=error,
            refused=int(status),
        )
        call(self.coord, w.member.node_id, self.ids, bye)

    # ------------------------------------------------------------ the loop and the end
    def run(self) -> None:
        """Run to the coordinator's stop (target, limits, divergence), then the
        final evaluation and every node's BYE."""
        self.start()
        while self.coord.stop_reason is None:
            if not self.q.run_next():
                self.stalled = True
                self.coord.begin_stop("simulation stalled: no event left (every worker waits)")
            if self.progress is not None:
                self.progress()
        self._final_averages()
        if self.cfg.eval.enabled:
            self._evaluate(final=True)
        for w in self.workers.values():
            if w.member.node_id in self.left:
                continue  # it said BYE when it left
            beat = Heartbeat(
                node_id=w.member.node_id,
                stats=NodeStats.read(w.stats()),
                records=read_step_records(w.take_records(self.q.now)),
            )
            call(self.coord, w.member.node_id, self.ids, beat)
            call(
                self.coord,
                w.member.node_id,
                self.ids,
                Bye(node_id=w.member.node_id, stats=NodeStats.read(w.stats())),
            )
        if self.evaluator_id:
            call(self.coord, self.evaluator_id, self.ids, Bye(node_id=self.evaluator_id))
        for sid in self.shards:
            call(self.coord, sid, self.ids, Bye(node_id=sid, stats=self._shard_stats(sid)))
        self.coord.close()


def simulate(
    cfg: RunConfig,
    run_dir: Path,
    data: Datasets | None = None,
    progress: Callable[[], None] | None = None,
) -> dict:
    """Run `cfg` in virtual time and write the run directory, the trained model
    included (model.safetensors, model.json; best.safetensors with eval.keep_best);
    returns the summary (blocking). `data`: `cfg.data` already loaded. `progress`:
    called after every event (Simulation). Raises SimulationError (a ConfigError)
    for what the simulator does not model."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "summary.json", *SimModelFiles.NAMES):
        (run_dir / stale).unlink(missing_ok=True)
    dump_config(cfg, run_dir / "config.yaml")
    torch.set_num_threads(1)
    started = time.perf_counter()
    sim = Simulation(cfg, run_dir, data, progress)
    sim.run()
    sim.model_files.write(run_dir)
    return SummaryFile(run_dir).update(
        mode="simulated",
        simulation={
            "sample_s": cfg.sim.sample_s,  # a worker's compute per sample (sim/workers.py)
            "virtual_s": round(sim.q.now, 6),
            "events": sim.q.processed,
            "stalled": sim.stalled,
            "real_wall_s": round(time.perf_counter() - started, 3),
        },
    )
