"""cluster.max_message_bytes: the floor every config must clear
(runconfig/checks.py) and what a model needs of it, checked by every worker
before it registers (worker/preflight.py `message_bytes_needed`)."""

from __future__ import annotations

import itertools
import random

import pytest

from hetps.proto import dtypes
from hetps.proto.codec import MAX_HEADER_BYTES, encode_tensors
from hetps.proto.plan import TensorSpec
from hetps.ps.arena import Arena
from hetps.runconfig.checks import MIN_MESSAGE_BYTES
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ConfigError
from hetps.scheduler.placement import place
from hetps.training.models import build_model
from hetps.training.preflight import (
    CURVE_FRAME_BYTES,
    ConfigValueError,
    check_message_bytes,
    least_largest_part,
    message_bytes_needed,
    one_frame_bytes,
)
from hetps.training.state import model_specs

MNIST = (1, 28, 28)
# 784 x 2048 float32 weights: 6,422,528 bytes in one tensor
WIDE_MLP = ["model.name=mlp", "model.kwargs={hidden: [2048]}"]


def cfg_of(*overrides: str):
    # tensors uncut unless a test cuts them (the default, chunk_bytes=auto, is tested at the end)
    return load_config("configs/sync.yaml", ["cluster.chunk_bytes=0", *overrides])


def specs_of(cfg, in_shape=MNIST) -> list[TensorSpec]:
    return model_specs(build_model(cfg.model, in_shape, 10))


def test_the_floor_is_the_protocols_largest_header():
    assert MIN_MESSAGE_BYTES == MAX_HEADER_BYTES
    with pytest.raises(ConfigError) as refused:
        cfg_of("cluster.max_message_bytes=1000")
    assert any(
        e.startswith("cluster.max_message_bytes: must be >= 1048576") and e.endswith("got 1000")
        for e in refused.value.errors
    ), refused.value.errors
    assert cfg_of(f"cluster.max_message_bytes={MIN_MESSAGE_BYTES}").cluster.max_message_bytes == (
        MIN_MESSAGE_BYTES
    )


def test_least_largest_part_is_the_best_cut_into_contiguous_ranges():
    rng = random.Random(0)
    for _ in range(300):
        sizes = [rng.choice([4, 6, 40, 1000, 65536, 70001]) for _ in range(rng.randint(1, 7))]
        shards = rng.randint(1, 4)
        best = min(
            max(one_frame_bytes(sizes[a:b]) for a, b in zip((0, *cut), (*cut, len(sizes))))
            for k in range(min(shards, len(sizes)))
            for cut in itertools.combinations(range(1, len(sizes)), k)
        )
        assert least_largest_part(sizes, shards) == best, (sizes, shards)


def pull_reply_frame(part: list[TensorSpec]) -> int:
    """The largest frame of a shard's pull reply holding `part`, as the shard
    encodes it: its arena's tensors (ps/store.py), through the real encoder."""
    arena = Arena((s.name, dtypes.DTYPES[s.dtype], tuple(s.shape), s.kind == "param") for s in part)
    views = {n: arena.views[n] for n in arena.order}
    return max(memoryview(f).nbytes for f in encode_tensors(views, arena=arena.memory).frames)


@pytest.mark.parametrize(
    "overrides, in_shape",
    [([], MNIST), (["model.name=resnet20"], (3, 32, 32))],
)
def test_no_placement_sends_a_smaller_pull_reply_than_the_bound(overrides, in_shape):
    rng = random.Random(1)
    for shards in (1, 2, 3, 4):
        cfg = cfg_of(*overrides, f"cluster.shards={shards}")
        specs = specs_of(cfg, in_shape)
        need = message_bytes_needed(specs, cfg)
        largest = []
        for _ in range(20):
            placement = place(specs, [rng.uniform(0.2, 5.0) for _ in range(shards)])
            parts = [[s for s in specs if placement[s.name] == k] for k in range(shards)]
            largest.append(max(pull_reply_frame(p) for p in parts if p))
        assert min(largest) >= need.need, (shards, need, min(largest))
        assert max(largest) <= need.whole
    # LeNet-5 on 2 shards of equal speed: the bound is the frame the faster one sends
    cfg = cfg_of()
    specs = specs_of(cfg)
    placement = place(specs, [1.0, 1.0])
    frame = pull_reply_frame([s for s in specs if placement[s.name] == 0])
    assert message_bytes_needed(specs, cfg).need == frame == 202288


def test_what_the_bound_names():
    cfg = cfg_of(*WIDE_MLP)
    specs = specs_of(cfg)
    need = message_bytes_needed(specs, cfg)
    assert need.need == 784 * 2048 * 4 and "1.weight" in need.why, need
    assert need.whole == one_frame_bytes([s.nbytes for s in specs])
    # cut into parts, the tensor spreads over both shards: half the model each
    chunked = cfg_of(*WIDE_MLP, "cluster.chunk_bytes=1000000")
    half = message_bytes_needed(specs, chunked)
    assert need.whole // 2 < half.need < need.need and "pull reply" in half.why, half
    # CurveZMQ wraps each frame: the frame bound grows by its bytes, a tensor's bound does not
    curve = cfg_of(*WIDE_MLP, "cluster.chunk_bytes=1000000", "security.curve=true")
    assert message_bytes_needed(specs, curve).need == half.need + CURVE_FRAME_BYTES
    # with shared memory the large frames bypass the sockets: only the tensor bound is left
    shm = cfg_of(*WIDE_MLP, "comm.shm_bytes=65536")
    assert message_bytes_needed(specs, shm).need == 784 * 2048 * 4


def test_the_plan_header_bounds_a_model_of_many_small_tensors():
    cfg = cfg_of("cluster.shards=1")
    specs = [TensorSpec(f"block{i}.scale", "float32", (1,)) for i in range(3000)]
    need = message_bytes_needed(specs, cfg)
    assert "the plan lists every tensor" in need.why, need
    assert need.need > sum(len(s.name) for s in specs) > one_frame_bytes([4] * 3000)


def test_check_message_bytes_names_the_key_and_the_smallest_value():
    big = cfg_of(*WIDE_MLP, "cluster.max_message_bytes=2000000")
    model = build_model(big.model, MNIST, 10)
    with pytest.raises(ConfigValueError) as refused:
        check_message_bytes(model, big)
    assert str(refused.value).startswith(
        "cluster.max_message_bytes: must be at least 6422528 for model 'mlp' on 2 shards, "
        "got 2000000: its largest tensor, 1.weight, has 6422528 bytes"
    ), refused.value
    check_message_bytes(model, cfg_of(*WIDE_MLP, "cluster.max_message_bytes=6422528"))
    lenet = cfg_of(f"cluster.max_message_bytes={MIN_MESSAGE_BYTES}")  # needs 202288
    check_message_bytes(build_model(lenet.model, MNIST, 10), lenet)


def test_the_default_auto_parts_lower_the_bound_of_a_wide_tensor():
    uncut = cfg_of(*WIDE_MLP)
    auto = load_config("configs/sync.yaml", WIDE_MLP)  # cluster.chunk_bytes: auto, 2 shards
    specs = specs_of(auto)
    need = message_bytes_needed(specs, auto)
    assert need.need < message_bytes_needed(specs, uncut).need // 2 + 65536, need
    assert "pull reply" in need.why, need
