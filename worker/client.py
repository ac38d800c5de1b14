"""The worker's client of the shards: sends each tensor to the shard that
owns it (per the plan) and gathers values back. Requests to all shards are
sent first and awaited together (`wait_all`), so shards work in parallel and
a request lost by one shard (restarted from a checkpoint) is re-sent while
the worker waits on another. A step's push asks
for the next values itself (`comm.fuse_pull`): one PUSH out, one PARAMS back
per shard; unfused, a PUSH and a PULL go back to back on one connection.

Blocking; every wait has the cluster's request timeout and is abandoned
(Aborted) when `should_abort()` turns true. Not thread-safe.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Callable, ContextManager, Mapping

import torch

from hetps.proto.codec import DTYPE_NAMES, ProtocolError
from hetps.proto.compression import FLOATS, Compressor
from hetps.proto.messages import Ack, Init, Message, Params, Pull, Push, Status
from hetps.proto.plan import ClusterPlan
from hetps.proto.records import PushInfo
from hetps.proto.rpc import RpcClient, wait_all
from hetps.proto.tensors import Tensors
from hetps.proto.transport import TransportOptions
from hetps.runconfig.schema import ClusterConfig
from hetps.runtime.emulation import wire_faults
from hetps.training.parts import ack_of, join_parts, part_sizes, shard_names, split_for_shards


class PSClient:
    def __init__(
        self,
        plan: ClusterPlan,
        node_id: int,
        cluster: ClusterConfig,
        should_abort: Callable[[], bool] | None = None,
        compressor: Compressor | None = None,
        fuse_pull: bool = True,
        plans: Callable[[int], ClusterPlan | None] | None = None,
        transport: TransportOptions | None = None,
    ):
        """`compressor`: applied to the gradients of float parameters in every
        push (`comm.compression`; None: pushes travel exact). `transport`: the
        options of every shard connection (the node's, `Membership.transport`:
        shared memory, emulated link); None: plain sockets bounded by
        cluster.max_message_bytes. `fuse_pull`
        (`comm.fuse_pull`): push_pull asks for the values in the push itself.
        `plans(after)`: a plan newer than `after`, or None (`Membership.newer_plan`);
        asked while a reply is awaited, so requests follow a shard to its
        promoted backup (`cluster.replicas`) without waiting for the step to end."""
        self.plan = plan
        self.plans = plans
        self.followed = plan  # the newest plan seen, for shard addresses
        self.plans_lock = threading.Lock()  # comm.overlap waits on shards from several threads
        self.compressor = compressor
        self.fuse_pull = fuse_pull
        floats = {DTYPE_NAMES[d] for d in FLOATS}
        self.compressible = {
            t.name for t in plan.tensors if t.kind == "param" and t.dtype in floats
        }
        # one seeded fault stream per shard connection: with comm.overlap each has its own
        # thread, and a shared generator would make the drops depend on thread timing
        self.faults = [
            wire_faults(cluster.faults, seed=node_id * 1009 + i) for i in range(len(plan.shards))
        ]
        self.transport = transport or TransportOptions(max_message_bytes=cluster.max_message_bytes)
        self.shards = [
            RpcClient(
                s.address,
                src=node_id,
                timeout_s=cluster.request_timeout_s,
                options=self.transport,
                should_abort=should_abort,
                retry_s=cluster.retry_s,
                faults=faults,
                redirect=functools.partial(self.address_of, i) if plans else None,
            )
            for i, (s, faults) in enumerate(zip(plan.shards, self.faults))
        ]
        self.names = shard_names(plan)
        # the shards that hold a dense tensor: the only ones INIT, PUSH and PULL go to (as in
        # ps-lite, a server that holds no key of a request is not asked); the placement is fixed
        self.dense = [i for i, names in enumerate(self.names) if names]
        self.versions = [0] * len(plan.shards)  # version of each shard's values we hold
        self.lrs = [0.0] * len(plan.shards)  # each shard's lr when it sent them (Params.lr)
        # seconds from sending the last push_pull until its pushes were acked
        self.last_push_s = 0.0
        self.part_sizes = part_sizes(plan)

    def adopt(self, plan: ClusterPlan) -> None:
        """Use a newer plan; its placement must be the one we connected for."""
        if plan.placement_id != self.plan.placement_id:
            raise ValueError(
                f"plan {plan.plan_id} moves tensors; live re-placement is not supported"
            )
        self.plan = plan
        if plan.plan_id > self.followed.plan_id:
            self.followed = plan
        for c, s in zip(self.shards, self.followed.shards):
            c.retarget(s.address)

    def address_of(self, i: int) -> str:
        """Shard `i`'s address in the newest plan (fetched when a newer one was announced)."""
        with self.plans_lock:
            newer = self.plans(self.followed.plan_id)
            if newer is not None and newer.placement_id == self.plan.placement_id:
                self.followed = newer
            return self.followed.shards[i].address

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.shards)

    @property
    def bytes_received(self) -> int:
        return sum(c.bytes_received for c in self.shards)

    def fault_stats(self) -> dict:
        """Requests re-sent (retries) and, under fault injection, dropped or delayed."""
        return {
            "resent": sum(c.resent for c in self.shards),
            "dropped": sum(f.dropped for f in self.faults),
            "delayed": sum(f.delayed for f in self.faults),
        }

    def split(self, tensors: Mapping[str, torch.Tensor]) -> list[dict]:
        """Per shard, the tensors it owns; chunked tensors become views of their parts."""
        return split_for_shards(self.plan, tensors, self.part_sizes, self.names)

    def join(self, values: Tensors) -> Tensors:
        """Reassemble chunked tensors from their parts (one copy each); the runs
        of `values` (`Tensors.merge`) that hold no part are kept."""
        if not self.plan.chunks:
            return values
        parts = {p for chunk in self.plan.chunks.values() for p in chunk["parts"]}
        return Tensors(
            join_parts(self.plan, dict(values)),
            [run for run in values.runs if parts.isdisjoint(run.names)],
        )

    def init(self, values: Mapping[str, torch.Tensor]) -> None:
        """Offer initial values to every shard; the first offer a shard gets wins."""
        parts = self.split(values)
        wait_all(self._send_dense(lambda i: Init(plan_id=self.plan.plan_id, tensors=parts[i])))

    def pull(self, clock: int) -> Tensors:
        """Current values from every shard (may wait, per the algorithm).
        Returned tensors are read-only views of received frames."""
        sent = self._send_dense(lambda i: Pull(plan_id=self.plan.plan_id, clock=clock))
        return self.join(
            Tensors.merge(
                self._params_reply(i, reply).tensors for i, reply in zip(self.dense, wait_all(sent))
            )
        )

    def _send_dense(self, message: Callable[[int], Message]) -> list[tuple[RpcClient, int]]:
        """(client, request id) of `message(i)` sent to each shard i of `dense`, in order."""
        return [(self.shards[i], self.shards[i].send(message(i))) for i in self.dense]

    def _push(
        self,
        i: int,
        part: dict,
        clock: int,
        n_samples: int,
        info: dict | None,
        pull: bool = False,
        members: list[tuple[int, int]] | None = None,
    ) -> Push:
        if self.compressor is not None:
            part = self.compressor.compress(part, self.compressible)
        return Push(
            plan_id=self.plan.plan_id,
            clock=clock,
            base_version=self.versions[i],
            n_samples=n_samples,
            info=PushInfo.read(info or {}),
            pull=pull,
            tensors=part,
            members=members or [],
        )

    def compression_stats(self) -> dict:
        """Bytes the compressed gradients would have taken dense, and took."""
        stats = self.compressor.stats() if self.compressor else {}
        return {k: stats.get(k, 0) for k in ("grad_dense_bytes", "grad_sent_bytes")}

    def push(
        self,
        tensors: Mapping[str, torch.Tensor],
        clock: int,
        n_samples: int,
        info: dict | None = None,
    ) -> list[Ack]:
        """Push without pulling (e.g. a last model when the run stops); returns the ACKs of
        the shards that hold a dense tensor, in shard order."""
        parts = self.split(tensors)
        return wait_all(self._send_dense(lambda i: self._push(i, parts[i], clock, n_samples, info)))

    def push_pull(
        self,
        tensors: Mapping[str, torch.Tensor],
        clock: int,
        n_samples: int,
        info: dict | None = None,
    ) -> tuple[list[Ack], Tensors]:
        """Push this step's tensors (gradients and buffers; a model for the
        averaging algorithms; `info`: algorithm extras) made after `clock`
        pushes, then pull the values for the next step. Returns the push ACKs
        and values (the ACKs of the shards that hold a dense tensor, in shard order).
        Every shard's request goes out before any reply is awaited."""
        started = time.monotonic()
        parts = self.split(tensors)
        steps = {i: self.send_step(i, parts[i], clock, n_samples, info) for i in self.dense}
        # all ACKs first, then values; while one shard is awaited the others' requests are tended
        acked = {i: self.await_ack(i, step, self.others(i)) for i, step in steps.items()}
        # one value that keeps the runs the decoders found, so a flat model loads each with one copy
        values = Tensors.merge(
            self.await_values(i, step, acked[i][2], self.others(i)).tensors
            for i, step in steps.items()
        )
        acked = list(acked.values())
        self.last_push_s = max(0.0, max(at for _, at, _ in acked) - started) if acked else 0.0
        return [ack for ack, _, _ in acked], self.join(values)

    def send_step(
        self,
        i: int,
        part: dict,
        clock: int,
        n_samples: int,
        info: dict | None,
        build_lock: ContextManager = contextlib.nullcontext(),
        members: list[tuple[int, int]] | None = None,
    ) -> tuple[int, int | None]:
        """Send shard `i`'s part of a step: a PUSH asking for the next values
        (fused), or a PUSH and a PULL right behind it. Returns (push id, pull
        id or None). `build_lock` is held while the push is built (compression
        state shared between threads). `members`: a group's aggregated push (Push.members)."""
        with build_lock:
            push = self._push(i, part, clock, n_samples, info, self.fuse_pull, members)
        c = self.shards[i]
        push_id = c.send(push)
        if self.fuse_pull:
            return push_id, None
        return push_id, c.send(Pull(plan_id=self.plan.plan_id, clock=clock + 1), after=push_id)

    def others(self, i: int) -> list[RpcClient]:
        return [self.shards[j] for j in self.dense if j != i]

    def await_ack(
        self, i: int, step: tuple[int, int | None], tend: list[RpcClient] = ()
    ) -> tuple[Ack, float, Params | None]:
        """Shard `i`'s ACK of a sent step, the monotonic time it was due, and
        the values when they came with it (fused: the ACK was due when the
        push was applied, before the values waited at the shard for `held_s`).
        `tend`: other shards' clients kept re-sending meanwhile (see `RpcClient.wait`)."""
        push_id, pull_id = step
        if pull_id is not None:
            ack = self.shards[i].wait(push_id, tend=tend)
            return ack, time.monotonic(), None
        reply = self._params_reply(i, self.shards[i].wait(push_id, tend=tend), fused=True)
        ack, held_s = ack_of(reply)
        return ack, time.monotonic() - held_s, reply

    def await_values(
        self, i: int, step: tuple[int, int | None], reply: Params | None, tend: list[RpcClient] = ()
    ) -> Params:
        """Shard `i`'s values for the next step: `reply` if they came with the ACK."""
        return (
            reply
            if reply is not None
            else self._params_reply(i, self.shards[i].wait(step[1], tend=tend))
        )

    def _params_reply(self, i: int, reply, fused: bool = False) -> Params:
        if not isinstance(reply, Params) or (fused and not reply.ack):
            raise ProtocolError(
                Status.MALFORMED,
                f"shard {i} answered with {type(reply).__name__}, "
                f"not the {'values and ACK' if fused else 'values'} asked for",
            )
        self.versions[i] = reply.version
        self.lrs[i] = reply.lr
        return reply

    def close(self) -> None:
        for c in self.shards:
            c.close()
