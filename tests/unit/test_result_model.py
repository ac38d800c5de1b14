"""What the run's model file holds against what the run reported
(frontend/result_model.py): the shard versions of model.json against the last
evaluation row of metrics.jsonl that names its versions, in summary.json's
`model` section and in the line the user sees."""

from __future__ import annotations

import json

from hetps.frontend import result_model
from hetps.scheduler.nodes import read_eval
from hetps.scheduler.runlog import SummaryFile


def write_run(tmp_path, model: dict | None, evals: list[dict]):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    SummaryFile(run_dir).write({"status": "completed", "global_steps": 100})
    rows = [{"kind": "eval", "t": i, "watch": "auc", **e} for i, e in enumerate(evals)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if model is not None:
        (run_dir / "model.safetensors").write_bytes(b"")
        (run_dir / "model.json").write_text(json.dumps({"watch": "auc", **model}))
    return run_dir


def test_a_model_from_older_checkpoints_is_said_with_both_versions(tmp_path):
    run_dir = write_run(
        tmp_path,
        {
            "source": "checkpoints",
            "checkpoint_versions": {"ps0": 0, "ps1": 231},
            "metrics": {"auc": 0.6239},
        },
        [{"auc": 0.8, "versions": [90, 91]}, {"auc": 0.8557, "versions": [137, 137]}, {"auc": 0.9}],
    )
    line = result_model.check(run_dir)
    assert line is not None
    assert "ps0 v0, ps1 v231" in line and "ps0 v137, ps1 v137" in line and "auc 0.8557" in line
    model = SummaryFile(run_dir).read()["model"]
    assert model["versions"] == {"ps0": 0, "ps1": 231}
    assert model["reported_versions"] == {"ps0": 137, "ps1": 137}
    assert model["older_than_reported"] is True and model["source"] == "checkpoints"


def test_the_last_evaluations_model_is_not_older(tmp_path):
    run_dir = write_run(
        tmp_path,
        {"source": "evaluator", "evaluation": "last", "versions": [48, 48], "metrics": {}},
        [{"auc": 0.7, "versions": [0, 0]}, {"auc": 0.74, "versions": [48, 48]}],
    )
    assert result_model.check(run_dir) is None
    model = SummaryFile(run_dir).read()["model"]
    assert model["older_than_reported"] is False and model["versions"] == {"ps0": 48, "ps1": 48}


def test_a_missing_model_file_is_said(tmp_path):
    run_dir = write_run(tmp_path, None, [{"auc": 0.74, "versions": [48, 48]}])
    assert "was not written" in result_model.check(run_dir)
    assert SummaryFile(run_dir).read()["model"]["file"] is None


def test_an_evaluation_report_carries_its_shard_versions():
    assert read_eval({"metrics": {"auc": 0.5}, "versions": [3, 4]}).versions == (3, 4)
    # plain data from a peer: what is not a list of ints is left out
    for bad in ("3,4", [3, "4"], [True, 1], None):
        assert read_eval({"metrics": {"auc": 0.5}, "versions": bad}).versions is None
