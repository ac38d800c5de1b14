"""A model's tensors cut into the pieces each shard of a plan owns, and put
back together: tensors the plan chunks travel as 1-D parts on several shards.
Used by the worker's client of the shards and by the simulated workers alike,
with what a worker reads from a shard's fused reply."""

from __future__ import annotations

from typing import Mapping

import torch

from hetps.proto.messages import Ack, Params
from hetps.proto.plan import ClusterPlan


def part_sizes(plan: ClusterPlan) -> dict[str, list[int]]:
    """Chunked tensor name -> its parts' element counts (parts are 1-D; scalars never cut)."""
    sizes = {t.name: t.shape[0] for t in plan.tensors if t.shape}
    return {n: [sizes[p] for p in c["parts"]] for n, c in plan.chunks.items()}


def shard_names(plan: ClusterPlan) -> list[list[str]]:
    """Per shard of `plan`, the names of the tensors (and parts) it owns, in forward order."""
    return [[t.name for t in plan.owned(i)] for i in range(len(plan.shards))]


def split_for_shards(
    plan: ClusterPlan,
    tensors: Mapping[str, torch.Tensor],
    sizes: dict[str, list[int]],
    names: list[list[str]],
) -> list[dict]:
    """Per shard of `plan`, the tensors of `tensors` it owns; chunked tensors
    become views of their parts (`sizes`: `part_sizes(plan)`, `names`: `shard_names(plan)`)."""
    flat: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        chunk = plan.chunks.get(name)
        if chunk is None:
            flat[name] = t
        else:
            flat.update(zip(chunk["parts"], t.reshape(-1).split(sizes[name])))
    return [{n: flat[n] for n in mine if n in flat} for mine in names]


def join_parts(plan: ClusterPlan, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Reassemble, in place in `values`, the chunked tensors whose parts it holds (one copy each)."""
    for name, chunk in plan.chunks.items():
        if chunk["parts"][0] in values:
            values[name] = torch.cat([values.pop(p) for p in chunk["parts"]]).view(chunk["shape"])
    return values


def ack_of(reply: Params) -> tuple[Ack, float]:
    """The ACK a fused PUSH+PULL reply carries, and the seconds its values waited at the shard."""
    # typed and checked at decode (records.FusedAck); callers take only replies that carry one
    return Ack.of(reply.ack), reply.ack.held_s
