"""Sparse tables in the simulator: the rows a simulated worker's forward pass
names, read from the simulated shards' slices as the real worker's
PULL_ROWS would get them.

The pull is not carried on the virtual network: it is read at the instant
the step's forward pass runs (its bytes are counted on the worker, its time
is not charged), which is when a real worker's pull would be answered under
every consistency rule the shards apply to rows: a synchronous member
computes a step only once its dense values came back, and a shard takes a
member's PUSH_ROWS before its dense PUSH of the same step (one queue per
shard, in arrival order), so every round of rows the pull would have waited
for has closed. The row gradients travel as real PUSH_ROWS messages, charged
at the shards like any other message.
"""

from __future__ import annotations

import torch

from hetps.proto.codec import ProtocolError
from hetps.proto.messages import Status
from hetps.ps.shard import Shard
from hetps.training.sparse import TouchedRows

ID_BYTES = 8  # an int64 id on the wire


class SimRows(TouchedRows):
    """Rows from `shards` (the plan's shards, in its order). `client`: whose
    bytes a pull counts (the simulated worker computing now); None for the
    evaluator's reads."""

    def __init__(self, shards: list[Shard]):
        super().__init__(len(shards))
        self.shards = shards
        self.client = None

    def rows(self, table: str, ids: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        order, counts = self.by_shard(ids)
        grouped = ids[order]
        parts, start = [], 0
        for shard, n in zip(self.shards, counts):
            if n:
                if shard.sparse is None:
                    raise ProtocolError(
                        Status.UNKNOWN_TENSOR, "the simulated shards hold no tables"
                    )
                parts.append(shard.sparse.rows(table, grouped[start : start + n]))
            start += n
        out = torch.empty(ids.numel(), dim, dtype=dtype)
        if parts:
            out[order] = torch.cat(parts).to(dtype)
        if self.client is not None:
            self.client.bytes_sent += ids.numel() * ID_BYTES
            self.client.bytes_received += out.nbytes
        return out
