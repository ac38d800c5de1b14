"""Your own model and data, in one process: a user package made here
(support/own_model_pkg.py) read by the workers' batch streams, only their share;
a dataset that breaks the contract; `export`'s joining of chunked tensors. The
real runs (trained by `hetps run`, the dry step's one-line errors, `hetps
export` from a killed run's checkpoints): tests/cluster/test_cluster_own_model.py."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from own_model_pkg import PKG, TEST, TRAIN, on_path, user_pkg, write_config  # noqa: F401 (fixtures)

from hetps.runconfig.load import load_config


def test_workers_read_only_their_share(user_pkg, on_path, tmp_path):
    from hetps.training.data import BatchStream, load_datasets, partition

    cfg = load_config(write_config(tmp_path / "own.yaml", user_pkg), import_targets=True)
    data = load_datasets(cfg.data, cfg.seed)
    assert (len(data.train), len(data.test), data.in_shape, data.num_classes) == (
        TRAIN,
        TEST,
        (1, 28, 28),
        10,
    )
    reads = sys.modules[f"{PKG}.data"].READS
    reads.clear()
    share = partition(len(data.train), 1, 2, cfg.seed)
    stream = BatchStream(data.train, share, 32, seed=0)
    for _ in range(3):
        x, y = stream.next_batch()
    assert x.shape == (32, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    # nothing outside the share, nothing whole
    assert len(reads) == 96 and set(reads) <= set(share.tolist())


BROKEN_PY = """
import torch


class Items(torch.utils.data.Dataset):
    def __init__(self, items, **attrs):
        self.items = items
        vars(self).update(attrs)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def no_classes():
    return Items([(torch.zeros(3), 1)]), Items([(torch.zeros(3), 0)])


def uint8_images():
    return Items([(torch.zeros(1, 2, 2, dtype=torch.uint8), 1)], num_classes=2), Items([(torch.zeros(3), 0)])


def one_split():
    return Items([(torch.zeros(3), 1)], num_classes=2)


def one_class():
    return Items([(torch.zeros(3), 0)], num_classes=1), Items([(torch.zeros(3), 0)])


def classes_list():
    return Items([(torch.zeros(3), torch.tensor(1))], classes=["a", "b", "c"]), Items([(torch.zeros(3), 0)])
"""


def test_a_dataset_that_breaks_the_contract_says_how(tmp_path, monkeypatch):
    from hetps.training.user_data import DatasetContractError, load_factory_datasets

    (tmp_path / "tests_broken_data.py").write_text(BROKEN_PY)
    monkeypatch.syspath_prepend(str(tmp_path))
    for factory, words in (
        ("one_class", "num_classes must be an int >= 2"),
        ("one_split", "(train, test)"),
    ):
        with pytest.raises(DatasetContractError, match=re.escape(words)):
            load_factory_datasets(f"tests_broken_data:{factory}", {})
    # the contract leaves x and y to the task; no class count is the classification task's
    # problem (data.num_classes can give it): tests/unit/test_tasks.py
    assert load_factory_datasets("tests_broken_data:no_classes", {}).num_classes is None
    assert load_factory_datasets("tests_broken_data:uint8_images", {}).in_shape == (1, 2, 2)
    data = load_factory_datasets("tests_broken_data:classes_list", {})
    assert (data.num_classes, data.in_shape) == (3, (3,))
    assert data.train.batch(torch.tensor([0]))[1].tolist() == [1]


def test_export_joins_chunked_tensors_and_names_a_missing_one():
    from hetps.training.export import ExportError, assemble

    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))
    tensors = {k: v.clone() for k, v in source.state_dict().items()}
    weight = tensors.pop("0.weight").reshape(-1)
    tensors.update(
        {"0.weight#0": weight[:13], "0.weight#1": weight[13:21], "0.weight#2": weight[21:]}
    )
    target = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))
    assemble(target, tensors)
    for name, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name
    del tensors["1.running_var"]
    with pytest.raises(ExportError, match="1.running_var"):
        assemble(target, tensors)
