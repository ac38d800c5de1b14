"""The scheduler's control plane: registration and node ids (registration.py), the versioned
PLAN, heartbeats, barriers, evaluation reports, and a clean stop of the
whole cluster. No tensor passes through it.

Stop happens in phases so the final evaluation sees the workers' last
pushes and can still read the shards: first workers are told to stop; the
evaluator once every worker said BYE; shards once every worker and the
evaluator did (each, at the latest, after `STOP_GRACE_S`).
One loop, one thread; `tick()` is called between requests.
"""
from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from hetps.runconfig.algorithms import algorithm
from hetps.proto.codec import Envelope, ProtocolError
from hetps.runconfig.schema import RunConfig
from hetps.proto.messages import Ack, Error, Plan, Status
from hetps.proto.plan import ClusterPlan, TensorSpec
from hetps.proto.rpc import Service
from hetps.proto.transport import ServerTransport

from .formation import FORMATIONS
from .held_beats import HeldBeat, HeldBeats
from . import failover, state, status
from .outcome import DIVERGED, DivergenceGuard, startup_failure
from .nodes import EvalTrack, Node
from .planning import Planning
from .registration import Registration
from .runlog import RunLog
from .stalls import StallTracker

log = logging.getLogger(__name__)
STOP_GRACE_S = 20.0   # longest wait for workers/evaluator to leave before shards are stopped
EXIT_GRACE_S = 40.0   # longest wait for everyone to leave after a stop began


class Coordinator(Registration, Planning, Service):
    def __init__(self, server: ServerTransport, cfg: RunConfig, run_dir: Path | None = None,
                 run_id: str | None = None, clock: Callable[[], float] | None = None):
        """`clock`: seconds, monotonic; every timer reads it (None: `time.monotonic`, looked up at
        each call; a virtual clock under `hetps simulate`)."""
        super().__init__(server, node_id=0)
        self.clock = clock or (lambda: time.monotonic())
        self.keeps_state = True  # write scheduler-state.json (state.py); a simulation has no scheduler to restart
        self.cfg = cfg
        self.formation = FORMATIONS[algorithm(cfg.algorithm.name).groups]
        self.run_id = run_id or secrets.token_hex(6)  # names checkpoints; a resumed run keeps it
        self.state_saved = 0.0
        self.state_dirty = False  # a registration changed the state: saved at the next tick, not per node
        self.resumed_plan: ClusterPlan | None = None  # the stopped run's last plan, when resuming
        self.runlog = RunLog(run_dir)
        self.nodes: dict[int, Node] = {}
        self.expected = {"ps": len(cfg.cluster.shards), "worker": len(cfg.cluster.workers)}
        self.specs: list[TensorSpec] | None = None
        self.schema = ""
        self.plan: ClusterPlan | None = None
        self.plan_waiters: list[tuple[bytes, int, int]] = []
        self.plan_checked = 0.0
        self.regroup_votes: list = []  # consecutive checks proposing the same new grouping
        self.barriers: dict[str, list[tuple[bytes, int]]] = {}
        self.held_beats = HeldBeats()  # heartbeats held as long polls (held_beats.py)
        self.created = self.clock()
        self.started: float | None = None     # when the first plan went out
        self.stop_reason: str | None = None
        self.stop_since = 0.0
        self.evals = EvalTrack(cfg.stop.target_accuracy, cfg.stop.target_patience)
        self.failures: list[dict] = []
        self.timer_errors: dict[str, int] = {}  # timer name -> failures (see `_guarded`)
        self.failed: dict | None = None   # the node failure that ended the run: node, error, host
        self.guard = DivergenceGuard(cfg.stop.diverged_after, cfg.stop.diverge_warmup_s, cfg.optimizer.lr)
        self.finished_steps = 0
        # who the cluster waits for
        self.stalls = StallTracker(cfg.cluster.heartbeat_s, cfg.cluster.dead_after_s, self.clock)

    # ------------------------------------------------------------ helpers
    def elapsed(self) -> float:
        return self.clock() - (self.started or self.created)

    def node(self, node_id: int) -> Node:
        node = self.nodes.get(node_id)
        if node is None:
            raise ProtocolError(Status.BAD_STATE, f"unknown node id {node_id}; register first")
        node.last_seen = self.clock()
        return node

    def members(self, *roles: str) -> list[Node]:
        return [n for n in self.nodes.values() if n.role in roles]

    def _plan_id(self) -> int:
        return self.plan.plan_id if self.plan is not None else 0

    def global_steps(self) -> int:
        return sum(status.count(n.stats, "steps") for n in self.members("worker"))

    def begin_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            self.stop_since = self.clock()
            log.info("stopping the cluster: %s", reason)
            self.runlog.record("stop", t=self.elapsed(), reason=reason, global_steps=self.global_steps())

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
        if node.role == "ps":
            self.stalls.on_heartbeat(node)
        now = self.elapsed()
        for rec in env.msg.records:  # checked at decode: plain values, `ago` a finite number of seconds
            ago = rec.pop("ago")
            self.runlog.record("step", t=round(now - ago, 4), **rec)
            where = f"worker{node.rank} at step {rec.get('step')}"
            if node.role == "worker" and self.guard.loss(rec.get("loss"), where):
                self.begin_stop(DIVERGED)
        if env.msg.hold_s > 0 and not self._tell_stop(node):  # a long poll: answered by `_answer_held_beats`
            until = self.clock() + min(env.msg.hold_s, self.cfg.cluster.heartbeat_s)
            self.held_beats.hold(node.node_id, HeldBeat(peer, env.req_id, until, self._plan_id()))
            return None
        return self._beat_ack(node)

    def _beat_ack(self, node: Node) -> Ack:
        """A heartbeat's ACK: the newest plan's id, and whether the node must stop."""
        if node.dead:
            return Ack(plan_id=self._plan_id(), stop=True,
                       info={"reason": f"declared dead after {self.cfg.cluster.dead_after_s}s of silence"})
        stop = node.left or self._tell_stop(node)
        return Ack(plan_id=self._plan_id(), stop=stop, info={"reason": self.stop_reason or "left"} if stop else {})

    def _answer_held_beats(self) -> None:
        """Answer the held heartbeats that have news (a newer plan, stop) or whose hold ran out."""
        def has_news(node_id: int) -> bool:
            node = self.nodes.get(node_id)
            return node is None or node.left or node.dead or self._tell_stop(node)

        for node_id, beat in self.held_beats.due(self.clock(), self._plan_id(), has_news):
            node = self.nodes.get(node_id)
            self.reply(beat.peer, beat.req_id, self._beat_ack(node) if node is not None else Ack(stop=True))

    def on_report(self, peer: bytes, env: Envelope):
        self.node(env.msg.node_id)
        values = env.msg.values
        if env.msg.kind == "eval":
            self._record_eval(values)
        return Ack()

    def on_barrier(self, peer: bytes, env: Envelope):
        waiting = self.barriers.setdefault(env.msg.name, [])
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
        log.error("%s failed at start-up: %s", failure["node"], failure["error"])
        self.failures.append(failure)
        self.failed = self.failed or failure
        self.begin_stop(failure["reason"])
        return Ack(stop=True)

    def on_stop(self, peer: bytes, env: Envelope):
        self.begin_stop(env.msg.reason)
        return Ack(stop=True)

    def on_bye(self, peer: bytes, env: Envelope):
        node, error = self.node(env.msg.node_id), env.msg.error
        node.stats = env.msg.stats or node.stats
        node.left = True
        failure = None
        if error:  # it leaves on an error, before the run stopped: re-planned now, not after dead_after_s
            log.warning("%s %d (node %d) left on an error: %s", node.role, node.rank, node.node_id, error)
            failure = node.failure("error", round(self.elapsed(), 3), error=error, refused=env.msg.refused)
            self.failures.append(failure)
        else:
            log.info("%s %d (node %d) left", node.role, node.rank, node.node_id)
        state.save(self)
        if node.role == "worker" and self.stop_reason is None and self.plan is not None:
            if failure and not self.live_workers():  # the last worker failed: so did the run
                if env.msg.refused == Status.NONFINITE:
                    self.guard.nonfinite_pushes(f"worker{node.rank}")  # diverged: its gradients were NaN/Inf
                    self.begin_stop(DIVERGED)
                    return Ack(stop=True)
                self.failed = self.failed or failure
            self._replan(f"worker {node.rank} left" + (" on an error" if error else ""))
        return Ack(stop=True)

    # ------------------------------------------------------------ planning
    # ------------------------------------------------------------ evaluation and stopping
    def _record_eval(self, values: dict) -> None:
        accuracy, loss = float(values.get("accuracy", 0.0)), float(values.get("loss", 0.0))
        ev = self.evals
        ev.count += 1
        ev.best = max(ev.best, accuracy)
        ev.final, ev.final_loss = accuracy, loss
        t = self.elapsed()
        samples = sum(status.count(n.stats, "samples") for n in self.members("worker"))
        self.runlog.record("eval", t=round(t, 4), accuracy=accuracy, loss=loss,
                           global_steps=self.global_steps(), global_samples=samples,
                           final=bool(values.get("final", False)),
                           bytes=sum(status.count(n.stats, k) for n in self.members("worker")  # as last heard
                                     for k in ("bytes_sent", "bytes_received")))
        classes = values.get("num_classes")
        if (self.guard.loss(loss, "the evaluator (test loss)")
                or self.guard.evaluation(accuracy, classes if isinstance(classes, int) else None, t)):
            self.begin_stop(DIVERGED)
        if ev.target is None:
            return
        ev.streak = ev.streak + 1 if accuracy >= ev.target else 0
        self.state_dirty = True  # a restarted scheduler must not resume a streak this evaluation broke
        if ev.streak and ev.time_to_target_s is None:
            ev.time_to_target_s = round(t, 3)
            ev.samples_to_target = samples
        if ev.streak >= ev.patience:
            held = f", held for {ev.streak} evaluations" if ev.patience > 1 else ""
            self.begin_stop(f"target accuracy {ev.target} reached ({accuracy:.4f}{held})")

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
        timers = ((self._check_startup, self._save_when_due, self._answer_held_beats) if self.started is None else
                  (self._detect_dead, self._maybe_regroup, self._save_when_due, self._check_limits,
                   self._track_stalls, self._answer_held_beats))
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
                self.failures.append({"kind": "timer_error", "timer": name, "error": repr(exc)[:200],
                                      "t": round(self.elapsed(), 3)})

    def _check_startup(self) -> None:
        if self.elapsed() > self.cfg.cluster.startup_timeout_s:
            missing = {r: self.expected[r] - len(self.members(r)) for r in self.expected}
            self.failures.append({"kind": "startup", "missing": missing})
            self.begin_stop(f"cluster did not form within {self.cfg.cluster.startup_timeout_s}s: "
                            f"still waiting for {missing}")

    def _track_stalls(self) -> None:
        """Name who the cluster waits for (stalls.py): `stall` records while
        training, every open stall ended once the run stops."""
        replaced = frozenset(int(k) for k in self.plan.served_by) if self.plan is not None else frozenset()
        for rec in self.stalls.update(self.nodes, stopping=self.stop_reason is not None, replaced=replaced):
            self.runlog.record("stall", t=round(self.elapsed(), 4), **rec)

    def _save_when_due(self) -> None:
        """Save once per tick at most: a burst of registrations (1,024 nodes)
        writes the state file a few times, not once per node."""
        if self.state_dirty or self.clock() - self.state_saved > state.SAVE_EVERY_S:
            state.save(self)

    def _check_limits(self) -> None:
        stop = self.cfg.stop
        if self.elapsed() >= stop.max_seconds:
            self.begin_stop(f"time limit {stop.max_seconds}s")
        if stop.max_steps and self.global_steps() >= stop.max_steps:
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
        for peer, req, _ in self.plan_waiters if self.plan is None else ():  # a first plan that never comes
            self.reply(peer, req, Error(status=int(Status.BAD_STATE), message=f"run stopped: {self.stop_reason}"))
        state.save(self, finished=True)
        self.runlog.write_summary(self.summary())
        self.runlog.close()
