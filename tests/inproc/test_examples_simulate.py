"""`hetps simulate` runs the shipped language model (configs/charlm.yaml: a transformer over
the Python documentation's bytes, task language_model) on its virtual clock: real gradients,
evaluations measured in perplexity."""

from __future__ import annotations

from pathlib import Path

from hetps.frontend.cli import main as hetps_main
from hetps.scheduler.runlog import read_metrics

REPO = Path(__file__).resolve().parents[2]


def test_hetps_simulate_trains_the_language_model(tmp_path, capsys):
    out = tmp_path / "sim"
    code = hetps_main(
        [
            "simulate",
            str(REPO / "configs" / "charlm.yaml"),
            "stop.max_steps=60",
            "eval.every_s=0.05",
            "sim.sample_s=0.0002",  # evaluations every 0.05 virtual s at this cost (not measured)
            "--out",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().err
    evals = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "eval"]
    assert len(evals) >= 2 and all(r["watch"] == "perplexity" for r in evals), evals
    assert not any(r["higher_is_better"] for r in evals)
    # 256 byte values: an untrained model is near perplexity 256; 60 steps take it far below
    assert evals[-1]["perplexity"] < 60, evals[-1]
    assert evals[0]["perplexity"] > 1.5 * evals[-1]["perplexity"], evals
    assert 0 < evals[-1]["token_accuracy"] <= 1


def test_hetps_simulate_trains_the_click_through_rate_model_to_its_target(tmp_path, capsys):
    """configs/ctr.yaml (task binary, a DLRM-style model, async on 2 shards and 2 workers) on
    a small click log: the run stops at its AUC target, near the planted model's AUC."""
    from hetps.examples.ctr import planted_metrics

    vocab = "[2000, 500, 100, 50]"
    small = {"train_size": 20000, "test_size": 5000, "vocab": [2000, 500, 100, 50]}
    best = planted_metrics(**small)["auc"]  # 0.821: the best any model can score
    out = tmp_path / "sim"
    code = hetps_main(
        [
            "simulate",
            str(REPO / "configs" / "ctr.yaml"),
            f"data.kwargs={{train_size: 20000, test_size: 5000, vocab: {vocab}}}",
            f"model.kwargs={{vocab: {vocab}, dim: 8, mlp: [16]}}",
            "stop.target={metric: auc, value: 0.80}",  # about step 170 of 600
            "stop.max_steps=600",
            "eval.every_s=0.5",
            "sim.sample_s=0.0002",  # evaluations every 0.5 virtual s at this cost (not measured)
            "--out",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().err
    evals = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "eval"]
    assert all(r["watch"] == "auc" and r["higher_is_better"] for r in evals), evals[-1]
    assert evals[0]["auc"] < 0.7, evals[0]  # an untrained model is near chance
    assert evals[-1]["auc"] >= 0.80, evals[-1]  # stopped at the target, not the step limit
    assert evals[-1]["global_steps"] < 600, evals[-1]
    assert evals[-1]["auc"] <= best + 0.01, (evals[-1], best)
    assert 0 < evals[-1]["logloss"] < 0.6 and 0.5 < evals[-1]["accuracy"] <= 1
