"""The scheduler's control plane, one state machine over the cluster's node
table: REGISTER and node ids (the rules in registration.py), the versioned
PLAN (made by planning.py and failover.py, published here to the nodes that
wait for it, the run log and the state file), heartbeats (held as long polls,
held_beats.py), failure detection, re-grouping, barriers, evaluation reports,
the state a restarted scheduler carries on from (state.py), and a clean stop
of the whole cluster. No tensor passes through it.

Stop happens in phases so the final evaluation sees the workers' last
pushes and can still read the shards: first workers are told to stop; the
evaluator once every worker said BYE; shards once every worker and the
evaluator did (each, at the latest, after `STOP_GRACE_S`). The stop is
saved the moment it is decided, so a scheduler restarted during it carries
it on (`restore`) rather than waiting for nodes that already left.
One loop, one thread; `tick()` is called between requests.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from hetps.proto.codec import Envelope, ProtocolError
from hetps.proto.messages import Ack, Error, Op, Plan, Status, Welcome
from hetps.proto.plan import ClusterPlan, TensorSpec
from hetps.proto.rpc import Service
from hetps.proto.transport import ServerTransport
from hetps.runconfig.agreement import agreed_values
from hetps.runconfig.algorithms import algorithm
from hetps.runconfig.schema import RunConfig, StopConfig
from hetps.runconfig.targets import reached, stop_target
from hetps.runtime.failures import Failure

from . import failover, planning, registration, segments, state, status
from .answered import AnsweredRequests
from .formation import FORMATIONS
from .held_beats import HeldBeat, HeldBeats
from .nodes import EVAL_ROW_FIELDS, EvalTrack, Node, read_eval
from .outcome import DIVERGED, DivergenceGuard, checkpoint_failures, startup_failure
from .runlog import RunLog
from .stalls import StallTracker

log = logging.getLogger(__name__)
# the requests that change the scheduler's state: a re-sent one is answered with its first reply
ANSWERED_ONCE = (Op.REGISTER, Op.REPORT, Op.BYE, Op.FAILED, Op.STOP)
STOP_GRACE_S = 20.0  # longest wait for workers/evaluator to leave before shards are stopped
EXIT_GRACE_S = 40.0  # longest wait for everyone to leave after a stop began


class Coordinator(Service):
    """The scheduler's state machine: the `on_*` handlers answer requests
    (Service dispatches them), `tick()` runs the timers, `finished()` and
    `close()` end the run. It owns the node table, the plan and the nodes
    waiting for it, the evaluation track and the failures; plans are made by
    planning.py and failover.py, the state file's format is state.py's, the
    summary and metrics are status.py's."""

    def __init__(
        self,
        server: ServerTransport,
        cfg: RunConfig,
        run_dir: Path | None = None,
        run_id: str | None = None,
        clock: Callable[[], float] | None = None,
    ):
        """`clock`: seconds, monotonic; every timer reads it (None: `time.monotonic`, looked up at
        each call; a virtual clock under `hetps simulate`)."""
        super().__init__(server, node_id=0)
        self.clock = clock or (lambda: time.monotonic())
        # write scheduler-state.json (`save_state`); a simulation has no scheduler to restart
        self.keeps_state = True
        self.cfg = cfg
        self.formation = FORMATIONS[algorithm(cfg.algorithm.name).groups]
        self.run_id = run_id or secrets.token_hex(6)  # names checkpoints; a resumed run keeps it
        self.state_saved = 0.0
        # a registration changed the state: saved at the next tick, not per node
        self.state_dirty = False
        self.resumed_plan: ClusterPlan | None = None  # the stopped run's last plan, when resuming
        # a resumed run's earlier segments: this one's time and counts go on from theirs (`resume`)
        self.earlier = segments.Earlier()
        self.runlog = RunLog(run_dir)
        self.nodes: dict[int, Node] = {}
        self.expected = {"ps": len(cfg.cluster.shards), "worker": len(cfg.cluster.workers)}
        self.specs: list[TensorSpec] | None = None
        self.schema = ""
        # the settings every node must agree on (runconfig/agreement.py), and the nodes refused
        # for a mismatch or a rank outside the configured ones: {name: {node, host, reason, t}}
        self.agreed = agreed_values(cfg)
        self.refused: dict[str, dict] = {}
        self.plan: ClusterPlan | None = None
        self.plan_waiters: list[tuple[bytes, int, int]] = []
        self.plan_checked = 0.0  # when the plan was last published or checked for re-grouping
        self.regrouping = planning.Regrouping(self.formation, cfg.algorithm.params)
        self.barriers: dict[str, list[tuple[bytes, int]]] = {}
        self.held_beats = HeldBeats()  # heartbeats held as long polls (held_beats.py)
        self.created = self.clock()
        self.started: float | None = None  # when the first plan went out
        self.stop_reason: str | None = None
        self.stop_since = 0.0
        target = stop_target(cfg.stop)  # (metric, value) or None
        self.evals = EvalTrack(
            target[1] if target else None,
            cfg.stop.target_patience,
            target_metric=target[0] if target else "accuracy",
        )
        self.failures: list[Failure] = []
        self.timer_errors: dict[str, int] = {}  # timer name -> failures (see `_guarded`)
        self.failed: Failure | None = None  # the failure that ended the run
        self.guard = DivergenceGuard(
            cfg.stop.diverged_after,
            cfg.stop.diverge_warmup_s,
            cfg.optimizer.lr,
            nonfinite=cfg.cluster.nonfinite,
        )
        # a stop carried on after a restart (`restore`): the nodes not heard from since,
        # which may have heard the stop from the old scheduler and left (`_unheard_left`)
        self.unheard: set[int] = set()
        self.saving = False  # in `save_state`: a signal's stop saves at the next tick instead
        self.finished_steps = 0
        # who the cluster waits for
        self.stalls = StallTracker(cfg.cluster.heartbeat_s, cfg.cluster.dead_after_s, self.clock)
        # a re-sent request that changes state is answered with its first reply (answered.py)
        self.answered = AnsweredRequests()
        self.handlers.update({op: self._answered_once(self.handlers[op]) for op in ANSWERED_ONCE})

    def _answered_once(self, handler):
        def answer_once(peer: bytes, env: Envelope):
            kept = self.answered.answer(env.src, env.req_id)
            if kept is not None:
                return kept
            reply = handler(peer, env)
            if reply is not None:
                self.answered.remember(env.src, env.req_id, reply)
            return reply

        return answer_once

    # ------------------------------------------------------------ helpers
    def elapsed(self) -> float:
        return self.clock() - (self.started or self.created)

    def node(self, node_id: int) -> Node:
        node = self.nodes.get(node_id)
        if node is None:
            raise ProtocolError(Status.BAD_STATE, f"unknown node id {node_id}; register first")
        node.last_seen = self.clock()
        self.unheard.discard(node_id)
        return node

    def members(self, *roles: str) -> list[Node]:
        return [n for n in self.nodes.values() if n.role in roles]

    def _plan_id(self) -> int:
        return self.plan.plan_id if self.plan is not None else 0

    def global_steps(self) -> int:
        return sum(status.count(n.stats, "steps") for n in self.members("worker"))

    def begin_stop(self, reason: str) -> None:
        """Decide the stop (the first reason stays). Saved at once, before any
        node can hear of it and leave: a scheduler restarted from then on
        finishes this stop (`restore`) instead of waiting for nodes that left."""
        if self.stop_reason is None:
            self.stop_reason = reason
            self.stop_since = self.clock()
            log.info("stopping the cluster: %s", reason)
            try:
                self.save_state()
            except OSError as exc:  # a full or vanished disk must not keep the run from stopping
                log.warning("the stop could not be saved in %s: %s", state.STATE_FILE, exc)
                self.state_dirty = True
            self.runlog.record(
                "stop", t=self.elapsed(), reason=reason, global_steps=self.global_steps()
            )

    # ------------------------------------------------------------ registration
    def on_register(self, peer: bytes, env: Envelope):
        """REGISTER: admit a node into the node table and reply with its id (a
        returning node keeps its own), or refuse one that cannot join this cluster.
        Raises ProtocolError (the refusal's status and reason, also shown while the
        cluster forms)."""
        msg = env.msg
        if msg.role not in status.ROLES:
            raise ProtocolError(Status.MALFORMED, f"role {msg.role!r} not in {status.ROLES}")
        try:
            registration.check_agreement(self.agreed, msg)
            registration.check_rank(msg, self.expected.get(msg.role, 0), self.plan is None)
            if msg.role == "worker":
                self._check_schema(msg.tensor_specs, msg.schema_hash)
        except ProtocolError as exc:
            self._refuse(msg, exc.message)
            raise
        if msg.rank < 0:  # `--rank auto`: the node takes the rank given here (nodes.free_rank)
            rank = registration.claim_rank(self.nodes, msg.role, self.expected.get(msg.role, 0))
            msg = dataclasses.replace(msg, rank=rank)
        known = registration.returning(self.nodes, self.plan, msg)
        if known is not None:
            return self._readmit(known, msg)
        self.refused.pop(f"{msg.role}{msg.rank}", None)  # it came back agreeing
        node_id = len(self.nodes) + 1
        self.nodes[node_id] = Node(
            node_id,
            msg.role,
            msg.rank,
            msg.address,
            self.clock(),
            profiled_speed=msg.speed,
            host=msg.host,
            replica_address=msg.replica_address,
            spare_slots=msg.spare_slots,
        )
        log.info("registered %s %d as node %d %s", msg.role, msg.rank, node_id, msg.address)
        self.runlog.record(
            "register",
            t=round(self.elapsed(), 4),
            node=f"{msg.role}{msg.rank}",
            host=msg.host,
            **({"startup": msg.startup} if msg.startup else {}),
        )
        self._maybe_plan()
        if msg.role == "spare" and self._replicating():  # ranges without a backup get one now
            plan = failover.after_spare_joined(self.plan, self.nodes)
            if plan is not None:
                self._publish(plan)
        if msg.role == "worker" and self.plan is not None and node_id not in self.plan.worker_ids():
            self._replan(f"worker {msg.rank} joined as node {node_id}")
        if self.plan is None:  # the start-up burst: written once per tick (`_save_when_due`)
            self.state_dirty = True
        else:
            self.save_state()
        return Welcome(node_id=node_id, role=msg.role, rank=msg.rank)

    def _readmit(self, node: Node, msg) -> Welcome:
        registration.check_return(self.plan, node, msg)
        if node.role == "ps":
            self.failures.append(
                Failure(
                    "shard_restarted",
                    node=f"ps{node.rank}",
                    t=round(self.elapsed(), 3),
                    was_dead=node.dead,
                )
            )
        node.dead = node.left = False
        node.last_seen = self.clock()
        log.info("%s %d came back as node %d", msg.role, msg.rank, node.node_id)
        self.save_state()
        return Welcome(node_id=node.node_id, role=msg.role, rank=msg.rank)

    def _refuse(self, msg, reason: str) -> None:
        """Keep a refused node's name, host and reason until it registers (the start-up
        failure names it: `_waiting`), record it in the run log and say it in the log."""
        name = f"{msg.role}{msg.rank}" if msg.rank >= 0 else f"{msg.role} (--rank auto)"
        t = round(self.elapsed(), 4)
        self.refused[name] = {"node": name, "host": msg.host, "reason": reason, "t": t}
        self.runlog.record("refused", t=t, node=name, host=msg.host, reason=reason)
        log.warning(
            "refused %s from host %s: %s%s",
            name,
            msg.host or "?",
            reason,
            f" ({self._waiting()})" if self.plan is None else "",
        )

    def _waiting(self) -> str:
        """`still waiting for {role: count}`, and the nodes refused since, with why."""
        missing = {r: self.expected[r] - len(self.members(r)) for r in self.expected}
        refused = "; ".join(
            f"{r['node']} from host {r['host'] or '?'}: {r['reason']}"
            for r in self.refused.values()
        )
        return f"still waiting for {missing}" + (f"; refused {refused}" if refused else "")

    def _check_schema(self, specs: list[TensorSpec], schema_hash: str) -> None:
        """The first worker's model is the cluster's; later workers must match it."""
        if self.specs is None:
            self.specs = list(specs)  # checked at decode (records.read_tensor_specs)
            self.schema = schema_hash
        elif schema_hash != self.schema:
            raise ProtocolError(
                Status.BAD_STATE,
                f"model schema {schema_hash} differs from the cluster's {self.schema}",
            )

    # ------------------------------------------------------------ handlers
    def on_get_plan(self, peer: bytes, env: Envelope):
        if self.plan is not None and self.plan.plan_id > env.msg.after:
            return Plan(plan_id=self.plan.plan_id, plan=self.plan)
        # a node asks for plans one at a time (Membership._plan_lock): its older
        # parked request is one it gave up on (a push named a plan that never came)
        self.plan_waiters = [w for w in self.plan_waiters if w[0] != peer]
        self.plan_waiters.append((peer, env.req_id, env.msg.after))
        return None

    def on_heartbeat(self, peer: bytes, env: Envelope):
        node = self.node(env.msg.node_id)
        older = self.held_beats.release(node.node_id)  # a newer beat answers the one still held
        if older is not None:
            self.reply(older.peer, older.req_id, self._beat_ack(node))
        if node.dead and node.role == "ps" and not failover.replaced(self.plan, node.node_id):
            # a slow shard is still the only owner of its tensors (unless its backup took them over)
            node.dead = False
            log.warning("shard %d (node %d) is back", node.rank, node.node_id)
        if node.dead:  # declared dead while it was only slow: it must not come back unannounced
            return self._beat_ack(node)
        node.stats = env.msg.stats
        self._record_checkpoint_failures(node)
        if node.role == "ps":
            self.stalls.on_heartbeat(node)
        now = self.elapsed()
        if env.msg.records and node.role != "worker":
            log.warning(
                "%s %d (node %d) sent step records: dropped (only a worker's steps are recorded)",
                node.role,
                node.rank,
                node.node_id,
            )
        # typed at decode (records.read_step_record). A step is written as the sender's (its rank,
        # whatever the record says) and never before the run's clock began (a record kept across a
        # scheduler restart that lost its state file); once: a heartbeat whose ACK came too late
        # for the worker is sent again with its records, which this scheduler already wrote
        for rec in env.msg.records if node.role == "worker" else ():
            if rec["step"] <= node.recorded_step:
                continue
            node.recorded_step = rec["step"]
            ago = rec.pop("ago")
            rec["worker"] = node.rank
            self.runlog.record("step", t=round(max(0.0, now - ago), 4), **rec)
            where = f"worker{node.rank} at step {rec.get('step')}"
            if node.role == "worker" and self._worker_loss(node, rec.get("loss"), where):
                self.begin_stop(DIVERGED)
        # a long poll: answered by `_answer_held_beats`
        if env.msg.hold_s > 0 and not self._tell_stop(node):
            until = self.clock() + min(env.msg.hold_s, self.cfg.cluster.heartbeat_s)
            self.held_beats.hold(node.node_id, HeldBeat(peer, env.req_id, until, self._plan_id()))
            return None
        return self._beat_ack(node)

    def _beat_ack(self, node: Node) -> Ack:
        """A heartbeat's ACK: the newest plan's id, and whether the node must stop."""
        if node.dead:
            return Ack(
                plan_id=self._plan_id(),
                stop=True,
                info={"reason": f"declared dead after {self.cfg.cluster.dead_after_s}s of silence"},
            )
        stop = node.left or self._tell_stop(node)
        info: dict = {}
        if stop:
            info["reason"] = self.stop_reason or "left"
            # the evaluator's final pull would wait out its timeout on these (evaluator.py)
            dead = self._dead_shards()
            if dead:
                info["dead_shards"] = dead
        return Ack(plan_id=self._plan_id(), stop=stop, info=info)

    def _dead_shards(self) -> list[int]:
        """The ranks of the shards declared dead whose tensors no other process serves."""
        return sorted(
            n.rank
            for n in self.members("ps")
            if n.dead and not failover.replaced(self.plan, n.node_id)
        )

    def _answer_held_beats(self) -> None:
        """Answer the held heartbeats that have news (a newer plan, stop) or whose hold ran out."""

        def has_news(node_id: int) -> bool:
            node = self.nodes.get(node_id)
            return node is None or node.left or node.dead or self._tell_stop(node)

        for node_id, beat in self.held_beats.due(self.clock(), self._plan_id(), has_news):
            node = self.nodes.get(node_id)
            self.reply(
                beat.peer, beat.req_id, self._beat_ack(node) if node is not None else Ack(stop=True)
            )

    def _record_checkpoint_failures(self, node: Node) -> None:
        """The damaged checkpoints a shard's stats name, each once in the failures."""
        for failure in checkpoint_failures(node, self.failures, round(self.elapsed(), 3)):
            log.warning(
                "%s passed over damaged checkpoint %s (%s); restored version %s",
                failure.node,
                failure.file,
                failure.error,
                failure.restored_version,
            )
            self.failures.append(failure)

    def on_report(self, peer: bytes, env: Envelope):
        self.node(env.msg.node_id)
        values = env.msg.values
        if env.msg.kind == "eval":
            self._record_eval(values)
        return Ack()

    def on_barrier(self, peer: bytes, env: Envelope):
        waiting = self.barriers.setdefault(env.msg.name, [])
        # a re-sent wait replaces its first (its peer id may be new after a reconnect)
        waiting[:] = [(p, r) for p, r in waiting if r != env.req_id]
        waiting.append((peer, env.req_id))
        if len(waiting) >= env.msg.count:
            for p, req in self.barriers.pop(env.msg.name):
                self.reply(p, req, Ack(info={"barrier": env.msg.name}))
        return None

    def on_failed(self, peer: bytes, env: Envelope):
        """A node could not start: end the run now, naming it (nobody waits for it)."""
        if env.msg.node_id:
            self.node(env.msg.node_id)  # a registered node names itself by id
        failure = startup_failure(env.msg, round(self.elapsed(), 3))
        log.error("%s failed at start-up: %s", failure.node, failure.error)
        self.failures.append(failure)
        self.failed = self.failed or failure
        self.begin_stop(failure.reason)
        return Ack(stop=True)

    def on_stop(self, peer: bytes, env: Envelope):
        self.begin_stop(env.msg.reason)
        return Ack(stop=True)

    def on_bye(self, peer: bytes, env: Envelope):
        node, error = self.node(env.msg.node_id), env.msg.error
        node.stats = env.msg.stats or node.stats
        self._record_checkpoint_failures(node)
        node.left = True
        failure = None
        # it leaves on an error, before the run stopped: re-planned now, not after dead_after_s
        if error:
            log.warning(
                "%s %d (node %d) left on an error: %s", node.role, node.rank, node.node_id, error
            )
            failure = node.failure(
                "error", round(self.elapsed(), 3), error=error, refused=env.msg.refused
            )
            self.failures.append(failure)
        else:
            log.info("%s %d (node %d) left", node.role, node.rank, node.node_id)
        self.save_state()
        if node.role == "worker" and self.stop_reason is None and self.plan is not None:
            if failure and not self.live_workers():  # the last worker failed: so did the run
                if env.msg.refused == Status.NONFINITE:
                    # diverged: its gradients were NaN/Inf
                    self.guard.nonfinite_pushes(f"worker{node.rank}")
                    self.begin_stop(DIVERGED)
                    return Ack(stop=True)
                self.failed = self.failed or failure
            self._replan(f"worker {node.rank} left" + (" on an error" if error else ""))
        return Ack(stop=True)

    # ------------------------------------------------------------ plans
    def _maybe_plan(self) -> None:
        """The first plan (planning.first_plan), once the model's schema is
        known and every expected shard and worker registered."""
        if self.plan is not None or self.specs is None:
            return
        shards, workers = self.members("ps"), self.members("worker")
        if len(shards) < self.expected["ps"] or len(workers) < self.expected["worker"]:
            return
        plan = planning.first_plan(
            self.cfg,
            self.formation,
            shards,
            workers,
            self.specs,
            self.schema,
            self.run_id,
            self.resumed_plan,
        )
        self.started = self.clock()  # the run's clock starts when the plan goes out
        # waiting for the plan is not silence: heartbeats start once it arrives
        for n in self.members("ps", "worker", "spare"):
            n.last_seen = self.started
        self._publish(plan)

    def live_workers(self) -> list[Node]:
        """The workers that neither left nor were declared dead, by rank."""
        return sorted(
            (n for n in self.members("worker") if not n.gone), key=lambda n: (n.rank, n.node_id)
        )

    def _replan(self, reason: str) -> None:
        """A new plan for the live workers (planning.replanned), or the run
        stops when none is left. Shards close the rounds still open when they
        adopt it, so nobody waits for a worker that is gone."""
        workers = self.live_workers()
        if not workers:
            self.begin_stop(f"no live workers left ({reason})")
            return
        log.info("re-planning: %s", reason)
        self._publish(
            planning.replanned(
                self.plan, self.formation, self.cfg.algorithm.params, workers, reason
            )
        )

    def _detect_dead(self) -> None:
        """Workers silent for longer than dead_after_s leave the plan. A
        silent shard is recorded: its tensors cannot move, so workers retry
        until it comes back (restarted from its checkpoint) or their request
        timeout ends the run, unless its backup takes over (`_fail_over`)."""
        now = self.clock()
        self._unheard_left(now)
        for n in self.members("worker", "ps", "spare"):
            silent = now - n.last_seen
            if n.gone or silent <= self.cfg.cluster.dead_after_s:
                continue
            n.dead = True
            self.failures.append(
                n.failure("dead", round(self.elapsed(), 3), silent_s=round(silent, 3))
            )
            log.warning(
                "%s %d (node %d) silent for %.1fs: declared dead", n.role, n.rank, n.node_id, silent
            )
            if n.role == "worker" and self.plan is not None and self.stop_reason is None:
                self._replan(f"worker {n.rank} dead")
            if n.role in ("ps", "spare"):
                self._fail_over(n)

    def _unheard_left(self, now: float) -> None:
        """A stop carried on after a restart: a node of any role not heard from
        for dead_after_s since the restart heard the stop from the old
        scheduler and left, its goodbye lost with it. It counts as left (not a
        failure), so the nodes told after it (evaluator, then shards) are told."""
        for node_id in sorted(self.unheard):
            n = self.nodes.get(node_id)
            if n is not None and not n.gone:
                if now - n.last_seen <= self.cfg.cluster.dead_after_s:
                    continue
                n.left = True
                log.info(
                    "%s %d (node %d) not heard from since the restart: left at the stop",
                    n.role,
                    n.rank,
                    n.node_id,
                )
            self.unheard.discard(node_id)

    def _replicating(self) -> bool:
        """Whether backups may change the plan now: replicated shards, training, not stopping."""
        return (
            bool(self.cfg.cluster.replicas) and self.plan is not None and self.stop_reason is None
        )

    def _fail_over(self, node: Node) -> None:
        """Shard process `node` was declared dead: publish the failover plan
        (failover.after_shard_dead) and record it; no-op without replicas."""
        if not self._replicating():
            return
        plan = failover.after_shard_dead(self.plan, node, self.nodes)
        if plan is not None:
            self.failures.append(
                Failure(
                    "shard_failover",
                    node=f"{node.role}{node.rank}",
                    node_id=node.node_id,
                    t=round(self.elapsed(), 3),
                    plan_id=plan.plan_id,
                    served_by=dict(plan.served_by),
                    backups=dict(plan.backups),
                )
            )
            self._publish(plan)

    def _publish(self, plan: ClusterPlan) -> None:
        """Make `plan` the current one: written to the run log and the state
        file, sent to the nodes waiting for a newer plan than theirs."""
        plan = planning.with_group_since(plan, self.plan)
        self.plan = plan
        self.plan_checked = self.clock()
        self.runlog.write_plan(plan.to_dict())
        self.save_state()
        self.runlog.record(
            "plan",
            t=round(self.elapsed(), 4),
            plan_id=plan.plan_id,
            groups=plan.groups,
            speeds=plan.speeds,
            wall=round(time.time(), 3),
        )  # wall: start-up report
        log.info(
            "plan %d: %d workers in groups %s, %d shards, %d tensors; speeds %s",
            plan.plan_id,
            len(plan.workers),
            plan.groups,
            len(plan.shards),
            len(plan.tensors),
            plan.speeds,
        )
        for peer, req, after in self.plan_waiters:
            if plan.plan_id > after:
                self.reply(peer, req, Plan(plan_id=plan.plan_id, plan=plan))
        self.plan_waiters = [w for w in self.plan_waiters if w[2] >= plan.plan_id]

    def _maybe_regroup(self) -> None:
        """Every `regroup_every_s` while training, a formation that may
        re-form its groups checks the plan's workers' measured speeds
        (planning.Regrouping) and publishes the plan it decides on."""
        params = self.cfg.algorithm.params
        if (
            not self.regrouping.enabled
            or self.stop_reason
            or self.clock() - self.plan_checked < params.regroup_every_s
        ):
            return
        self.plan_checked = self.clock()
        workers = [n for n in self.members("worker") if n.node_id in self.plan.worker_ids()]
        plan = self.regrouping.check(self.plan, workers)
        if plan is not None:
            self._publish(plan)

    # ------------------------------------------------------------ state file
    def save_state(self, finished: bool = False) -> None:
        """Write scheduler-state.json (state.py; no-op without a run directory
        or with `keeps_state` off); `finished`: the run ended, a later
        scheduler must not carry it on."""
        if self.runlog.run_dir is None or not self.keeps_state:
            return
        if self.saving:  # SIGTERM's stop (begin_stop) came in the middle of a save
            self.state_dirty = True
            return
        self.saving = True
        try:
            self.state_saved = self.clock()
            self.state_dirty = False
            state.write(
                self.runlog.run_dir,
                run_id=self.run_id,
                finished=finished,
                elapsed=self.elapsed() if self.started else None,
                plan=self.plan,
                specs=self.specs,
                schema=self.schema,
                nodes=self.nodes.values(),
                evals=self.evals,
                failures=self.failures,
                stop=(
                    {"reason": self.stop_reason, "failed": self.failed}
                    if self.stop_reason is not None
                    else None
                ),
                guard=self.guard.saved(),
                earlier=self.earlier.to_dict(),
            )
        finally:
            self.saving = False

    def restore(self, data: dict) -> None:
        """Carry on the unfinished run saved in `data` (state.read), on a
        fresh coordinator: its run id, plan, model, nodes (alive from now on),
        run clock, measured evaluations, failures and divergence guard, and the
        stop, when one was decided: that stop goes on from now (the nodes told
        in the usual order; those never heard from again count as left after
        dead_after_s, `_unheard_left`), whatever this scheduler would decide."""
        saved = state.load(data, now=self.clock())
        self.run_id, self.specs, self.schema = saved.run_id, saved.specs, saved.schema
        self.plan, self.nodes = saved.plan, saved.nodes
        if saved.started is not None:
            self.started = saved.started
        self.evals = dataclasses.replace(self.evals, **saved.measured)
        self.failures = saved.failures
        self.guard.restore(saved.guard)
        self.earlier = self.runlog.earlier = saved.earlier
        if saved.stop is not None:
            self.stop_reason, self.failed = saved.stop["reason"], saved.stop.get("failed")
            self.stop_since = self.clock()  # the nodes hear of it from now: their grace starts
            self.unheard = {n.node_id for n in self.nodes.values() if not n.gone}
            log.info("carrying on the stop decided before the restart: %s", self.stop_reason)

    def resume(self, data: dict) -> None:
        """Start a new segment of the stopped run saved in `data` (state.read; `hetps run
        --resume`): its placement (`resumed_plan`), and its time, counts and evaluation track
        to go on from (segments.py); the segment's start is the first record it writes."""
        if data.get("plan"):
            self.resumed_plan = ClusterPlan.from_dict(data["plan"])
        self.earlier = self.runlog.earlier = segments.after(data)
        known = {f.name for f in dataclasses.fields(self.evals)}
        carried = {k: v for k, v in self.earlier.evals.items() if k in known}
        before = data.get("evals") or {}
        if (before.get("target_metric"), before.get("target")) != (
            self.evals.target_metric,
            self.evals.target,
        ):
            # a time to target is one of this target's: an earlier segment's other target (or
            # none) says nothing about when this one was reached
            carried.pop("time_to_target_s", None)
            carried.pop("samples_to_target", None)
        self.evals = dataclasses.replace(self.evals, **carried)
        # the test-loss yardstick is the first segment's barely trained model, not the resumed
        # one's (a trained model's small loss would make ordinary noise look like divergence)
        guard = data.get("guard") or {}
        self.guard.early_loss = guard.get("early_loss", self.guard.early_loss)
        self.runlog.record(
            "segment",
            t=0.0,
            segment=self.earlier.segment,
            global_steps=0,
            global_samples=0,
            bytes=0,
            workers=self.earlier.worker_steps(),
        )

    def _save_when_due(self) -> None:
        """Save once per tick at most: a burst of registrations (1,024 nodes)
        writes the state file a few times, not once per node."""
        if self.state_dirty or self.clock() - self.state_saved > state.SAVE_EVERY_S:
            self.save_state()

    # ------------------------------------------------------------ evaluation and stopping
    def _record_eval(self, values: dict) -> None:
        """An evaluation report (either form, nodes.read_eval): counted on the watched
        metric, written as a metrics.jsonl row, judged by the divergence guard, and held
        against the stop target in its metric's direction."""
        reading = read_eval(values)
        ev = self.evals
        ev.take(reading)
        t = self.elapsed()
        samples = sum(status.count(n.stats, "samples") for n in self.members("worker"))
        row = dict(
            t=round(t, 4),
            global_steps=self.global_steps(),
            global_samples=samples,
            final=reading.final,
            **({} if reading.versions is None else {"versions": list(reading.versions)}),
            # as last heard
            bytes=sum(
                status.count(n.stats, k)
                for n in self.members("worker")
                for k in ("bytes_sent", "bytes_received")
            ),
        )
        # every metric flattened into the row (a classification row: accuracy, loss as ever);
        # a metric named like a field of the row is left out rather than overwrite it
        metrics = {k: v for k, v in reading.metrics.items() if k not in EVAL_ROW_FIELDS}
        if reading.loss is not None:
            metrics.setdefault("loss", reading.loss)
        self.runlog.record(
            "eval",
            **metrics,
            watch=reading.watch,
            higher_is_better=reading.higher_is_better.get(reading.watch, True),
            **row,
        )
        accuracy = reading.metrics.get("accuracy")
        if self.guard.test_loss(reading.loss, t) or (
            accuracy is not None and self.guard.evaluation(accuracy, reading.num_classes, t)
        ):
            self.begin_stop(DIVERGED)
        if ev.target is None or not self._target_known(reading):
            return
        value = reading.metrics[ev.target_metric]
        higher = reading.higher_is_better.get(ev.target_metric, True)
        ev.streak = ev.streak + 1 if reached(value, ev.target, higher) else 0
        # a restarted scheduler must not resume a streak this evaluation broke
        self.state_dirty = True
        if ev.streak and ev.time_to_target_s is None:
            # on the run's clock and counts: a resumed run's earlier segments included
            ev.time_to_target_s = round(self.earlier.t + t, 3)
            ev.samples_to_target = samples + self.earlier.total("samples")
        if ev.streak >= ev.patience:
            held = f", held for {ev.streak} evaluations" if ev.patience > 1 else ""
            self.begin_stop(f"target {ev.target_metric} {ev.target} reached ({value:.4f}{held})")

    def _target_known(self, reading) -> bool:
        """Whether the evaluator reports the stop target's metric. Not: stop.target_accuracy
        (the classification shorthand, its 0.95 default included) is dropped with a warning;
        a metric stop.target names ends the run as failed, naming the task's metrics (a
        built-in task's names were checked with the config; a factory task's come only now)."""
        ev = self.evals
        primary = next(iter(reading.metrics), None)
        if (
            self.cfg.stop.target is None
            and ev.target == StopConfig().target_accuracy
            and primary not in (None, "accuracy")
        ):
            # a scheduler started from the user's YAML never imports the task: the 0.95 default
            # is classification's, as the config's own check settles it (targets.py)
            log.warning(
                "stop.target_accuracy's default %s dropped: the task's primary metric is %s, "
                "not accuracy (set stop.target for a target)",
                ev.target,
                primary,
            )
            ev.target = None
            return False
        if ev.target_metric in reading.metrics:
            return True
        names = ", ".join(reading.metrics) or "none"
        if self.cfg.stop.target is None:
            log.warning(
                "stop.target_accuracy %s ignored: the task reports no accuracy (its metrics: %s)",
                ev.target,
                names,
            )
            ev.target = None
            return False
        error = (
            f"stop.target.metric: {ev.target_metric!r} is not a metric of this run's task "
            f"(its metrics: {names}); the run cannot reach its target"
        )
        log.error("%s", error)
        failure = Failure("config", t=round(self.elapsed(), 3), error=error)
        self.failures.append(failure)
        self.failed = self.failed or failure
        self.begin_stop(error)
        ev.target = None
        return False

    def _worker_loss(self, node: Node, loss, where: str) -> str | None:
        """A worker's training loss through the divergence guard (its rule per
        cluster.nonfinite: DivergenceGuard.worker_loss); the verdict once diverged."""
        # once the run stops, workers leave one by one: the last one's NaN loss would be "every
        # live worker's" (seen when the healthy worker's BYE came first), so none is judged then
        return self.guard.worker_loss(
            loss,
            f"worker{node.rank}",
            where,
            lambda: [] if self.stop_reason else [f"worker{n.rank}" for n in self.live_workers()],
        )

    def _tell_stop(self, node: Node) -> bool:
        if self.stop_reason is None:
            return False
        if node.role == "worker":
            return True
        # the evaluator goes after the workers, so its last evaluation sees their last pushes
        before = ("worker",) if node.role == "evaluator" else ("worker", "evaluator")
        others_gone = all(n.gone for n in self.members(*before))
        return others_gone or self.clock() - self.stop_since > STOP_GRACE_S

    def tick(self) -> None:
        """Run the timers (startup timeout, failure detection, re-grouping,
        state saving, stop limits); call between requests. Never raises: each
        timer runs guarded like a handler (`_guarded`)."""
        timers = (
            (self._check_startup, self._save_when_due, self._answer_held_beats)
            if self.started is None
            else (
                self._detect_dead,
                self._maybe_regroup,
                self._save_when_due,
                self._check_limits,
                self._track_stalls,
                self._answer_held_beats,
            )
        )
        for timer in timers:
            self._guarded(timer)

    def _guarded(self, timer) -> None:
        """Run one timer; a failure is logged (with its traceback the first
        time and every 100th), counted in `timer_errors` and recorded once per
        timer in the run's failures, and the loop goes on."""
        try:
            timer()
        except Exception as exc:
            name = timer.__name__.lstrip("_")
            count = self.timer_errors[name] = self.timer_errors.get(name, 0) + 1
            if count == 1 or count % 100 == 0:
                log.exception("timer %s failed (%d times so far)", name, count)
            if count == 1:
                self.failures.append(
                    Failure(
                        "timer_error", timer=name, error=repr(exc)[:200], t=round(self.elapsed(), 3)
                    )
                )

    def _check_startup(self) -> None:
        if self.elapsed() > self.cfg.cluster.startup_timeout_s:
            missing = {r: self.expected[r] - len(self.members(r)) for r in self.expected}
            self.failures.append(
                Failure("startup", missing=missing, refused_nodes=list(self.refused.values()))
            )
            self.begin_stop(
                f"cluster did not form within {self.cfg.cluster.startup_timeout_s}s: "
                + self._waiting()
            )

    def _track_stalls(self) -> None:
        """Name who the cluster waits for (stalls.py): `stall` records while
        training, every open stall ended once the run stops."""
        replaced = (
            frozenset(int(k) for k in self.plan.served_by) if self.plan is not None else frozenset()
        )
        for rec in self.stalls.update(
            self.nodes, stopping=self.stop_reason is not None, replaced=replaced
        ):
            self.runlog.record("stall", t=round(self.elapsed(), 4), **rec)

    def _check_limits(self) -> None:
        stop = self.cfg.stop
        if self.elapsed() >= stop.max_seconds:
            self.begin_stop(f"time limit {stop.max_seconds}s")
        # max_steps counts the whole run (a resumed one stops where it would have without the
        # break); max_seconds this segment (segments.py)
        if stop.max_steps and self.earlier.total("steps") + self.global_steps() >= stop.max_steps:
            self.begin_stop(f"step limit {stop.max_steps}")

    def finished(self) -> bool:
        """True once a stop began and every node left (or EXIT_GRACE_S passed)."""
        if self.stop_reason is None:
            return False
        if self.plan is None:  # stopped before training began: nothing to wait for
            return True
        everyone_left = all(n.gone for n in self.nodes.values())
        return everyone_left or self.clock() - self.stop_since > EXIT_GRACE_S

    def summary(self) -> dict:
        return status.run_summary(self)

    def metrics(self) -> dict:
        """Numbers for the operator's /metrics endpoint (called from the metrics thread)."""
        return status.operator_metrics(self)

    def close(self) -> None:
        # a first plan that never comes
        for peer, req, _ in self.plan_waiters if self.plan is None else ():
            self.reply(
                peer,
                req,
                Error(status=int(Status.BAD_STATE), message=f"run stopped: {self.stop_reason}"),
            )
        # the summary before the state says finished: a scheduler killed in between leaves one,
        # and its restart (the state not finished) carries the stop on and writes it again
        self.runlog.write_summary(self.summary())
        self.save_state(finished=True)
        self.runlog.close()
