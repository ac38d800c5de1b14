"""A user's own model and data package, made in a temporary directory: a lazily
reading dataset factory (one file per digit of the offline mnist-5k, read in
__getitem__) and a model factory, with the config naming them. Used by the tests
in one process (tests/unit/test_own_model.py) and by the real runs
(tests/cluster/test_cluster_own_model.py); import the fixtures `user_pkg` and
`on_path` into the test module."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hetps.runconfig.schema import DataConfig

PKG = "hetps_user_demo"
TRAIN, TEST = 1200, 300  # digits of mnist-5k written to disk, one file each

DATA_PY = '''
"""A dataset read lazily: one .pt file per example, read in __getitem__."""
from pathlib import Path

import torch
from torch.utils.data import Dataset

READS = []  # indices read in this process (the tests look)


class Digits(Dataset):
    num_classes = 10

    def __init__(self, folder):
        self.files = sorted(Path(folder).glob("*.pt"))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        READS.append(i)
        item = torch.load(self.files[i], weights_only=True)
        return item["x"], int(item["y"])


def make(root):
    return Digits(Path(root) / "train"), Digits(Path(root) / "test")
'''

MODEL_PY = """
import torch
from torch import nn


def small_cnn(input_shape, num_classes, out=None, channels=None):
    c, h, w = input_shape
    return nn.Sequential(nn.Conv2d(channels or c, 8, 3, stride=2), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * ((h - 3) // 2 + 1) * ((w - 3) // 2 + 1), out or num_classes))
"""


@pytest.fixture(scope="module")
def user_pkg(tmp_path_factory) -> Path:
    """tmp/pkg/hetps_user_demo/{data,model}.py and tmp/digits/{train,test}/NNNNN.pt; returns tmp/pkg."""
    from hetps.training.data import load_datasets

    root = tmp_path_factory.mktemp("own")
    pkg = root / "pkg" / PKG
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data.py").write_text(DATA_PY)
    (pkg / "model.py").write_text(MODEL_PY)
    digits = load_datasets(DataConfig(), seed=0)
    for split, source, n in (("train", digits.train, TRAIN), ("test", digits.test, TEST)):
        folder = root / "digits" / split
        folder.mkdir(parents=True)
        for i in range(n):
            torch.save({"x": source.x[i].clone(), "y": int(source.y[i])}, folder / f"{i:05d}.pt")
    return root / "pkg"


def write_config(path: Path, user_pkg: Path, *extra: str) -> Path:
    path.write_text(
        textwrap.dedent(f"""\
        name: own
        model: {{name: "{PKG}.model:small_cnn"}}
        data:
          dataset: "{PKG}.data:make"
          kwargs: {{root: "{user_pkg.parent / "digits"}"}}
          batch_size: 32
          eval_batch_size: {TEST}
        optimizer: {{name: sgd, lr: 0.1, momentum: 0.5}}
        algorithm: {{name: sync}}
        cluster: {{shards: 2, workers: 2, profile_steps: 2}}
        stop: {{target_accuracy: 0.85, max_seconds: 60}}
        eval: {{every_s: 0.5}}
        """)
        + "".join(f"{line}\n" for line in extra)
    )
    return path


@pytest.fixture
def on_path(user_pkg, monkeypatch):
    monkeypatch.syspath_prepend(str(user_pkg))
    for name in [m for m in sys.modules if m.startswith(PKG)]:
        del sys.modules[name]
    return {"PYTHONPATH": str(user_pkg)}
