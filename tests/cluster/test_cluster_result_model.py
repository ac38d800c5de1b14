"""The run's model file never lies: a shard killed at several moments of a
run's end (before its death is declared, after, and as the stop begins),
and model.safetensors holds a trained model whose shard versions model.json
names, measured as model.json says; when it is older than the last
evaluation summary.json reports, summary.json and the closing lines say so
with both versions. Kills are triggered by step counts (frontend/faults.py)."""

from __future__ import annotations

import json

import pytest
import torch
from cluster_util import REPO, log_tails, run_hetps, summary

import hetps
from hetps.runconfig.load import load_config
from hetps.training.data import load_datasets
from hetps.training.measure import measure
from hetps.training.step import task_for

KILL_STEP = 60

MOMENTS = {
    # ps0 dies; the time limit comes before its silence is declared (dead_after_s)
    "before_declared": ["cluster.dead_after_s=8", "stop.max_seconds=5"],
    # ps0 dies and is declared dead long before the time limit
    "after_declared": ["cluster.dead_after_s=1", "stop.max_seconds=5"],
    # ps0 dies at the step the run stops on: the stop and the kill meet
    "as_the_stop_begins": ["cluster.dead_after_s=8", f"stop.max_steps={KILL_STEP}"],
}


def measured(run_dir) -> dict:
    """model.safetensors loaded as a user would (hetps.load_model), measured on the test split."""
    cfg = load_config(run_dir / "config.yaml")
    data = load_datasets(cfg.data, cfg.seed)
    model = hetps.load_model(run_dir, best=False)  # model.safetensors
    return measure(task_for(cfg, data.num_classes), model, data.test, cfg, torch.device("cpu"))


@pytest.mark.parametrize("moment", sorted(MOMENTS))
def test_a_shard_killed_as_the_run_ends_never_leaves_an_untrained_or_unnamed_model(run_dir, moment):
    result = run_hetps(
        [
            "run",
            str(REPO / "configs" / "sync.yaml"),
            # two workers, not four: the kill, the stop and the model files are the shards' and
            # the evaluator's; no check counts the workers
            "cluster.workers=2",
            "stop.target_accuracy=null",
            "eval.every_s=0.5",
            "checkpoint.every_s=1",
            f"cluster.kill=[{{node: ps0, at_step: {KILL_STEP}}}]",
            *MOMENTS[moment],
            "--out",
            str(run_dir),
        ],
        timeout_s=180,
    )
    assert result.returncode == 0, result.stderr[-3000:] + log_tails(run_dir)
    faults = [json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()]
    assert [(f["action"], f["node"]) for f in faults] == [("kill", "ps0")], faults
    s = summary(run_dir)
    assert s["global_steps"] > 0
    model = s["model"]
    assert model["file"] == "model.safetensors", (model, result.stderr[-2000:])
    described = json.loads((run_dir / "model.json").read_text())
    # a trained model: no shard's part is its initial values
    assert min(model["versions"].values()) > 0, model
    assert model["versions"] == {
        f"ps{i}": v for i, v in enumerate(described.get("versions", []))
    } or model["versions"] == described.get("checkpoint_versions")
    # the file holds what model.json says it measured
    assert measured(run_dir)["accuracy"] == pytest.approx(
        described["metrics"]["accuracy"], abs=1e-6
    )
    # older than the last evaluation reported: said in summary.json and on the terminal
    reported = model["reported_versions"]
    older = any(model["versions"][k] < v for k, v in reported.items())
    assert model["older_than_reported"] is older
    assert ("older than the last evaluation reported" in result.stderr) is older
    if described["source"] == "evaluator" and described["evaluation"] == "last":
        assert "ps0" in described["final_error"]  # why the final evaluation was not made
