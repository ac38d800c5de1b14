"""Gradient compression (`comm.compression`): what the compressors send, what
the codec decodes at a shard, error feedback over steps, refusals of lying
payloads at a live in-process shard (a real cluster trained with topk:
tests/cluster/test_cluster_compression.py)."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch
from shard_harness import ShardHarness, make_plan

from hetps.proto import messages as m
from hetps.proto.codec import ProtocolError, decode, encode
from hetps.proto.compression import (
    Compressed,
    Fp16Compressor,
    TopKCompressor,
    index_dtype,
    make_compressor,
    payload_nbytes,
)
from hetps.proto.layout import PACK_ALL_BELOW
from hetps.proto.messages import Status
from hetps.proto.plan import TensorSpec
from hetps.proto.rpc import RemoteError
from hetps.runconfig.algorithms import ALGORITHMS
from hetps.runconfig.schema import ClusterConfig
from hetps.worker.client import PSClient

FP16_REL = 2.0**-11  # round to nearest, 11-bit significand
FP16_ABS = 2.0**-25  # half the smallest float16 subnormal step, below the normal range


def through_wire(tensors: dict, catalog=None) -> dict:
    """Encode a PUSH carrying `tensors` (some Compressed), decode it as a shard would."""
    frames = encode(m.Push(plan_id=1, clock=0, base_version=0, tensors=tensors), req_id=5, src=2)
    return decode([bytes(f) for f in frames], catalog).msg.tensors


def grads(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- fp16


def test_fp16_decodes_within_the_stated_error():
    g = torch.cat([grads(0, 5000) * 10.0**e for e in range(-9, 5)]).reshape(70, 1000)
    sent = Fp16Compressor(0.0).compress({"w": g}, {"w"})["w"]
    assert isinstance(sent, Compressed) and sent.nbytes == g.numel() * 2
    got = through_wire({"w": sent})["w"]
    assert got.dtype == torch.float32 and got.shape == g.shape
    err = (got - g).abs()
    assert bool((err <= FP16_REL * g.abs() + FP16_ABS).all()), float(
        (err - FP16_REL * g.abs()).max()
    )
    assert float(err.max()) > 0  # it really went through float16


def test_fp16_of_float64_comes_back_float64_and_overflow_is_inf():
    g = torch.tensor([1.0, -3.5, 7e4, -1e5], dtype=torch.float64)
    got = through_wire({"w": Fp16Compressor(0.0).compress({"w": g}, {"w"})["w"]})["w"]
    assert got.dtype == torch.float64
    assert got[:2].tolist() == [1.0, -3.5]
    # beyond 65504: the shard's nonfinite policy decides
    assert got[2] == math.inf and got[3] == -math.inf


# ---------------------------------------------------------------- topk


def test_topk_sends_exactly_the_k_largest_and_keeps_the_rest():
    g = grads(1, 40, 25)  # 1000 distinct magnitudes (almost surely)
    comp = TopKCompressor(0.03)
    sent = comp.compress({"w": g}, {"w"})["w"]
    k = 30
    assert isinstance(sent, Compressed) and sent.count == k
    assert sent.nbytes == payload_nbytes("topk", torch.float32, 1000, k) == 8 * k
    got = through_wire({"w": sent})["w"]
    largest = set(g.abs().reshape(-1).topk(k).indices.tolist())
    nonzero = set(got.reshape(-1).nonzero().reshape(-1).tolist())
    assert nonzero == largest
    flat_g, flat_got = g.reshape(-1), got.reshape(-1)
    assert torch.equal(flat_got[sorted(largest)], flat_g[sorted(largest)])
    assert torch.equal(comp.residual["w"], (g - got).reshape(-1))  # residual = gradient - sent


def test_topk_error_feedback_delays_but_loses_nothing():
    comp = TopKCompressor(0.05)
    total_g = torch.zeros(300, dtype=torch.float64)
    total_sent = torch.zeros(300, dtype=torch.float64)
    for step in range(40):
        g = grads(100 + step, 300)
        got = through_wire({"w": comp.compress({"w": g}, {"w"})["w"]})["w"]
        assert int((got != 0).sum()) == 15
        total_g += g.double()
        total_sent += got.double()
    residual = comp.residual["w"].double()
    assert torch.allclose(total_sent + residual, total_g, atol=1e-4)
    assert float(residual.abs().max()) > 0  # something is still waiting to be sent


def test_topk_picks_from_gradient_plus_residual():
    comp = TopKCompressor(0.25)  # k = 1 of 4
    first = comp.compress({"w": torch.tensor([4.0, 3.0, 0.0, 0.0])}, {"w"})["w"]
    assert through_wire({"w": first})["w"].tolist() == [4.0, 0.0, 0.0, 0.0]
    second = comp.compress({"w": torch.tensor([0.0, 0.5, 2.0, 0.0])}, {"w"})["w"]
    assert through_wire({"w": second})["w"].tolist() == [0.0, 3.5, 0.0, 0.0]  # 3 + 0.5 beats 2
    assert comp.residual["w"].tolist() == [0.0, 0.0, 2.0, 0.0]


def test_topk_sends_dense_when_pairs_would_not_be_smaller():
    comp = TopKCompressor(0.6)
    g = torch.tensor([1.0, -2.0, 3.0])
    out = comp.compress({"b": g}, {"b"})["b"]
    assert not isinstance(out, Compressed) and torch.equal(out, g)
    assert comp.residual["b"].tolist() == [0.0, 0.0, 0.0]
    assert out.data_ptr() != g.data_ptr()  # a fresh tensor: the residual buffer is written later


def test_only_named_float_tensors_are_compressed():
    comp = make_compressor("topk", 0.01)
    tensors = {
        "w": grads(2, 50, 50),
        "bn.mean": grads(3, 500),
        "steps": torch.tensor(7),
        "h": torch.ones(400, dtype=torch.bfloat16),
        "e": torch.empty(0),
    }
    out = comp.compress(tensors, {"w", "steps", "h", "e"})
    assert isinstance(out["w"], Compressed)
    for name in ("bn.mean", "steps", "h", "e"):
        assert out[name] is tensors[name]
    assert comp.stats() == {
        "compression": "topk",
        "grad_dense_bytes": 10000,
        "grad_sent_bytes": 104 + 100,
    }
    assert make_compressor("none", 0.5) is None
    with pytest.raises(ValueError):
        make_compressor("zip", 0.5)


def test_ps_client_compresses_float_parameter_gradients_only():
    specs = [
        TensorSpec("w", "float32", (64, 64)),
        TensorSpec("bn.mean", "float32", (64,), "buffer"),
        TensorSpec("bn.n", "int64", (), "buffer"),
    ]
    plan = make_plan(specs, workers=[7])
    client = PSClient(plan, 7, ClusterConfig(), compressor=make_compressor("fp16", 0.0))
    try:
        push = client._push(
            0,
            {"w": torch.ones(64, 64), "bn.mean": torch.ones(64), "bn.n": torch.tensor(3)},
            clock=0,
            n_samples=8,
            info=None,
        )
    finally:
        client.close()
    assert isinstance(push.tensors["w"], Compressed) and push.tensors["w"].kind == "fp16"
    assert not isinstance(push.tensors["bn.mean"], Compressed) and not isinstance(
        push.tensors["bn.n"], Compressed
    )
    assert client.compression_stats() == {
        "grad_dense_bytes": 64 * 64 * 4,
        "grad_sent_bytes": 64 * 64 * 2,
    }
    # compression applies to gradient pushes only (diloco's pseudo-gradients too): models travel exact
    assert {a.worker_loop: a.pushes for a in ALGORITHMS.values()} == {
        "gradients": "gradients",
        "local_steps": "model",
        "pseudo_gradients": "gradients",
    }


def test_large_topk_payload_has_its_own_frame_and_decodes():
    g = grads(4, 1 << 21)
    sent = TopKCompressor(0.05).compress({"w": g}, {"w"})["w"]
    # large enough that it is not packed with the rest (layout.choose_packed)
    assert index_dtype(g.numel()) == torch.int32 and sent.nbytes > PACK_ALL_BELOW
    frames = encode(
        m.Push(plan_id=1, clock=0, base_version=0, tensors={"w": sent, "b": torch.ones(3)})
    )
    assert len(frames) == 3  # header, the topk payload, a frame for the small dense one
    got = decode(frames).msg.tensors["w"]
    assert int((got != 0).sum()) == sent.count


# ---------------------------------------------------------------- at a shard (in-process transport)


SPECS = [
    TensorSpec("w", "float32", (30, 20)),
    TensorSpec("b", "float32", (20,)),
    TensorSpec("bn.mean", "float32", (20,), "buffer"),
]


def init_values() -> dict:
    return {"w": grads(5, 30, 20), "b": grads(6, 20), "bn.mean": torch.zeros(20)}


@pytest.mark.parametrize("kind", ["fp16", "topk"])
def test_shard_applies_the_decoded_dense_gradient(kind):
    h = ShardHarness(SPECS, ["optimizer.momentum=0.0", "optimizer.lr=0.5"], workers=[7])
    h.call(7, m.Init(plan_id=h.plan_id, tensors=init_values()))
    g = {"w": grads(7, 30, 20), "b": grads(8, 20), "bn.mean": torch.ones(20)}
    sent = make_compressor(kind, 0.1).compress(g, {"w", "b"})
    dense = through_wire(sent)
    ack = h.call(7, m.Push(plan_id=h.plan_id, clock=0, base_version=0, n_samples=4, tensors=sent))
    assert ack.version == 1
    values = h.call(7, m.Pull(plan_id=h.plan_id, clock=1)).tensors
    for name in ("w", "b"):
        assert torch.allclose(values[name], init_values()[name] - 0.5 * dense[name], atol=1e-6), (
            name
        )
    assert not torch.equal(dense["w"], g["w"])  # it really was lossy


def lying_topk_push(plan_id: int) -> list:
    """A valid topk PUSH whose second index was made equal to the first."""
    sent = TopKCompressor(0.1).compress({"w": grads(9, 30, 20), "b": grads(10, 20)}, {"w", "b"})
    frames = [
        bytearray(f)
        for f in encode(m.Push(plan_id=plan_id, clock=0, base_version=0, tensors=sent), 99, 7)
    ]
    pack = frames[-1]  # both payloads are small: packed, `w` first
    index = torch.frombuffer(pack, dtype=torch.int32, count=2)
    index[1] = index[0]
    return [bytes(f) for f in frames]


def test_shard_refuses_lying_compressed_push_and_keeps_serving():
    h = ShardHarness(SPECS, [], workers=[7])
    h.call(7, m.Init(plan_id=h.plan_id, tensors=init_values()))
    before = {
        n: t.clone() for n, t in h.call(7, m.Pull(plan_id=h.plan_id, clock=-1)).tensors.items()
    }
    client = h.client(7)
    client._ops[99] = "PUSH"
    client.transport.send(lying_topk_push(h.plan_id))
    h.serve()
    with pytest.raises(RemoteError) as err:
        client.wait(99, timeout_s=2.0)
    assert err.value.status == Status.MALFORMED and "topk" in err.value.message
    after = h.call(7, m.Pull(plan_id=h.plan_id, clock=-1))
    assert after.version == 0 and h.shards[0].malformed == 1
    assert all(torch.equal(after.tensors[n], t) for n, t in before.items())


def test_decoder_refuses_compression_of_integer_tensor():
    frames = encode(m.Push(plan_id=1, clock=0, base_version=0, tensors={"n": torch.arange(4)}))
    h = msgpack.unpackb(frames[0], raw=False)
    h["enc"] = [[0, "fp16", 4]]
    with pytest.raises(ProtocolError) as err:
        decode([msgpack.packb(h), b"\0" * 8])
    assert err.value.status == Status.MALFORMED


def test_config_refuses_topk_without_a_ratio():
    from hetps.runconfig.load import load_config
    from hetps.runconfig.schema import ConfigError

    with pytest.raises(ConfigError, match="comm.topk_ratio"):
        load_config(None, ["comm.compression=topk", "comm.topk_ratio=0"])
    assert (
        load_config(None, ["comm.compression=fp16", "comm.topk_ratio=0"]).comm.compression == "fp16"
    )
