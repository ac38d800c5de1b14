"""The parameter-server shard: a Service that holds the tensors the plan
assigned to it and applies pushes through the algorithm's consistency policy;
its rows of the sparse tables are served by its RowService (row_service.py).

One loop, one thread; a pull that may not be answered yet is parked and
answered after a later push makes it ready. The shard never imports model
code: it knows tensor names, dtypes, shapes and kinds from the plan, and
values from the first INIT.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from hetps.proto.codec import Envelope, ProtocolError, encode, nonfinite_names
from hetps.proto.messages import Ack, Error, Op, Params, Status
from hetps.proto.plan import ClusterPlan
from hetps.proto.records import FusedAck
from hetps.proto.rpc import Service
from hetps.proto.transport import ServerTransport
from hetps.runconfig.algorithms import algorithm, check_plan_algorithm
from hetps.runconfig.schema import NodeConfig, RunConfig
from hetps.runtime.checkpoint import Checkpointer
from hetps.runtime.emulation import Slowdown, work_clock
from hetps.runtime.optim import schedule_batch

from .future_pushes import FuturePushes
from .hold_ledger import HoldLedger
from .nonfinite import NonfiniteScreen
from .policies import POLICIES, ConsistencyPolicy
from .retry_cache import RetryCache
from .row_service import RowService
from .sparse_tables import SparseTables
from .store import TensorStore
from .updater import Updater

# what a push flagged NaN/Inf becomes under `cluster.nonfinite: skip`, by what the algorithm pushes
# (the table's `pushes`): a neutral contribution, so the rounds it belongs to still close
NEUTRAL_PUSH = {
    "gradients": lambda store, name, pushed: torch.zeros_like(pushed),
    "model": lambda store, name, pushed: store.tensors[name].clone(),
}

log = logging.getLogger(__name__)


_UNSCANNED = object()  # no policy's release mark equals it


@dataclass(frozen=True)
class ParkedPull:
    """A PULL (or a PUSH with `pull`) waiting until the policy lets its worker's clock read."""

    peer: bytes
    req_id: int
    worker: int
    clock: int
    ack: Ack | None = None  # a push with `pull`: its ACK goes out with the values
    since: float = 0.0  # monotonic time it was parked


def per_group_round(counts: dict, policy: dict) -> dict:
    """Under rounds of groups (sync, balanced, grouping): the pushes and push bytes this shard
    took in per group update: the group's size without comm.aggregate, 1 and a mean's bytes with."""
    rounds = sum(policy.get("group_updates", {}).values())
    if not rounds:
        return {}
    return {
        "pushes_per_round": round(counts["pushes"] / rounds, 3),
        "push_bytes_per_round": round(counts["push_bytes"] / rounds),
    }


class Shard(Service):
    """The dense tensors the plan placed on this shard, updated by the algorithm's policy,
    and (through `rows`) this shard's rows of the sparse tables. `clock`: seconds for
    parked requests' `held_s` (virtual under `hetps simulate`); `checkpointer`: where and
    when it checkpoints (None: not at all, until `checkpoint_to`); `park_future_pushes`:
    a push made under a plan not adopted yet waits for it (a daemon, which fetches plans).
    Not thread-safe: one loop serves it."""

    def __init__(
        self,
        server: ServerTransport,
        node_id: int,
        plan: ClusterPlan,
        cfg: RunConfig,
        slowdown: Slowdown | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        checkpointer: Checkpointer | None = None,
        park_future_pushes: bool = False,
    ):
        check_plan_algorithm(cfg.algorithm, plan)  # raises AlgorithmMismatch naming both
        super().__init__(server, node_id)
        self.cfg = cfg
        self.plan = plan
        self.algorithm = algorithm(plan.algorithm)
        self.slowdown = slowdown or Slowdown(NodeConfig())
        self.clock = clock
        self.store = TensorStore(plan.owned(plan.shard_index(node_id)))
        self.policy: ConsistencyPolicy | None = None
        # (worker, request id) -> the parked pull, in the order they were parked
        self.parked: dict[tuple[int, int], ParkedPull] = {}
        # the policy's release mark at the last look at the parked pulls (a new policy: none yet)
        self._scanned_mark: object = _UNSCANNED
        self.park_future_pushes = park_future_pushes
        self.future_pushes = FuturePushes()
        self.checkpointer = checkpointer
        self.restored_version: int | None = None
        # whom parked pulls wait for, and who held them up (stall attribution); on the shard's clock
        self.holds = HoldLedger(clock)
        self.counts = {
            "pushes": 0,
            "push_bytes": 0,  # bytes of the tensors those pushes carried
            "pulls": 0,
            "nonfinite": 0,
            "retried": 0,
            "checkpoint_errors": 0,
            "timer_errors": 0,
            "busy_s": 0.0,
            "row_pushes": 0,
            "row_pulls": 0,
        }
        self.screen = NonfiniteScreen(cfg.cluster, self.counts)  # dense pushes and row pushes
        self.recent_acks = RetryCache(self.counts)  # the ACK of each worker's last push
        self.rows = RowService(
            plan, node_id, cfg, self.algorithm.policy, self.screen, self.slowdown, self.counts
        )
        if not self.store.specs:
            # the placement gave this shard no dense tensor (its part of the model is sparse rows):
            # no INIT ever fills it, so its policy is made now, to answer a PULL (no values, its
            # version) and a PUSH of no tensor, and to checkpoint its rows, instead of parking them
            self._make_policy()
        # pull replies leave zero-copy from the live tensors: whatever else may write them settles first
        self.handlers = {
            op: h if op == Op.PULL else self._settled(h) for op, h in self.handlers.items()
        }

    @property
    def sparse(self) -> SparseTables | None:
        """This shard's slices of the sparse tables (read them: the row service writes them)."""
        return self.rows.tables

    def _settled(self, handler):
        def settle_then_handle(peer: bytes, env: Envelope):
            self.store.settle()
            return handler(peer, env)

        return settle_then_handle

    # ------------------------------------------------------------ Service hooks
    def catalog(self):
        return self.store.catalog

    def max_tensor_bytes(self) -> int:
        return self.cfg.cluster.max_message_bytes

    def stats(self) -> dict:
        policy = self.policy.stats() if self.policy else {}
        saved = self.checkpointer.stats() if self.checkpointer else {}
        return {
            "version": self.store.version,
            "parked": len(self.parked),
            "plan_id": self.plan.plan_id,
            "pushes_awaiting_plan": self.future_pushes.count,
            "malformed": self.malformed,
            "tensors": len(self.store.specs),
            "restored_version": self.restored_version,
            "snapshot_moves": self.store.snapshots.moves,
            "lr": self.policy.updater.lr if self.policy else 0.0,
            **self.counts,
            **(self.sparse.stats() if self.sparse else {}),
            **saved,
            **policy,
            **self.holds.report(self.policy, self.parked.values()),
            **per_group_round(self.counts, policy),
        }

    def adopt(self, plan: ClusterPlan) -> None:
        """Switch to a newer plan (same placement): open rounds are closed first."""
        if plan.placement_id != self.plan.placement_id:
            raise ValueError(
                f"plan {plan.plan_id} moves tensors; live re-placement is not supported"
            )
        log.info("adopting plan %d (groups %s)", plan.plan_id, plan.groups)
        self.store.settle()  # closing rounds writes the tensors
        self.plan = plan
        if self.policy is not None:
            self.policy.adopt(plan)
        self.close_row_rounds()
        self._serve_parked()
        self.take_future_pushes(plan.plan_id)

    def take_future_pushes(self, plan_id: int | None = None) -> None:
        """Handle, and answer, the parked pushes made under plans up to
        `plan_id` (None: all, under the plan this shard has)."""
        # taken now, whatever plan they name
        parking, self.park_future_pushes = self.park_future_pushes, False
        try:
            for parked in self.future_pushes.take(plan_id):
                self._answer_parked_push(parked)
        finally:
            self.park_future_pushes = parking

    def _answer_parked_push(self, parked) -> None:
        try:
            # a PUSH or a PUSH_ROWS
            answer = self.handlers[parked.env.msg.OP](parked.peer, parked.env)
        except ProtocolError as err:
            answer = Error(status=int(err.status), message=err.message)
        except Exception as exc:  # as in Service.serve_once: a bug must not kill the loop
            log.exception("parked PUSH failed")
            answer = Error(status=int(Status.INTERNAL), message=repr(exc)[:200])
        if answer is not None:
            self.reply(parked.peer, parked.env.req_id, answer)

    # ------------------------------------------------------------ handlers
    def on_init(self, peer: bytes, env: Envelope):
        first = self.store.initialize(env.msg.tensors)
        if first:
            self._make_policy()
            log.info("initialized %d tensors from node %d", len(self.store.specs), env.src)
            # a restart before the first periodic one still has the values
            self.maybe_checkpoint(force=True)
            self._serve_parked()
        return Ack(version=self.store.version, plan_id=self.plan.plan_id, info={"first": first})

    def _make_policy(self) -> None:
        updater = Updater(
            self.store.tensors,
            self.store.param_names(),
            self.cfg.optimizer,
            self.store.arena,
            schedule_batch(self.cfg),
        )
        self._scanned_mark = _UNSCANNED
        self.policy = POLICIES[self.algorithm.policy](
            self.store, updater, self.plan, self.cfg.algorithm.params
        )

    def on_push(self, peer: bytes, env: Envelope):
        push = env.msg
        if self.policy is None:
            raise ProtocolError(Status.NOT_READY, "no INIT has reached this shard yet")
        if push.plan_id < self.plan.placement_id:  # made for a placement that no longer holds
            raise ProtocolError(
                Status.STALE_PLAN,
                f"plan {push.plan_id} predates placement of plan {self.plan.placement_id}",
            )
        if self.park_future_pushes and push.plan_id > self.plan.plan_id:
            # the sender already follows a newer plan: wait for it (the daemon's loop fetches it), so
            # this push joins the new plan's rounds here as on every other shard
            self.future_pushes.park(peer, env, self.clock())
            return None
        ack = self._apply_push(env)
        if not push.pull:
            return ack
        # the values a PULL with clock + 1 right behind this push would get, with the ACK
        return self._answer_or_park(
            ParkedPull(peer, env.req_id, env.src, push.clock + 1, ack, self.clock())
        )

    def _apply_push(self, env: Envelope) -> Ack:
        """A PUSH through the policy; a retry is answered with its first ACK. ProtocolError,
        with nothing applied, for a refused push (NaN/Inf under reject, the policy's)."""
        retried = self.recent_acks.answer(env.src, env.req_id)  # a push already applied
        if retried is not None:
            return retried
        push = self._screen_nonfinite(env.msg)
        return self._take_push(env if push is env.msg else replace(env, msg=push))

    def _take_push(self, env: Envelope) -> Ack:
        """Apply a new push, NaN/Inf already handled, and remember its ACK."""
        push = env.msg
        started = work_clock()
        staleness = self.policy.on_push(env.src, push)
        self._stretch(work_clock() - started)
        self.counts["pushes"] += 1
        self.counts["push_bytes"] += sum(t.nbytes for t in push.tensors.values())
        self._serve_parked(released_by=env.src)
        ack = Ack(
            version=self.store.version,
            staleness=max(0, staleness),
            plan_id=self.plan.plan_id,
            info=self.policy.reply_info(env.src),
        )
        self.recent_acks.remember(env.src, env.req_id, ack)
        self.maybe_checkpoint()
        return ack

    def on_pull(self, peer: bytes, env: Envelope):
        self._check_puller(env)
        return self._answer_or_park(
            ParkedPull(peer, env.req_id, env.src, env.msg.clock, since=self.clock())
        )

    def _check_puller(self, env: Envelope) -> None:
        """Refuse (BAD_STATE) a PULL or PULL_ROWS with a clock from a node that is no worker of
        the plan this shard serves: it would wait for a clock no round of this plan counts.
        Served: clock -1 (the latest values, never parked: the evaluator's, which no plan names)
        and a sender that follows a plan newer than this shard's (a worker that just joined)."""
        msg = env.msg
        if msg.clock >= 0 and msg.plan_id <= self.plan.plan_id:
            if env.src not in self.plan.worker_ids():
                raise ProtocolError(
                    Status.BAD_STATE, f"node {env.src} is not a worker of plan {self.plan.plan_id}"
                )

    def _answer_or_park(self, pull: ParkedPull) -> Params | None:
        if self._ready(pull):
            return self._params(pull)
        # a retried pull replaces its parked original (its peer id may be new after a reconnect);
        # it keeps the original's `since`, so `held_s` counts from the first arrival
        key = (pull.worker, pull.req_id)
        original = self.parked.pop(key, None)
        if original is not None:
            pull = replace(pull, since=original.since)
        self.parked[key] = pull
        return None

    # ------------------------------------------------------------ sparse tables
    def on_pull_rows(self, peer: bytes, env: Envelope):
        """Rows by id, from the row service (parked while the worker's round of rows is open)."""
        self._check_puller(env)
        return self.rows.pull(self.plan, peer, env)

    def on_push_rows(self, peer: bytes, env: Envelope):
        if self.park_future_pushes and env.msg.plan_id > self.plan.plan_id:
            # made under a plan this shard has not adopted yet: it joins that plan's rounds
            self.future_pushes.park(peer, env, self.clock())
            return None
        return self._apply_row_push(env)

    def _apply_row_push(self, env: Envelope) -> Ack:
        ack = self.rows.push(self.plan, env)
        self._serve_parked_rows()
        return ack

    def close_row_rounds(self) -> None:
        """The workers or groups changed: open rounds of rows apply what they have; a row
        push made under an earlier plan is applied alone from now on."""
        if self.rows.close_rounds(self.plan.plan_id):
            self._serve_parked_rows()

    def _serve_parked_rows(self) -> None:
        for peer, req_id, rows in self.rows.take_answered():
            self.reply(peer, req_id, rows)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Everything needed to serve on from here after a restart."""
        return {
            "run_id": self.plan.run_id,
            "rank": self.node_rank(),
            "plan_id": self.plan.plan_id,
            "algorithm": self.plan.algorithm,
            **self.store.state_dict(),
            "updater": self.policy.updater.state_dict(),
            "policy": self.policy.state_dict(),
            "recent_acks": self.recent_acks.state_dict(),
            "counts": self.counts,
            **self.rows.state_dict(),  # "sparse", "recent_row_acks"
        }

    def node_rank(self) -> int:
        return self.plan.shards[self.plan.shard_index(self.node_id)].rank

    def restore(self, state: dict, new_workers: bool = False) -> None:
        """Continue from a checkpoint of this shard (same run, same placement).
        `new_workers` (a resumed run): the workers are new processes with new
        ids and clocks, so the policy's bookkeeping starts afresh."""
        for key, mine in (
            ("algorithm", self.plan.algorithm),
            ("run_id", self.plan.run_id),
            ("rank", self.node_rank()),
        ):
            if state[key] != mine:
                raise ValueError(f"checkpoint is of {key} {state[key]!r}, this shard's is {mine!r}")
        self.store.settle()
        self.store.load_state_dict(state)
        self._make_policy()
        self.policy.updater.load_state_dict(state["updater"])
        self.rows.restore(state, new_workers)
        if not new_workers:
            self.policy.load_state_dict(state["policy"])
            self.policy.restored = True
            self.recent_acks.load_state_dict(state["recent_acks"])
            self.counts.update(state["counts"])
        self.restored_version = self.store.version
        if state["plan_id"] != self.plan.plan_id and not new_workers:
            self.policy.adopt(self.plan)
            self.close_row_rounds()  # the checkpoint's rounds were of an earlier plan's members
        log.info(
            "restored version %d (plan %d) from a checkpoint", self.store.version, state["plan_id"]
        )
        self._serve_parked()

    def load_copy(self, plan: ClusterPlan, state: dict) -> None:
        """Become an exact copy, under `plan`, of the shard whose `state_dict()` `state` is
        (a backup made after training began, state_copy.py): unlike `restore`, which
        realigns, the policy's and the rows' open rounds are kept. KeyError, TypeError or
        ValueError for a state of another kind of shard; ProtocolError (BAD_STATE) for one
        without the sparse tables this plan has."""
        self.store.settle()
        self.plan = plan
        self.store.load_state_dict(state)
        self._make_policy()
        self.policy.updater.load_state_dict(state["updater"])
        self.policy.load_state_dict(state["policy"])
        self.recent_acks.load_state_dict(state["recent_acks"])
        self.rows.load_copy(state)
        self.counts.update(state["counts"])

    def checkpoint_to(self, checkpointer: Checkpointer) -> None:
        """Write checkpoints through `checkpointer` from now on (a shard restored before its
        checkpoints start; a backup promoted to serve a dead shard's tensors)."""
        self.checkpointer = checkpointer

    def count_timer_error(self) -> None:
        """A plan timer of the serving loop failed (counted in `timer_errors`)."""
        self.counts["timer_errors"] += 1

    def maybe_checkpoint(self, force: bool = False) -> None:
        if self.checkpointer is None or self.policy is None:
            return
        if force or self.checkpointer.due(self.store.version):
            try:
                self.checkpointer.write(self.state_dict())
            # a full or failing disk must not cost the update already applied, nor its answer:
            # whatever the write raises (OSError, torch's RuntimeError, ...) is counted and logged
            # once per kind; its temporary file is gone (checkpoint.write_atomic)
            except Exception as exc:
                self.counts["checkpoint_errors"] += 1
                self.checkpointer.failed(self.store.version, exc)

    # ------------------------------------------------------------ internals
    def _screen_nonfinite(self, push):
        """`push`, or a copy mended per `cluster.nonfinite` when it holds NaN/Inf
        (its tensors are read-only: proto/tensors.py): `reject` refuses the push
        (NONFINITE; nothing of it is recorded); `skip` accepts it as a neutral
        contribution (gradients -> zeros, a pushed model -> the shard's values,
        buffers dropped), so the rounds it belongs to still close; `clip`
        replaces NaN by 0 and +-Inf by +-clip_value. Counted in `nonfinite`."""
        bad = nonfinite_names(push.tensors)  # one sum per tensor; entry-wise only if not finite
        mode = self.screen.verdict(bad, "tensor {} holds NaN or Inf")
        if mode is None:
            return push
        tensors = dict(push.tensors)
        if mode == "clip":
            for n in bad:
                tensors[n] = self.screen.clipped(tensors[n])
            return replace(push, tensors=tensors)
        neutral = NEUTRAL_PUSH[self.algorithm.pushes]
        for n in list(tensors):
            if n in self.store.buffer_names():
                del tensors[n]
            else:
                tensors[n] = neutral(self.store, n, tensors[n])
        return replace(push, tensors=tensors)

    def _stretch(self, busy_s: float) -> None:
        """Emulate a slower server: make this update take slowdown x its time."""
        self.counts["busy_s"] += self.slowdown.stretch(busy_s)

    def _ready(self, pull: ParkedPull) -> bool:
        return self.policy is not None and self.policy.pull_ready(pull.worker, pull.clock)

    def _params(self, pull: ParkedPull | None = None) -> Params:
        self.counts["pulls"] += 1
        ack = None
        if pull is not None and pull.ack is not None:
            a = pull.ack
            # the record itself: this shard's own values need no reading from plain data
            ack = FusedAck(
                version=a.version,
                staleness=a.staleness,
                plan_id=a.plan_id,
                info=a.info,
                held_s=round(self.clock() - pull.since, 6),
            )
        return Params(
            version=self.store.version,
            ack=ack,
            tensors=self.store.snapshot(),
            lr=self.policy.updater.lr if self.policy else 0.0,
        )

    def reply(self, peer: bytes, req_id: int, msg):
        if not isinstance(msg, Params):
            return super().reply(peer, req_id, msg)
        # the pulls of one version share one encoding of the tensors; only their headers differ
        tracker = self.server.send(
            peer, encode(msg, req_id, self.node_id, encoded=self.store.encoded(msg.tensors))
        )
        # its snapshot's buffers are reused once the transport is done
        self.store.track(msg.tensors, tracker)
        return tracker

    def _serve_parked(self, released_by: int | None = None) -> None:
        """Answer the parked pulls that became ready; `released_by`: the
        worker whose push just made them so (it held their waiters up). After
        a push, nothing is looked at unless the policy's release mark moved
        (a push into an open sync round frees no one: at 64 workers, looking
        at every parked pull for each push cost more than the push)."""
        mark = self.policy.release_mark() if self.policy is not None else None
        if released_by is not None and mark == self._scanned_mark:
            return
        self._scanned_mark = mark
        ready = [p for p in self.parked.values() if self._ready(p)]
        for pull in ready:
            del self.parked[(pull.worker, pull.req_id)]
            self.reply(pull.peer, pull.req_id, self._params(pull))
        if released_by is not None:
            self.holds.released(released_by, ready)


def profile_update_speed(slowdown: Slowdown, numel: int = 1 << 18, steps: int = 20) -> float:
    """Bytes per second this shard updates: SGD-with-momentum steps on a
    scratch tensor (the fastest of `steps`: other processes starting on the
    same cores only ever slow a step down, and the placement is fixed from
    these speeds; the mean of 5 varied 2-3x between shards of one host, the
    fastest of 20 about 1.3x), stretched by the emulated slowdown."""
    param = torch.zeros(numel)
    grad = torch.ones(numel)
    opt = torch.optim.SGD([param], lr=0.01, momentum=0.9)
    param.grad = grad
    opt.step()  # warm-up: allocates the momentum buffer
    fastest = float("inf")
    for _ in range(steps):
        started = work_clock()
        opt.step()
        fastest = min(fastest, work_clock() - started)
    return numel * 4 / max(fastest * slowdown.factor(), 1e-9)
