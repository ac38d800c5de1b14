"""The parameter-server shard: a Service that holds the tensors the plan
assigned to it and applies pushes through the algorithm's consistency policy.

One loop, one thread; a pull that may not be answered yet is parked and
answered after a later push makes it ready. The shard never imports model
code: it knows tensor names, dtypes, shapes and kinds from the plan, and
values from the first INIT.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, replace

import torch

from hetps.proto.codec import Envelope, ProtocolError, encode, nonfinite_names
from hetps.proto.messages import Ack, Error, Op, Params, Rows, Status
from hetps.proto.plan import ClusterPlan
from hetps.proto.records import FusedAck
from hetps.proto.rpc import Service
from hetps.proto.sparse import read_rows_request, rows_key, table_spec
from hetps.proto.transport import ServerTransport
from hetps.runconfig.algorithms import algorithm, check_plan_algorithm
from hetps.runconfig.schema import NodeConfig, RunConfig
from hetps.runtime.checkpoint import Checkpointer
from hetps.runtime.emulation import Slowdown, work_clock

from .future_pushes import FuturePushes
from .hold_ledger import HoldLedger
from .policies import POLICIES, ConsistencyPolicy
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


# policies whose rounds sum a group's pushes: their sparse rows are summed per round alike
ROUND_POLICIES = ("sync", "grouping", "balanced")


@dataclass(frozen=True)
class ParkedRows:
    """A PULL_ROWS waiting for its worker's open round of rows to close."""

    peer: bytes
    req_id: int
    worker: int
    ids: dict  # table -> ids, checked


_UNSCANNED = object()  # no policy's release mark equals it


@dataclass(frozen=True)
class ParkedPull:
    peer: bytes
    req_id: int
    worker: int
    clock: int
    ack: Ack | None = None  # a push with `pull`: its ACK goes out with the values
    since: float = 0.0  # monotonic time it was parked


class Shard(Service):
    def __init__(
        self,
        server: ServerTransport,
        node_id: int,
        plan: ClusterPlan,
        cfg: RunConfig,
        slowdown: Slowdown | None = None,
    ):
        check_plan_algorithm(cfg.algorithm, plan)  # raises AlgorithmMismatch naming both
        super().__init__(server, node_id)
        self.cfg = cfg
        self.plan = plan
        self.algorithm = algorithm(plan.algorithm)
        self.slowdown = slowdown or Slowdown(NodeConfig())
        # seconds for parked requests' `held_s`; virtual under `hetps simulate`
        self.clock = time.monotonic
        self.store = TensorStore(plan.owned(plan.shard_index(node_id)))
        self.policy: ConsistencyPolicy | None = None
        # (worker, request id) -> the parked pull, in the order they were parked
        self.parked: dict[tuple[int, int], ParkedPull] = {}
        # the policy's release mark at the last look at the parked pulls (a new policy: none yet)
        self._scanned_mark: object = _UNSCANNED
        self.sparse_specs = {t.name: table_spec(t) for t in plan.tables}
        self.sparse = self._make_sparse(plan)
        self.rows_plan_id = plan.plan_id  # the plan whose members the open rounds of rows follow
        self.parked_rows: list[ParkedRows] = []  # PULL_ROWS waiting for their worker's round
        # worker -> (request id, ACK) of its last PUSH_ROWS
        self.recent_row_acks: dict[int, tuple[int, Ack]] = {}
        # pushes made under a plan not adopted yet wait for it (the daemon turns this on: it fetches plans)
        self.park_future_pushes = False
        self.future_pushes = FuturePushes()
        self.checkpointer: Checkpointer | None = None  # set by the daemon when checkpoints are on
        # worker -> (request id, ACK) of its last push
        self.recent_acks: dict[int, tuple[int, Ack]] = {}
        self.restored_version: int | None = None
        # whom parked pulls wait for, and who held them up (stall attribution); on the shard's clock
        self.holds = HoldLedger(lambda: self.clock())
        self.counts = {
            "pushes": 0,
            "pulls": 0,
            "nonfinite": 0,
            "retried": 0,
            "checkpoint_errors": 0,
            "timer_errors": 0,
            "busy_s": 0.0,
            "row_pushes": 0,
            "row_pulls": 0,
        }
        # pull replies leave zero-copy from the live tensors: whatever else may write them settles first
        self.handlers = {
            op: h if op == Op.PULL else self._settled(h) for op, h in self.handlers.items()
        }

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
            self.store.tensors, self.store.param_names(), self.cfg.optimizer, self.store.arena
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
        push = env.msg
        last = self.recent_acks.get(env.src)
        if last is not None and last[0] == env.req_id:  # a retry of a push already applied
            self.counts["retried"] += 1
            return last[1]
        self._screen_nonfinite(push)
        started = work_clock()
        staleness = self.policy.on_push(env.src, push)
        self._stretch(work_clock() - started)
        self.counts["pushes"] += 1
        self._serve_parked(released_by=env.src)
        ack = Ack(
            version=self.store.version,
            staleness=max(0, staleness),
            plan_id=self.plan.plan_id,
            info=self.policy.reply_info(env.src),
        )
        self.recent_acks[env.src] = (env.req_id, ack)
        self.maybe_checkpoint()
        return ack

    def on_pull(self, peer: bytes, env: Envelope):
        return self._answer_or_park(
            ParkedPull(peer, env.req_id, env.src, env.msg.clock, since=self.clock())
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
    def _make_sparse(self, plan: ClusterPlan) -> SparseTables | None:
        """This shard's slices of the plan's sparse tables (proto/sparse.py), drawn from the
        run's seed: a backup or a restarted shard of the same plan draws the same rows."""
        if not plan.tables:
            return None
        mode = "round" if self.algorithm.policy in ROUND_POLICIES else "each"
        index = plan.shard_index(self.node_id)
        return SparseTables(
            [table_spec(t) for t in plan.tables],
            index,
            len(plan.shards),
            self.cfg.sparse,
            self.cfg.seed,
            mode,
        )

    def _rows_request(self, env: Envelope, with_rows: bool) -> dict:
        if self.sparse is None:
            raise ProtocolError(Status.UNKNOWN_TENSOR, "this cluster has no sparse tables")
        return read_rows_request(
            env.msg.tensors,
            self.sparse_specs,
            self.plan.shard_index(self.node_id),
            len(self.plan.shards),
            self.cfg.sparse.max_ids,
            with_rows,
        )

    def on_pull_rows(self, peer: bytes, env: Envelope):
        """Rows by id; a worker's pull (clock >= 0) waits while its last row push is in an
        open round (its group's other members have not pushed theirs yet)."""
        ids = self._rows_request(env, with_rows=False)  # refused now, not when it is answered
        if env.msg.clock >= 0 and self.sparse.waiting(env.src):
            # a retried pull replaces its parked original
            self.parked_rows = [p for p in self.parked_rows if p.worker != env.src]
            self.parked_rows.append(ParkedRows(peer, env.req_id, env.src, ids))
            return None
        return self._rows_reply(ids)

    def _rows_reply(self, ids: dict) -> Rows:
        self.counts["row_pulls"] += 1
        return Rows(
            version=self.sparse.updates,
            tensors={rows_key(t): self.sparse.rows(t, i) for t, i in ids.items()},
        )

    def on_push_rows(self, peer: bytes, env: Envelope):
        if self.park_future_pushes and env.msg.plan_id > self.plan.plan_id:
            # made under a plan this shard has not adopted yet: it joins that plan's rounds
            self.future_pushes.park(peer, env, self.clock())
            return None
        return self._apply_row_push(env)

    def _apply_row_push(self, env: Envelope) -> Ack:
        push = env.msg
        last = self.recent_row_acks.get(env.src)
        if last is not None and last[0] == env.req_id:  # a retry of a push already applied
            self.counts["retried"] += 1
            return last[1]
        grads = self._rows_request(env, with_rows=True)
        if push.plan_id < self.plan.placement_id:
            raise ProtocolError(
                Status.STALE_PLAN,
                f"plan {push.plan_id} predates placement of plan {self.plan.placement_id}",
            )
        grads = self._screen_nonfinite_rows(grads)
        members = (
            self.plan.groups[self.plan.group_of(env.src)]
            if self.plan.groups
            else self.plan.worker_ids()
        )
        if push.plan_id < self.rows_plan_id:
            # made under a plan whose rounds were closed since (a member left, groups changed):
            # applied alone, as the dense policies do, so it does not open a round of the new plan
            # that the others' pushes of the next step would join one step out of line
            members = [env.src]
        elif env.src not in members:
            raise ProtocolError(
                Status.BAD_STATE, f"node {env.src} is not a worker of plan {self.plan.plan_id}"
            )
        started = work_clock()
        self.sparse.push(env.src, members, grads)
        self._stretch(work_clock() - started)
        self.counts["row_pushes"] += 1
        self._serve_parked_rows()
        ack = Ack(version=self.sparse.updates, plan_id=self.plan.plan_id)
        self.recent_row_acks[env.src] = (env.req_id, ack)
        return ack

    def close_row_rounds(self) -> None:
        """The workers or groups changed: open rounds of rows apply what they have; a row
        push made under an earlier plan is applied alone from now on."""
        self.rows_plan_id = self.plan.plan_id
        if self.sparse is not None and self.sparse.close_rounds():
            self._serve_parked_rows()

    def _serve_parked_rows(self) -> None:
        waiting = []
        for pull in self.parked_rows:
            if self.sparse.waiting(pull.worker):
                waiting.append(pull)
            else:
                self.reply(pull.peer, pull.req_id, self._rows_reply(pull.ids))
        self.parked_rows = waiting

    def _screen_nonfinite_rows(self, grads: dict) -> dict:
        """NaN/Inf in pushed rows, per `cluster.nonfinite` as for dense pushes: reject refuses
        the push, skip pushes zeros (the round still closes), clip replaces them."""
        bad = [t for t, (_, rows) in grads.items() if not bool(torch.isfinite(rows).all())]
        if not bad:
            return grads
        self.counts["nonfinite"] += 1
        mode = self.cfg.cluster.nonfinite
        if mode == "reject":
            raise ProtocolError(Status.NONFINITE, f"rows of table {bad[0]!r} hold NaN or Inf")
        clip = self.cfg.cluster.clip_value
        for t in bad:
            ids, rows = grads[t]
            fixed = (
                torch.zeros_like(rows)
                if mode == "skip"
                else torch.nan_to_num(rows, nan=0.0, posinf=clip, neginf=-clip)
            )
            grads[t] = (ids, fixed)
        return grads

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
            "recent_acks": {
                w: (req, dataclasses.asdict(ack)) for w, (req, ack) in self.recent_acks.items()
            },
            "counts": self.counts,
            "sparse": self.sparse.state_dict() if self.sparse else None,
            "recent_row_acks": {
                w: (req, dataclasses.asdict(ack)) for w, (req, ack) in self.recent_row_acks.items()
            },
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
        if self.sparse is not None:
            if state.get("sparse") is None:
                raise ValueError("checkpoint holds no sparse tables, this shard's plan has some")
            self.sparse.load_state_dict(state["sparse"])
            if new_workers:
                self.sparse.close_rounds()  # the old workers' open round is applied, not kept
        if not new_workers:
            self.policy.load_state_dict(state["policy"])
            self.policy.restored = True
            self.recent_acks = {
                w: (req, Ack(**ack)) for w, (req, ack) in state["recent_acks"].items()
            }
            self.counts.update(state["counts"])
            self.recent_row_acks = {
                w: (req, Ack(**ack)) for w, (req, ack) in state.get("recent_row_acks", {}).items()
            }
        self.restored_version = self.store.version
        if state["plan_id"] != self.plan.plan_id and not new_workers:
            self.policy.adopt(self.plan)
            self.close_row_rounds()  # the checkpoint's rounds were of an earlier plan's members
        log.info(
            "restored version %d (plan %d) from a checkpoint", self.store.version, state["plan_id"]
        )
        self._serve_parked()

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
    def _screen_nonfinite(self, push) -> None:
        """NaN/Inf in a push, per `cluster.nonfinite`: `reject` refuses the push
        (NONFINITE; nothing of it is recorded); `skip` accepts it as a neutral
        contribution (gradients -> zeros, a pushed model -> the shard's values,
        buffers dropped), so the rounds it belongs to still close; `clip`
        replaces NaN by 0 and +-Inf by +-clip_value. Counted in `nonfinite`."""
        bad = nonfinite_names(push.tensors)  # one sum per tensor; entry-wise only if not finite
        if not bad:
            return
        self.counts["nonfinite"] += 1
        mode, tensors = self.cfg.cluster.nonfinite, push.tensors
        if mode == "reject":
            raise ProtocolError(Status.NONFINITE, f"tensor {bad[0]!r} holds NaN or Inf")
        if mode == "clip":
            clip = self.cfg.cluster.clip_value
            for n in bad:
                tensors[n] = torch.nan_to_num(tensors[n], nan=0.0, posinf=clip, neginf=-clip)
            return
        neutral = NEUTRAL_PUSH[self.algorithm.pushes]
        for n in list(tensors):
            if n in self.store.buffer_names():
                del tensors[n]
            else:
                tensors[n] = neutral(self.store, n, tensors[n])

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
        return Params(version=self.store.version, ack=ack, tensors=self.store.snapshot())

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
