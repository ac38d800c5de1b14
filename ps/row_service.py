"""The shard's sparse-table rows (docs/sparse.md): PULL_ROWS and PUSH_ROWS served from this
shard's slices. Kept apart from the dense tensors because rows have their own rounds,
version (`updates`), parked pulls and retry cache; sparse_tables.py is the tables' math."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetps.proto.codec import Envelope, ProtocolError
from hetps.proto.messages import Ack, Rows, Status
from hetps.proto.plan import ClusterPlan
from hetps.proto.sparse import read_rows_request, rows_key, table_spec
from hetps.runconfig.schema import RunConfig
from hetps.runtime.emulation import Slowdown, work_clock

from .nonfinite import NonfiniteScreen
from .retry_cache import RetryCache
from .sparse_tables import SparseTables

# policies whose rounds sum a group's pushes: their sparse rows are summed per round alike
ROUND_POLICIES = ("sync", "grouping", "balanced")


@dataclass(frozen=True)
class ParkedRows:
    """A PULL_ROWS waiting for its worker's open round of rows to close."""

    peer: bytes
    req_id: int
    worker: int
    ids: dict  # table -> ids, checked


class RowService:
    """One shard's sparse-table slices (`tables`, None when the plan has none), the row
    pulls parked until their worker's round closes, and the last row ACK per worker.
    The shard hands it PULL_ROWS and PUSH_ROWS with the plan it serves, and answers
    what `take_answered` gives back. Counts in the shard's `counts` (row_pushes,
    row_pulls, retried, nonfinite, busy_s). Not thread-safe: the shard's loop owns it."""

    def __init__(
        self,
        plan: ClusterPlan,
        node_id: int,
        cfg: RunConfig,
        policy: str,
        screen: NonfiniteScreen,
        slowdown: Slowdown,
        counts: dict,
    ):
        self.node_id = node_id
        self.cfg = cfg
        self.screen = screen
        self.slowdown = slowdown
        self.counts = counts
        self.specs = {t.name: table_spec(t) for t in plan.tables}
        self.tables = self._make_tables(plan, policy)
        self.plan_id = plan.plan_id  # the plan whose members the open rounds of rows follow
        self.parked: list[ParkedRows] = []  # PULL_ROWS waiting for their worker's round
        self.recent_acks = RetryCache(counts)  # the ACK of each worker's last row push

    def _make_tables(self, plan: ClusterPlan, policy: str) -> SparseTables | None:
        """This shard's slices of the plan's sparse tables (proto/sparse.py), drawn from the
        run's seed: a backup or a restarted shard of the same plan draws the same rows."""
        if not plan.tables:
            return None
        return SparseTables(
            [table_spec(t) for t in plan.tables],
            plan.shard_index(self.node_id),
            len(plan.shards),
            self.cfg.sparse,
            self.cfg.seed,
            "round" if policy in ROUND_POLICIES else "each",
        )

    # ------------------------------------------------------------ requests
    def pull(self, plan: ClusterPlan, peer: bytes, env: Envelope) -> Rows | None:
        """Rows by id; a worker's pull (clock >= 0) is parked (None) while its last row push
        is in an open round (its group's other members have not pushed theirs yet).
        ProtocolError for a request this shard cannot serve, refused now."""
        ids = self._request(plan, env, with_rows=False)
        if env.msg.clock >= 0 and self.tables.waiting(env.src):
            # a retried pull replaces its parked original
            self.parked = [p for p in self.parked if p.worker != env.src]
            self.parked.append(ParkedRows(peer, env.req_id, env.src, ids))
            return None
        return self._reply(ids)

    def push(self, plan: ClusterPlan, env: Envelope) -> Ack:
        """Apply one PUSH_ROWS (a retry is answered with its first ACK, applied once);
        the caller then answers `take_answered()`. ProtocolError, with nothing applied,
        for a push this shard refuses (bad ids or rows, NaN/Inf under reject, a stale
        plan, a sender that is no worker of `plan`)."""
        push = env.msg
        retried = self.recent_acks.answer(env.src, env.req_id)
        if retried is not None:
            return retried
        grads = self._request(plan, env, with_rows=True)
        if push.plan_id < plan.placement_id:
            raise ProtocolError(
                Status.STALE_PLAN,
                f"plan {push.plan_id} predates placement of plan {plan.placement_id}",
            )
        grads = self._screened(grads)
        members = plan.groups[plan.group_of(env.src)] if plan.groups else plan.worker_ids()
        if push.plan_id < self.plan_id:
            # made under a plan whose rounds were closed since (a member left, groups changed):
            # applied alone, as the dense policies do, so it does not open a round of the new plan
            # that the others' pushes of the next step would join one step out of line
            members = [env.src]
        elif env.src not in members:
            raise ProtocolError(
                Status.BAD_STATE, f"node {env.src} is not a worker of plan {plan.plan_id}"
            )
        started = work_clock()
        self.tables.push(env.src, members, grads)
        self.counts["busy_s"] += self.slowdown.stretch(work_clock() - started)
        self.counts["row_pushes"] += 1
        ack = Ack(version=self.tables.updates, plan_id=plan.plan_id)
        self.recent_acks.remember(env.src, env.req_id, ack)
        return ack

    def close_rounds(self, plan_id: int) -> bool:
        """The workers or groups changed (plan `plan_id`): open rounds of rows apply what
        they have; a row push made under an earlier plan is applied alone from now on.
        True if a round closed (parked pulls may be answered now)."""
        self.plan_id = plan_id
        return self.tables is not None and self.tables.close_rounds()

    def take_answered(self) -> list[tuple[bytes, int, Rows]]:
        """(peer, request id, reply) of every parked pull whose round has closed, taken off
        the parked list, in the order they were parked."""
        if self.tables is None:
            return []
        waiting, answered = [], []
        for pull in self.parked:
            if self.tables.waiting(pull.worker):
                waiting.append(pull)
            else:
                answered.append((pull.peer, pull.req_id, self._reply(pull.ids)))
        self.parked = waiting
        return answered

    def _request(self, plan: ClusterPlan, env: Envelope, with_rows: bool) -> dict:
        if self.tables is None:
            raise ProtocolError(Status.UNKNOWN_TENSOR, "this cluster has no sparse tables")
        return read_rows_request(
            env.msg.tensors,
            self.specs,
            plan.shard_index(self.node_id),
            len(plan.shards),
            self.cfg.sparse.max_ids,
            with_rows,
        )

    def _reply(self, ids: dict) -> Rows:
        self.counts["row_pulls"] += 1
        return Rows(
            version=self.tables.updates,
            tensors={rows_key(t): self.tables.rows(t, i) for t, i in ids.items()},
        )

    def _screened(self, grads: dict) -> dict:
        """NaN/Inf in pushed rows, per `cluster.nonfinite` as for dense pushes: reject refuses
        the push, skip pushes zeros (the round still closes), clip replaces them."""
        bad = [t for t, (_, rows) in grads.items() if not bool(torch.isfinite(rows).all())]
        mode = self.screen.verdict(bad, "rows of table {} hold NaN or Inf")
        for t in bad if mode else ():
            ids, rows = grads[t]
            grads[t] = (
                ids,
                torch.zeros_like(rows) if mode == "skip" else self.screen.clipped(rows),
            )
        return grads

    # ------------------------------------------------------------ checkpoints and copies
    def state_dict(self) -> dict:
        """The shard's checkpoint entries of the rows: `sparse` and `recent_row_acks`."""
        return {
            "sparse": self.tables.state_dict() if self.tables else None,
            "recent_row_acks": self.recent_acks.state_dict(),
        }

    def restore(self, state: dict, new_workers: bool) -> None:
        """From a checkpoint of this shard (Shard.restore); `new_workers`: the old workers'
        open round is applied, not kept, and their last ACKs are forgotten. ValueError
        when the checkpoint holds no tables and this shard's plan has some."""
        if self.tables is not None:
            if state.get("sparse") is None:
                raise ValueError("checkpoint holds no sparse tables, this shard's plan has some")
            self.tables.load_state_dict(state["sparse"])
            if new_workers:
                self.tables.close_rounds()  # the old workers' open round is applied, not kept
        if not new_workers:
            self.recent_acks.load_state_dict(state.get("recent_row_acks", {}))

    def load_copy(self, state: dict) -> None:
        """From a primary's state (a late backup, state_copy.py): open rounds included.
        ProtocolError (BAD_STATE) when it holds no tables and this shard's plan has some."""
        if self.tables is not None:
            if state.get("sparse") is None:
                raise ProtocolError(
                    Status.BAD_STATE, "SNAPSHOT holds no sparse tables, this backup's plan has some"
                )
            self.tables.load_state_dict(state["sparse"])  # open rounds included
        self.recent_acks.load_state_dict(state.get("recent_row_acks", {}))
