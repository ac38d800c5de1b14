"""A worker's (or the evaluator's) row traffic with the shards that hold its
sparse tables: the rows a step's forward asks for, one request per shard
holding any of them, and the step's row gradients pushed after backward. The
modules that use the rows are training/sparse.py's `SparseEmbedding`."""

from __future__ import annotations

import functools
from typing import Callable

import torch

from hetps.proto.codec import ProtocolError
from hetps.proto.messages import Ack, PullRows, PushRows, Rows, Status
from hetps.proto.plan import ClusterPlan, TensorSpec
from hetps.proto.rpc import RpcClient, wait_all
from hetps.proto.sparse import ids_key, rows_key
from hetps.proto.transport import TransportOptions
from hetps.runconfig.schema import ClusterConfig
from hetps.training.sparse import TouchedRows


class RowExchange(TouchedRows):
    """A worker's (or the evaluator's) traffic of rows with every shard, on
    its own connections (the dense client's may be busy on other threads).
    `clock` counts the row pushes made; `read_only`: the latest rows, never
    parked (evaluator, export). Not thread-safe."""

    def __init__(
        self,
        plan: ClusterPlan,
        node_id: int,
        cluster: ClusterConfig,
        transport: TransportOptions | None = None,
        should_abort: Callable[[], bool] | None = None,
        address_of: Callable[[int], str] | None = None,
        read_only: bool = False,
        max_ids: int = 1 << 20,
    ):
        super().__init__(len(plan.shards))
        self.max_ids = max_ids
        self.max_message_bytes = cluster.max_message_bytes
        self.plan = plan
        self.read_only = read_only
        self.clock = 0
        self.counts = {"rows_pulled": 0, "rows_pushed": 0}
        self.shards = [
            RpcClient(
                s.address,
                src=node_id,
                timeout_s=cluster.request_timeout_s,
                options=transport or TransportOptions(max_message_bytes=cluster.max_message_bytes),
                should_abort=should_abort,
                retry_s=cluster.retry_s,
                redirect=functools.partial(address_of, i) if address_of else None,
            )
            for i, s in enumerate(plan.shards)
        ]

    def adopt(self, plan: ClusterPlan) -> None:
        self.plan = plan

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.shards)

    @property
    def bytes_received(self) -> int:
        return sum(c.bytes_received for c in self.shards)

    def stats(self) -> dict:
        return dict(self.counts)

    def rows(self, table: str, ids: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        """The current rows `ids` (unique int64) of `table`, in that order, fetched with one
        request to each shard that holds any of them."""
        order, counts = self.by_shard(ids)
        grouped = ids[order]
        clock = -1 if self.read_only else self.clock
        sent, start = [], 0
        for i, n in enumerate(counts):
            if n:
                part = grouped[start : start + n]
                msg = PullRows(
                    plan_id=self.plan.plan_id, clock=clock, tensors={ids_key(table): part}
                )
                sent.append((i, self.shards[i].send(msg), n))
            start += n
        replies = wait_all([(self.shards[i], req) for i, req, _ in sent])
        out = torch.empty(ids.numel(), dim, dtype=dtype)
        parts = []
        for (i, _, n), reply in zip(sent, replies):
            values = reply.tensors.get(rows_key(table)) if isinstance(reply, Rows) else None
            if values is None or tuple(values.shape) != (n, dim):
                raise ProtocolError(
                    Status.MALFORMED,
                    f"shard {i} answered {type(reply).__name__} without {n} rows of {table}",
                )
            parts.append(values)
        if parts:
            out[order] = torch.cat(parts)
        self.counts["rows_pulled"] += ids.numel()
        return out

    def push(self, n_samples: int) -> list[Ack]:
        """Send every shard its part of this step's row gradients (an empty push where the
        step touched none of its rows: a synchronous round counts every member), await the
        ACKs, and forget the step's rows."""
        per_shard = self.take_pushes()
        self.counts["rows_pushed"] += sum(
            part[k].numel() for part in per_shard for k in part if k.endswith(":ids")
        )
        sent = [
            c.send(
                PushRows(
                    plan_id=self.plan.plan_id, clock=self.clock, n_samples=n_samples, tensors=part
                )
            )
            for c, part in zip(self.shards, per_shard)
        ]
        acks = wait_all(list(zip(self.shards, sent)))
        self.clock += 1
        return acks

    def full_table(self, spec: TensorSpec, batch: int = 1 << 16) -> torch.Tensor:
        """The whole table, read in batches of at most `batch` ids (the final and best model
        files), each shard's part of a batch within `max_ids` and its reply within the
        sockets' message size."""
        rows, dim = spec.shape
        out = torch.empty(rows, dim, dtype=getattr(torch, spec.dtype))
        row_bytes = dim * out.element_size()
        per_shard = min(self.max_ids, max(1, (self.max_message_bytes // 2) // row_bytes))
        batch = max(1, min(batch, per_shard * len(self.shards)))
        for start in range(0, rows, batch):
            ids = torch.arange(start, min(rows, start + batch))
            out[start : start + ids.numel()] = self.rows(spec.name, ids, dim, out.dtype)
        return out

    def close(self) -> None:
        for c in self.shards:
            c.close()
