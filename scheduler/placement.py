"""Tensor placement: the tensor list, in forward order, cut into contiguous
ranges, range k to the k-th shard (shards listed fastest first), so that
bytes_k / speed_k is as even as possible. The bottom layers therefore land on
the fastest shard.
"""

from __future__ import annotations

from hetps.proto.plan import TensorSpec


def place(tensors: list[TensorSpec], speeds: list[float]) -> dict[str, int]:
    """tensor name -> shard index. Every shard gets at least one tensor when
    there are at least as many tensors as shards. `speeds` must be > 0."""
    if not speeds:
        raise ValueError("placement needs at least one shard")
    if not all(0 < s < float("inf") for s in speeds):  # also rejects NaN
        raise ValueError(f"shard speeds must be finite and > 0, got {speeds}")
    total = sum(t.nbytes for t in tensors) or 1
    # cumulative byte budget up to and including shard k
    bounds, acc = [], 0.0
    for s in speeds:
        acc += s
        bounds.append(total * acc / sum(speeds))
    placement: dict[str, int] = {}
    shard, done, on_shard = 0, 0, 0
    for i, t in enumerate(tensors):
        later_shards = len(speeds) - shard - 1
        over_budget = done + t.nbytes / 2 > bounds[shard]
        must_move = len(tensors) - i <= later_shards  # leave one tensor for each later shard
        if later_shards and on_shard and (over_budget or must_move):
            shard, on_shard = shard + 1, 0
        placement[t.name] = shard
        done += t.nbytes
        on_shard += 1
    return placement


def placement_shares(plan) -> dict[str, dict[str, float]]:
    """Per shard of `plan` (a ClusterPlan; `ps<rank>`), its fraction of the
    model's bytes beside its fraction of the shards' summed speed: with a
    balanced placement the two are close (the busiest shard's `bytes` is
    what bounds a push's service time)."""
    held = [0] * len(plan.shards)
    for t in plan.tensors:
        held[plan.placement[t.name]] += t.nbytes
    total = sum(held) or 1
    speeds = [float(plan.speeds.get(str(s.node_id), 1.0)) or 1.0 for s in plan.shards]
    return {
        f"ps{s.rank}": {"bytes": round(b / total, 4), "speed": round(v / sum(speeds), 4)}
        for s, b, v in zip(plan.shards, held, speeds)
    }
