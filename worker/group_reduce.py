"""A synchronous group's reduction before the shards (`comm.aggregate`): the
members of a Grouping-SGD group (sync's and balanced's one group) sum their
gradients with a gloo all-reduce, and each shard gets the group's mean once
per round, pushed by one member, instead of one push per member; the shard's
reply (its new values) is broadcast by that member to the others.

One step of a member (`GroupReduce.step`), k members, rank r among them:

1. one int64 all-reduce of the members' clocks, sample counts and the newest
   plan each has heard of (every member writes its own slots): the push's
   `members`, the round's weight, and whether the group switches plans after
   this step (all members switch at the same step, so none waits in a group
   the others left);
2. one all-reduce per floating dtype of the gradients and float buffers
   (balanced: each scaled by its samples; integer buffers: their maximum), then
   divided by the round's weight: the group's (sample-weighted) mean;
3. shard i (the i-th shard holding a dense tensor) is pushed by member i mod k,
   a `Push` whose `members` lists every member with its clock (the shard
   counts it as all of them, ps/policies/sync.py);
4. each such member broadcasts the reply it got, bytes as they are (exact for
   every dtype) behind a small header (version, staleness, plan id).

The shard sees one push per group-round and applies what today's round of k
pushes would (the mean of the members' gradients; balanced: weighted by
samples). A failed or timed-out collective raises `CollectiveError`; nothing
is pushed by a member whose reduction failed, and `Trainer` re-syncs from the
shards once the group is rebuilt or a new plan came (worker/trainer.py).

Where the store lives: every member serves a TCPStore (`MemberStore`, opened
before it registers and advertised as its plan entry's `address`); a group
rendezvous in the store of its first member, under the prefix
`<run id>/g<since>-<members>/e<epoch>`, `since` the plan since which the group
has had these members (`ClusterPlan.group_since`), so members that skipped
plans agree on it, and the scheduler holds no state the groups need.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetps.proto.messages import Ack, Params
from hetps.proto.plan import ClusterPlan
from hetps.proto.tensors import Tensors
from hetps.runtime.membership import reachable
from hetps.worker.collective_group import CollectiveError, GlooGroup, gloo_group, open_store

log = logging.getLogger(__name__)

MIN_TIMEOUT_S = 10.0  # the least a collective may wait (comm.collective_timeout_s: null)
ROUNDS_PER_TIMEOUT = 20
HEAD_BYTES = 32  # a shared reply's header: its version, the ACK's version, staleness and plan id  # null: this many of the slowest member's steps, at least MIN_TIMEOUT_S


def collective_timeout_s(
    configured: float | None, plan: ClusterPlan, group: list[int], batch: int
) -> float:
    """`comm.collective_timeout_s`, or (null) 20 of the group's slowest member's steps (its
    profiled samples/s in the plan, at `batch`), at least 10 s: a collective waits for the
    slowest member's compute as well as for the bytes."""
    if configured:
        return float(configured)
    speeds = [plan.speeds.get(str(w), 0.0) for w in group]
    slowest = min(speeds) if speeds and min(speeds) > 0 else 0.0
    step_s = batch / slowest if slowest else 0.0
    return max(MIN_TIMEOUT_S, ROUNDS_PER_TIMEOUT * step_s)


class MemberStore:
    """This worker's TCPStore server (port `port`, 0: a free one), where the groups it
    leads rendezvous; `address` is what it registers (tcp://HOST:PORT as peers reach it)."""

    def __init__(self, port: int, scheduler: str, timeout_s: float):
        self.store = open_store("0.0.0.0", port, is_owner=True, timeout_s=timeout_s)
        self.address = reachable(f"tcp://0.0.0.0:{self.store.port}", scheduler)
        if self.address.startswith(
            "tcp://0.0.0.0:"
        ):  # a local run (ipc): every member on this host
            self.address = f"tcp://127.0.0.1:{self.store.port}"


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


@dataclass
class Reduced:
    """What a group's reduction gave one member."""

    tensors: dict[str, torch.Tensor]  # the group's mean gradients (and mean buffers)
    members: list[tuple[int, int]]  # [node id, clock] of each member
    n_samples: int  # the members' samples
    newest_plan: int  # the newest plan any member has heard of


class GroupReduce:
    """This worker's view of its group's collectives under the current plan. Not thread-safe."""

    def __init__(
        self,
        node_id: int,
        run_id: str,
        timeout_s: float | None,
        batch: int,
        weighted: bool,
        min_group: int = 2,
    ):
        """`timeout_s`: comm.collective_timeout_s (None: sized per group); `batch`: the step's
        batch (sizes the timeout); `weighted`: balanced, whose mean is weighted by samples;
        `min_group`: smaller groups push per worker (runconfig.algorithms.min_aggregated_group)."""
        self.node_id = node_id
        self.min_group = min_group
        self.run_id = run_id
        self.configured_timeout_s = timeout_s
        self.batch = batch
        self.weighted = weighted
        self.group: GlooGroup | None = None
        self.key: tuple = ()  # what the current group was built for
        self.seen: tuple = ()  # (plan id, epoch) of the last use_plan: a step's call is then free
        self.members: list[int] = []
        self.rank = 0
        self.epoch = 0  # bumped by every failure: the rebuilt group's prefix differs
        self.timeout_s = MIN_TIMEOUT_S
        self.counts = {"group_rounds": 0, "pushes_saved": 0, "failures": 0, "partial_rounds": 0}
        self.collective_s = 0.0  # seconds in collectives, all steps

    # ------------------------------------------------------------ the group under a plan
    def members_in(self, plan: ClusterPlan) -> list[int]:
        """This worker's synchronous group in `plan` (sync, balanced: every worker); alone when the
        group is smaller than `min_group` or a member has no collective store to rendezvous in
        (e.g. it runs no aggregation)."""
        group = next((list(g) for g in plan.groups if self.node_id in g), [self.node_id])
        stores = {w.node_id: w.address for w in plan.workers}
        if len(group) < self.min_group or not all(stores.get(w) for w in group):
            return [self.node_id]
        return group

    def active(self) -> bool:
        return len(self.members) > 1

    def use_plan(self, plan: ClusterPlan) -> None:
        """The group of `plan`; rebuilt (a rendezvous of every member) only when its
        members or their store changed since the group was built. Called every step: for the
        plan it last saw (and no failure since) it returns at once."""
        if (plan.plan_id, self.epoch) == self.seen and (
            self.group is not None or len(self.members) < 2
        ):
            return
        self.seen = (plan.plan_id, self.epoch)
        members = self.members_in(plan)
        # keyed by the group's first member as the plan lists it (scheduler/planning.py)
        since = plan.group_since.get(str(members[0]), plan.plan_id)
        key = (tuple(members), since, self.epoch)
        if key == self.key and (self.group is not None or len(members) < 2):
            return
        self.close()
        self.members, self.key = members, key
        self.rank = members.index(self.node_id)
        self.timeout_s = collective_timeout_s(self.configured_timeout_s, plan, members, self.batch)
        if len(members) < 2:
            return
        stores = {w.node_id: w.address for w in plan.workers}
        host, port = split_address(stores[members[0]])
        # gloo's own connections bind this worker's advertised host (its store's): the interface
        # its peers reach it by; on one host, loopback
        own, _ = split_address(stores[self.node_id])
        prefix = f"{self.run_id}/g{since}-{'-'.join(map(str, members))}/e{self.epoch}"
        started = time.monotonic()
        self.group = gloo_group(
            host, port, prefix, self.rank, len(members), self.timeout_s, host=own
        )  # fmt: skip
        log.info(
            "group %s: rank %d of %d, built in %.2fs (timeout %.1fs)",
            members, self.rank, len(members), time.monotonic() - started, self.timeout_s,
        )  # fmt: skip

    def broken(self) -> None:
        """A collective failed: drop the group; the next `use_plan` rebuilds it under a new
        epoch. (Counted by the caller, once it knows the run is not stopping: a member that
        stops first leaves the others' last collective to fail.)"""
        self.epoch += 1
        self.close()
        self.key = ()

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    # ------------------------------------------------------------ one step
    def _op(self, work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise CollectiveError(
                f"{what} of group {self.members} failed at rank {self.rank}: {e}"
            ) from e

    def _allreduce(
        self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, what: str = "all-reduce"
    ) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self._op(self.group.backend.allreduce([tensor], opts), what)

    def reduce(
        self,
        outgoing: dict[str, torch.Tensor],
        clock: int,
        n_samples: int,
        newest_plan: int,
        buffers: frozenset[str] = frozenset(),
    ) -> Reduced:
        """The group's mean of `outgoing`: gradients weighted by samples where `weighted`
        (balanced), the float `buffers` (names) a plain mean as the shard's round takes them,
        integer ones their maximum; and the members' clocks and samples and the newest plan any
        of them heard of. One all-reduce per dtype. Blocking; CollectiveError."""
        assert self.group is not None
        started = time.monotonic()
        k, r = len(self.members), self.rank
        meta = torch.zeros(3 * k, dtype=torch.int64)
        meta[r], meta[k + r], meta[2 * k + r] = clock, n_samples, newest_plan
        self._allreduce(meta, what="all-reduce of clocks")
        clocks, samples, plans = meta[:k].tolist(), meta[k : 2 * k].tolist(), meta[2 * k :].tolist()
        total = sum(samples)
        weighted = self.weighted and total > 0 and n_samples > 0
        weight, divisor = (float(n_samples), float(total)) if weighted else (1.0, float(k))
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name, t in outgoing.items():
            by_dtype.setdefault(t.dtype, []).append(name)
        out: dict[str, torch.Tensor] = {}
        for dtype, names in by_dtype.items():
            flat = torch.cat([outgoing[n].reshape(-1) for n in names])
            views, at = {}, 0
            for n in names:
                views[n] = flat[at : at + outgoing[n].numel()]
                at += outgoing[n].numel()
            if dtype.is_floating_point:
                grads = [v for n, v in views.items() if n not in buffers]
                if weight != 1.0:
                    for v in grads:
                        v.mul_(weight)
                self._allreduce(flat, what="all-reduce of gradients")
                for n, v in views.items():
                    v.div_(float(k) if n in buffers else divisor)
            else:
                self._allreduce(flat, dist.ReduceOp.MAX, what="all-reduce of integer buffers")
            for n, v in views.items():
                out[n] = v.view(outgoing[n].shape)
        self._charge(started)
        return Reduced(out, list(zip(self.members, clocks)), total, max(plans))

    def pusher_of(self, position: int) -> int:
        """The member (rank) that pushes the `position`-th dense shard's slice."""
        return position % len(self.members)

    def share(
        self,
        position: int,
        sent: tuple[Ack, Params] | None,
        layout: list[tuple[str, torch.Size, torch.dtype]],
    ) -> tuple[Ack, int, Tensors]:
        """The `position`-th dense shard's reply, broadcast from the member that pushed it:
        `sent` (its ACK and values) on that member, None on the others; the values are
        `layout` (name, shape, dtype). Returns the push's ACK, the values' version and the
        values, on every member. Blocking; CollectiveError."""
        assert self.group is not None
        started = time.monotonic()
        root = self.pusher_of(position)
        sizes = [s.numel() * d.itemsize for _, s, d in layout]
        packed = torch.empty(HEAD_BYTES + sum(sizes), dtype=torch.uint8)
        if self.rank == root:
            assert sent is not None
            ack, params = sent
            head = torch.tensor([params.version, ack.version, ack.staleness, ack.plan_id])
            packed[:HEAD_BYTES] = head.view(torch.uint8)
            at = HEAD_BYTES
            for (name, _, _), size in zip(layout, sizes):
                value = params.tensors[name].contiguous().reshape(-1)
                packed[at : at + size] = value.view(torch.uint8)
                at += size
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._op(self.group.backend.broadcast([packed], opts), "broadcast of a shard's values")
        version, acked, staleness, plan_id = packed[:HEAD_BYTES].view(torch.int64).tolist()
        values, at = {}, HEAD_BYTES
        for (name, shape, dtype), size in zip(layout, sizes):
            values[name] = packed[at : at + size].view(dtype).view(shape)
            at += size
        self._charge(started)
        return Ack(version=acked, staleness=staleness, plan_id=plan_id), version, Tensors(values)

    def _charge(self, started: float) -> None:
        spent = time.monotonic() - started
        self.collective_s += spent

    def stats(self) -> dict:
        return {
            "aggregate": self.active(),
            "group_size": len(self.members),
            "collective_s": round(self.collective_s, 4),
            **{f"collective_{k}": v for k, v in self.counts.items()},
        }
