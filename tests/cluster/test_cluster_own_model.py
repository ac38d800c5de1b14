"""Your own model and data in real runs: a user package made in a temporary
directory (support/own_model_pkg.py) trained by `hetps run`, loaded back from
model.safetensors in a fresh process; the dry step's one-line errors (the `hetps
run` process, and the daemons it starts during the check); `hetps export` from
a killed run's checkpoints. In one process: tests/unit/test_own_model.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_util import background_run, kill_leftovers, log_tails, run_hetps, summary, wait_for
from inprocess_cli import run_entry_point
from own_model_pkg import PKG, on_path, user_pkg, write_config  # noqa: F401 (fixtures)

from hetps.frontend.cli import main as hetps_main
from hetps.runtime import checkpoint
from hetps.training.export import main as export_main


@pytest.mark.parametrize(
    "override, words",
    [
        (
            "model.kwargs={out: 7}",
            ["outputs of shape (32, 7)", "must give (32, 10)", "num_classes"],
        ),
        ("model.kwargs={channels: 3}", ["takes 3 input channels", "have 1", "input_shape"]),
    ],
)
def test_a_model_that_does_not_fit_fails_before_training_in_one_line(
    user_pkg, on_path, tmp_path, override, words
):
    run_dir = tmp_path / "run"
    result = run_hetps(
        [
            "run",
            str(write_config(tmp_path / "own.yaml", user_pkg)),
            override,
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=120,
        env=on_path,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetps: check failed:"), result.stderr
    for word in [f"{PKG}.model:small_cnn", f"{PKG}.data:make", "fix:", *words]:
        assert word in lines[0]
    # stopped before any plan (the daemons start during the check)
    assert not (run_dir / "plan.json").exists()


def test_a_typo_in_a_factory_name_fails_before_any_process(user_pkg, on_path, tmp_path):
    """`hetps run` in this process (no process is started: what is checked is its output)."""
    run_dir = tmp_path / "run"
    args = [
        "run",
        str(write_config(tmp_path / "own.yaml", user_pkg)),
        f"model.name={PKG}.modle:small_cnn",
        f"data.dataset={PKG}.data:mkae",
        "--out",
        str(run_dir),
    ]
    result = run_entry_point(hetps_main, args, tmp_path, [str(user_pkg), *sys.path])
    assert result.returncode == 2
    assert (
        "model.name: cannot import" in result.stderr
        and f"data.dataset: module '{PKG}.data' has no callable 'mkae'" in result.stderr
    )
    assert not run_dir.exists()


LOAD_AND_EVALUATE = """
import json, sys, torch
from safetensors.torch import load_file
from {pkg}.data import make
from {pkg}.model import small_cnn

_, test = make(sys.argv[1])
x = torch.stack([test[i][0] for i in range(len(test))])
y = torch.tensor([test[i][1] for i in range(len(test))])
accuracies = []
for path in sys.argv[2:]:
    model = small_cnn(input_shape=(1, 28, 28), num_classes=10)
    model.load_state_dict(load_file(path))
    model.eval()
    with torch.no_grad():
        accuracies.append((model(x).argmax(1) == y).float().mean().item())
print(json.dumps({{"accuracies": accuracies}}))
"""


def fresh_accuracy(model_file: Path, user_pkg: Path, env: dict) -> float:
    """Load `model_file` into a fresh nn.Module in a fresh process and measure it on the test split."""
    (accuracy,) = fresh_accuracies([model_file], user_pkg, env)
    return accuracy


def fresh_accuracies(model_files: list[Path], user_pkg: Path, env: dict) -> list[float]:
    """Load each of `model_files` into a fresh nn.Module of its own, in one fresh process (one
    torch import), and measure it on the test split."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            LOAD_AND_EVALUATE.format(pkg=PKG),
            str(user_pkg.parent / "digits"),
            *map(str, model_files),
        ],
        env={**env, "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["accuracies"]


def test_own_model_and_data_train_and_come_back(user_pkg, on_path, run_dir, tmp_path):
    result = run_hetps(
        [
            "run",
            str(write_config(tmp_path / "own.yaml", user_pkg)),
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=180,
        env=on_path,
    )
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    s = summary(run_dir)
    assert s["final_accuracy"] >= 0.8, s
    meta = json.loads((run_dir / "model.json").read_text())
    assert (
        meta["model"]["name"] == f"{PKG}.model:small_cnn"
        and meta["dataset"]["name"] == f"{PKG}.data:make"
    )
    assert (
        meta["num_classes"] == 10 and meta["input_shape"] == [1, 28, 28] and meta["torch_version"]
    )
    assert meta["final_accuracy"] == pytest.approx(s["final_accuracy"], abs=1e-9)
    # eval.keep_best: the parameters the best evaluation measured, as they were then
    best = json.loads((run_dir / "best.json").read_text())
    assert best["evaluation"] == "best" and best["final_accuracy"] == pytest.approx(
        s["best_accuracy"], abs=1e-9
    )
    final_file, best_file = fresh_accuracies(
        [run_dir / "model.safetensors", run_dir / "best.safetensors"], user_pkg, on_path
    )
    assert final_file == pytest.approx(s["final_accuracy"], abs=0.005)
    assert best_file == pytest.approx(s["best_accuracy"], abs=0.005)


def test_export_builds_the_model_from_a_killed_runs_checkpoints(
    user_pkg, on_path, run_dir, tmp_path, capsys
):
    config = write_config(
        tmp_path / "own.yaml", user_pkg, "checkpoint: {every_updates: 10, every_s: 0}"
    )
    with background_run(
        [str(config), "stop.target_accuracy=null", "--out", str(run_dir), "--quiet"], env=on_path
    ) as proc:

        def folders():
            return [d for d in run_dir.glob("checkpoints/*/ps*") if checkpoint.checkpoints(d)]

        wait_for(
            lambda: (
                len(folders()) == 2
                and all(checkpoint.checkpoints(d)[-1][0] >= 40 for d in folders())
            ),
            120,
            "checkpoints at version 40 of both shards",
        )
        assert kill_leftovers(str(run_dir))  # kill -9 the launcher and every process of the run
        proc.wait(timeout=10)
    assert not (run_dir / "model.safetensors").exists()
    out = tmp_path / "exported" / "digits.safetensors"
    # the entry point `hetps export` execs (python -m hetps.training.export), in this process,
    # with the user's package on the import path (on_path): one torch import fewer; the console
    # command itself: test_cluster_sparse.py. The exported file is measured in a fresh process.
    code = export_main([str(run_dir), "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["source"] == "checkpoints" and min(meta["checkpoint_versions"].values()) >= 30
    assert meta["final_accuracy"] > 0.5  # trained, not chance (0.1)
    assert fresh_accuracy(out, user_pkg, on_path) == pytest.approx(
        meta["final_accuracy"], abs=0.005
    )


def test_without_an_evaluator_the_model_comes_from_the_last_checkpoints(
    user_pkg, on_path, run_dir, tmp_path
):
    result = run_hetps(
        [
            "run",
            str(write_config(tmp_path / "own.yaml", user_pkg)),
            "eval.enabled=false",
            "stop.target_accuracy=null",
            # this model and data reach ~97% in 24 steps (2 workers): 40 train it well past 0.5
            "stop.max_steps=40",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=180,
        env=on_path,
    )
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    meta = json.loads((run_dir / "model.json").read_text())
    assert meta["source"] == "checkpoints" and meta["final_accuracy"] > 0.5
    assert fresh_accuracy(run_dir / "model.safetensors", user_pkg, on_path) == pytest.approx(
        meta["final_accuracy"], abs=0.005
    )
