"""Large tensors cut into parts placed on different shards, and put back
together by the worker's client."""

from __future__ import annotations

import torch

from hetps.proto.plan import ClusterPlan, NodeEntry, TensorSpec, chunk_specs
from hetps.proto.tensors import Tensors
from hetps.runconfig.schema import ClusterConfig
from hetps.scheduler.placement import place
from hetps.worker.client import PSClient

SPECS = [
    TensorSpec("conv.weight", "float32", (6, 1, 5, 5)),
    TensorSpec("fc.weight", "float32", (120, 400)),
    TensorSpec("fc.bias", "float32", (120,)),
    TensorSpec("bn.running_mean", "float32", (120,), "buffer"),
]


def test_chunk_specs_cuts_only_large_tensors_in_forward_order():
    specs, chunks = chunk_specs(SPECS, max_bytes=40_000)
    assert list(chunks) == ["fc.weight"]
    parts = chunks["fc.weight"]["parts"]
    assert [s.name for s in specs] == ["conv.weight", *parts, "fc.bias", "bn.running_mean"]
    sizes = [s.shape[0] for s in specs if s.name in parts]
    assert sum(sizes) == 120 * 400 and max(sizes) * 4 <= 40_000 and len(parts) == 5
    assert chunks["fc.weight"]["shape"] == [120, 400]
    assert chunk_specs(SPECS, 0) == (SPECS, {})


def test_parts_of_one_tensor_can_land_on_different_shards():
    specs, _ = chunk_specs(SPECS, max_bytes=40_000)
    placement = place(specs, [1.0, 1.0, 1.0])
    assert len({placement[f"fc.weight#{i}"] for i in range(5)}) >= 2


def test_client_split_and_join_round_trip():
    specs, chunks = chunk_specs(SPECS, max_bytes=40_000)
    placement = place(specs, [1.0, 1.0])
    plan = ClusterPlan(
        plan_id=1,
        algorithm="sync",
        workers=[NodeEntry(3, 0)],
        shards=[NodeEntry(1, 0, "mem://chunk-a"), NodeEntry(2, 1, "mem://chunk-b")],
        tensors=specs,
        placement=placement,
        chunks=chunks,
    )
    client = PSClient(plan, 3, ClusterConfig())
    values = {s.name: torch.randn(s.shape) for s in SPECS}
    per_shard = client.split(values)
    assert sorted(n for part in per_shard for n in part) == sorted(s.name for s in specs)
    for i, part in enumerate(per_shard):
        assert all(placement[n] == i for n in part)
    joined = client.join(
        Tensors.merge({n: t.clone() for n, t in part.items()} for part in per_shard)
    )
    assert set(joined) == set(values)
    for name, t in values.items():
        assert torch.equal(joined[name], t)
    # parts are views of the original: no copy on the way out
    assert (
        per_shard[placement["fc.weight#0"]]["fc.weight#0"].data_ptr()
        == values["fc.weight"].data_ptr()
    )
