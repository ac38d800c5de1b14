"""Your own model and data: a user package made here, in a temporary
directory, with a lazily reading dataset factory (one file per digit of the
offline mnist-5k, read in __getitem__) and a model factory; trained by
`hetps run`, loaded back from model.safetensors in a fresh process; the dry
step's one-line errors; `hetps export` from a killed run's checkpoints."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cluster_util import background_run, kill_leftovers, log_tails, run_hetps, summary, wait_for
from hetps.runtime import checkpoint
from hetps.runconfig.schema import DataConfig, load_config

PKG = "hetps_user_demo"
TRAIN, TEST = 1200, 300   # digits of mnist-5k written to disk, one file each

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

MODEL_PY = '''
import torch
from torch import nn


def small_cnn(input_shape, num_classes, out=None, channels=None):
    c, h, w = input_shape
    return nn.Sequential(nn.Conv2d(channels or c, 8, 3, stride=2), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * ((h - 3) // 2 + 1) * ((w - 3) // 2 + 1), out or num_classes))
'''


@pytest.fixture(scope="module")
def user_pkg(tmp_path_factory) -> Path:
    """tmp/pkg/hetps_user_demo/{data,model}.py and tmp/digits/{train,test}/NNNNN.pt; returns tmp/pkg."""
    from hetps.worker.data import load_datasets

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
    path.write_text(textwrap.dedent(f"""\
        name: own
        model: {{name: "{PKG}.model:small_cnn"}}
        data:
          dataset: "{PKG}.data:make"
          kwargs: {{root: "{user_pkg.parent / 'digits'}"}}
          batch_size: 32
          eval_batch_size: {TEST}
        optimizer: {{name: sgd, lr: 0.1, momentum: 0.5}}
        algorithm: {{name: sync}}
        cluster: {{shards: 2, workers: 2, profile_steps: 2}}
        stop: {{target_accuracy: 0.85, max_seconds: 60}}
        eval: {{every_s: 0.5}}
        """) + "".join(f"{line}\n" for line in extra))
    return path


@pytest.fixture
def on_path(user_pkg, monkeypatch):
    monkeypatch.syspath_prepend(str(user_pkg))
    for name in [m for m in sys.modules if m.startswith(PKG)]:
        del sys.modules[name]
    return {"PYTHONPATH": str(user_pkg)}


# ------------------------------------------------------------ in one process

def test_workers_read_only_their_share(user_pkg, on_path, tmp_path):
    from hetps.worker.data import BatchStream, load_datasets, partition

    cfg = load_config(write_config(tmp_path / "own.yaml", user_pkg), import_targets=True)
    data = load_datasets(cfg.data, cfg.seed)
    assert (len(data.train), len(data.test), data.in_shape, data.num_classes) == (TRAIN, TEST, (1, 28, 28), 10)
    reads = sys.modules[f"{PKG}.data"].READS
    reads.clear()
    share = partition(len(data.train), 1, 2, cfg.seed)
    stream = BatchStream(data.train, share, 32, seed=0)
    for _ in range(3):
        x, y = stream.next_batch()
    assert x.shape == (32, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert len(reads) == 96 and set(reads) <= set(share.tolist())  # nothing outside the share, nothing whole


BROKEN_PY = '''
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


def classes_list():
    return Items([(torch.zeros(3), torch.tensor(1))], classes=["a", "b", "c"]), Items([(torch.zeros(3), 0)])
'''


def test_a_dataset_that_breaks_the_contract_says_how(tmp_path, monkeypatch):
    from hetps.worker.user_data import DatasetContractError, load_factory_datasets

    (tmp_path / "tests_broken_data.py").write_text(BROKEN_PY)
    monkeypatch.syspath_prepend(str(tmp_path))
    for factory, words in (("no_classes", "num_classes"), ("uint8_images", "float tensor, got torch.uint8"),
                           ("one_split", "(train, test)")):
        with pytest.raises(DatasetContractError, match=re.escape(words)):
            load_factory_datasets(f"tests_broken_data:{factory}", {})
    data = load_factory_datasets("tests_broken_data:classes_list", {})
    assert (data.num_classes, data.in_shape) == (3, (3,))
    assert data.train.batch(torch.tensor([0]))[1].tolist() == [1]


@pytest.mark.parametrize("override, words", [
    ("model.kwargs={out: 7}", ["outputs of shape (32, 7)", "must give (32, 10)", "num_classes"]),
    ("model.kwargs={channels: 3}", ["takes 3 input channels", "have 1", "input_shape"]),
])
def test_a_model_that_does_not_fit_fails_before_training_in_one_line(user_pkg, on_path, tmp_path, override, words):
    run_dir = tmp_path / "run"
    result = run_hetps(["run", str(write_config(tmp_path / "own.yaml", user_pkg)), override,
                        "--out", str(run_dir), "--quiet"], timeout_s=120, env=on_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetps: check failed:"), result.stderr
    for word in [f"{PKG}.model:small_cnn", f"{PKG}.data:make", "fix:", *words]:
        assert word in lines[0]
    assert not (run_dir / "plan.json").exists()  # stopped before any plan (the daemons start during the check)


def test_a_typo_in_a_factory_name_fails_before_any_process(user_pkg, on_path, tmp_path):
    run_dir = tmp_path / "run"
    result = run_hetps(["run", str(write_config(tmp_path / "own.yaml", user_pkg)), f"model.name={PKG}.modle:small_cnn",
                        f"data.dataset={PKG}.data:mkae", "--out", str(run_dir)], timeout_s=60, env=on_path)
    assert result.returncode == 2
    assert "model.name: cannot import" in result.stderr and f"data.dataset: module '{PKG}.data' has no callable 'mkae'" \
        in result.stderr
    assert not run_dir.exists()


# ------------------------------------------------------------ real runs

LOAD_AND_EVALUATE = '''
import json, sys, torch
from safetensors.torch import load_file
from {pkg}.data import make
from {pkg}.model import small_cnn

model = small_cnn(input_shape=(1, 28, 28), num_classes=10)
model.load_state_dict(load_file(sys.argv[1]))
model.eval()
_, test = make(sys.argv[2])
x = torch.stack([test[i][0] for i in range(len(test))])
y = torch.tensor([test[i][1] for i in range(len(test))])
with torch.no_grad():
    print(json.dumps({{"accuracy": (model(x).argmax(1) == y).float().mean().item()}}))
'''


def fresh_accuracy(model_file: Path, user_pkg: Path, env: dict) -> float:
    """Load `model_file` into a fresh nn.Module in a fresh process and measure it on the test split."""
    out = subprocess.run([sys.executable, "-c", LOAD_AND_EVALUATE.format(pkg=PKG), str(model_file),
                          str(user_pkg.parent / "digits")], env={**env, "PATH": ""}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["accuracy"]


@pytest.mark.cluster
def test_own_model_and_data_train_and_come_back(user_pkg, on_path, run_dir, tmp_path):
    result = run_hetps(["run", str(write_config(tmp_path / "own.yaml", user_pkg)), "--out", str(run_dir), "--quiet"],
                       timeout_s=180, env=on_path)
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    s = summary(run_dir)
    assert s["final_accuracy"] >= 0.8, s
    meta = json.loads((run_dir / "model.json").read_text())
    assert meta["model"]["name"] == f"{PKG}.model:small_cnn" and meta["dataset"]["name"] == f"{PKG}.data:make"
    assert meta["num_classes"] == 10 and meta["input_shape"] == [1, 28, 28] and meta["torch_version"]
    assert meta["final_accuracy"] == pytest.approx(s["final_accuracy"], abs=1e-9)
    assert fresh_accuracy(run_dir / "model.safetensors", user_pkg, on_path) == pytest.approx(
        s["final_accuracy"], abs=0.005)
    # eval.keep_best: the parameters the best evaluation measured, as they were then
    best = json.loads((run_dir / "best.json").read_text())
    assert best["evaluation"] == "best" and best["final_accuracy"] == pytest.approx(s["best_accuracy"], abs=1e-9)
    assert fresh_accuracy(run_dir / "best.safetensors", user_pkg, on_path) == pytest.approx(
        s["best_accuracy"], abs=0.005)


@pytest.mark.cluster
def test_export_builds_the_model_from_a_killed_runs_checkpoints(user_pkg, on_path, run_dir, tmp_path):
    config = write_config(tmp_path / "own.yaml", user_pkg, "checkpoint: {every_updates: 10, every_s: 0}")
    with background_run([str(config), "stop.target_accuracy=null", "--out", str(run_dir), "--quiet"],
                        env=on_path) as proc:
        folders = lambda: [d for d in run_dir.glob("checkpoints/*/ps*") if checkpoint.checkpoints(d)]  # noqa: E731
        wait_for(lambda: len(folders()) == 2 and all(checkpoint.checkpoints(d)[-1][0] >= 40 for d in folders()),
                 120, "checkpoints at version 40 of both shards")
        assert kill_leftovers(str(run_dir))  # kill -9 the launcher and every process of the run
        proc.wait(timeout=10)
    assert not (run_dir / "model.safetensors").exists()
    out = tmp_path / "exported" / "digits.safetensors"
    result = run_hetps(["export", str(run_dir), "--out", str(out)], timeout_s=120, env=on_path)
    assert result.returncode == 0, result.stderr
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["source"] == "checkpoints" and min(meta["checkpoint_versions"].values()) >= 30
    assert meta["final_accuracy"] > 0.5  # trained, not chance (0.1)
    assert fresh_accuracy(out, user_pkg, on_path) == pytest.approx(meta["final_accuracy"], abs=0.005)


@pytest.mark.cluster
def test_without_an_evaluator_the_model_comes_from_the_last_checkpoints(user_pkg, on_path, run_dir, tmp_path):
    result = run_hetps(["run", str(write_config(tmp_path / "own.yaml", user_pkg)), "eval.enabled=false",
                        "stop.target_accuracy=null", "stop.max_steps=150", "--out", str(run_dir), "--quiet"],
                       timeout_s=180, env=on_path)
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    meta = json.loads((run_dir / "model.json").read_text())
    assert meta["source"] == "checkpoints" and meta["final_accuracy"] > 0.5
    assert fresh_accuracy(run_dir / "model.safetensors", user_pkg, on_path) == pytest.approx(
        meta["final_accuracy"], abs=0.005)


def test_export_joins_chunked_tensors_and_names_a_missing_one():
    from hetps.worker.export import ExportError, assemble

    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))
    tensors = {k: v.clone() for k, v in source.state_dict().items()}
    weight = tensors.pop("0.weight").reshape(-1)
    tensors.update({"0.weight#0": weight[:13], "0.weight#1": weight[13:21], "0.weight#2": weight[21:]})
    target = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))
    assemble(target, tensors)
    for name, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name
    del tensors["1.running_var"]
    with pytest.raises(ExportError, match="1.running_var"):
        assemble(target, tensors)
