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
