"""Placement with the default configuration balances bytes over equally fast
shards: large tensors are cut into parts (`cluster.chunk_bytes: auto`), the
parts placed in forward order, bottom layers on the fastest shard."""

from __future__ import annotations

import pytest
import torch.nn as nn

from hetps.proto.plan import AUTO_MIN_CHUNK_BYTES, TensorSpec, chunk_size, chunk_specs
from hetps.runconfig.load import load_config
from hetps.scheduler.placement import place
from hetps.training.models import LeNet5, ResNet20
from hetps.training.state import model_specs


class SmallTransformer(nn.Module):
    """A 2-layer transformer encoder with its embedding and output head."""

    def __init__(self, vocab: int = 1000, width: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)


MODELS = {
    "lenet5": lambda: LeNet5((1, 28, 28), 10),
    "resnet20": lambda: ResNet20((3, 32, 32), 10),
    "transformer": SmallTransformer,
}


def default_placement(specs: list[TensorSpec], speeds: list[float]):
    """What the scheduler's first plan does with the default config (scheduler/planning.py)."""
    parts, chunks = chunk_specs(specs, load_config(None, []).cluster.chunk_bytes, len(speeds))
    return parts, chunks, place(parts, speeds)


@pytest.mark.parametrize("n_shards", [2, 4, 8])
@pytest.mark.parametrize("model", MODELS)
def test_default_placement_balances_bytes_over_equal_shards(model, n_shards):
    specs = model_specs(MODELS[model]())
    total = sum(s.nbytes for s in specs)
    parts, chunks, placement = default_placement(specs, [1.0] * n_shards)
    assert sum(p.nbytes for p in parts) == total  # parts cover every byte once
    held = [0] * n_shards
    for p in parts:
        held[placement[p.name]] += p.nbytes
    busiest_vs_fair = max(held) / (total / n_shards)
    assert busiest_vs_fair <= 1.15, (model, n_shards, held)
    # the bottom layer (its first part when cut) on the fastest shard, and ranges contiguous
    order = [placement[p.name] for p in parts]
    assert order[0] == 0
    assert order == sorted(order) and set(order) == set(range(n_shards))
    # a part belongs to exactly one tensor, in forward order
    names = [p.name.split("#")[0] for p in parts]
    assert list(dict.fromkeys(names)) == [s.name for s in specs]


def test_lenet_largest_tensor_is_spread_over_every_shard():
    # classifier.0.weight is 78% of LeNet-5's bytes: uncut, one of 4 shards would hold >= 78%
    specs = model_specs(LeNet5((1, 28, 28), 10))
    _, chunks, placement = default_placement(specs, [1.0] * 4)
    holders = {placement[p] for p in chunks["classifier.0.weight"]["parts"]}
    assert len(holders) >= 3


def test_faster_shard_takes_bytes_in_proportion_to_speed():
    specs = model_specs(ResNet20((3, 32, 32), 10))
    parts, _, placement = default_placement(specs, [3.0, 1.0])
    held = [0, 0]
    for p in parts:
        held[placement[p.name]] += p.nbytes
    assert held[0] / sum(held) == pytest.approx(0.75, abs=0.03)
    assert placement[parts[0].name] == 0


def test_chunk_size_settings():
    specs = [TensorSpec("w", "float32", (1 << 20,))]  # 4 MiB
    assert chunk_size("auto", specs, 1) == 0  # one shard: nothing to spread
    assert chunk_size("auto", specs, 4) == (4 << 20) // 32
    assert chunk_size("auto", [TensorSpec("b", "float32", (10,))], 8) == AUTO_MIN_CHUNK_BYTES
    assert chunk_size(0, specs, 4) == 0 and chunk_size(32768, specs, 4) == 32768
    assert chunk_specs(specs, 0, 4) == (specs, {})


def test_chunk_bytes_config_values():
    assert load_config(None, []).cluster.chunk_bytes == "auto"
    assert load_config(None, ["cluster.chunk_bytes=32768"]).cluster.chunk_bytes == 32768
    for bad, what in [("-1", "auto or an int"), ("big", "auto or an int"), ("1.5", "expected int")]:
        with pytest.raises(Exception, match=r"cluster\.chunk_bytes: .*" + what):
            load_config(None, [f"cluster.chunk_bytes={bad}"])
