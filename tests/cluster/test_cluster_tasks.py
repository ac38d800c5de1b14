"""The task contract in real runs: a task whose loss is not a scalar, a loss
that is NaN at the first step, and a model whose parameters get no gradient
are each refused by `hetps run` in one line (exit 2) before any plan, naming
task, model, dataset and the fix. In one process: tests/unit/test_tasks.py."""

from __future__ import annotations

import os

import pytest
from cluster_util import run_hetps
from own_model_pkg import PKG, on_path, user_pkg, write_config  # noqa: F401 (fixtures)

BROKEN_TASKS = """
import torch
import torch.nn.functional as F
from torch import nn


class PerExample:
    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="none")


def per_example():
    return PerExample()


class NanLoss:
    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y) * float("nan")


def nan_loss():
    return NanLoss()


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(28 * 28, 10)
        self.fc.requires_grad_(False)

    def forward(self, x):
        return self.fc(x.flatten(1))


def frozen():
    return Frozen()
"""


@pytest.mark.parametrize(
    "overrides, words",
    [
        # the config's target_accuracy is for its classification task: these report loss only
        (
            ["task=tests_broken_tasks:per_example", "stop.target_accuracy=null"],
            "the loss must be a scalar tensor",
        ),
        (
            ["task=tests_broken_tasks:nan_loss", "stop.target_accuracy=null"],
            "the loss is nan at the first step",
        ),
        (["model.name=tests_broken_tasks:frozen"], "no parameter of the model gets a gradient"),
    ],
)
def test_a_broken_task_is_refused_in_one_line_before_training(
    user_pkg, on_path, tmp_path, overrides, words
):
    (tmp_path / "tests_broken_tasks.py").write_text(BROKEN_TASKS)
    run_dir = tmp_path / "run"
    result = run_hetps(
        [
            "run",
            str(write_config(tmp_path / "own.yaml", user_pkg)),
            *overrides,
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=120,
        env={"PYTHONPATH": os.pathsep.join([on_path["PYTHONPATH"], str(tmp_path)])},
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetps: check failed: task "), result.stderr
    for word in [f"dataset '{PKG}.data:make'", "model '", "fix:", words]:
        assert word in lines[0], lines[0]
    # stopped before any plan (the daemons start during the check)
    assert not (run_dir / "plan.json").exists()
