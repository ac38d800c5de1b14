"""Sparse tables in `hetps simulate`: the click-through-rate model on a small
click log, its four tables served row by row (`sparse.min_rows=50`) against
the same run with every table pushed and pulled whole (`sparse.tables=[]`).
The simulated workers must move the rows a step touches and not the tables
(their byte counts say so), the shards must have updated rows, and both runs
must learn."""

from __future__ import annotations

import json
from pathlib import Path

from hetps.frontend.cli import main as hetps_main
from hetps.scheduler.runlog import read_metrics

REPO = Path(__file__).resolve().parents[2]
VOCAB = "[2000, 500, 100, 50]"
STEPS = 80


def simulate(out: Path, capsys, *overrides: str) -> dict:
    code = hetps_main(
        [
            "simulate",
            str(REPO / "configs" / "ctr.yaml"),
            f"data.kwargs={{train_size: 20000, test_size: 5000, vocab: {VOCAB}}}",
            f"model.kwargs={{vocab: {VOCAB}, dim: 8, mlp: [16]}}",
            "sparse.min_rows=50",
            "stop.target=null",
            f"stop.max_steps={STEPS}",
            "eval.every_s=0.2",
            "sim.sample_s=0.0002",  # the cadence of evaluations the assertions were sized for
            *overrides,
            "--out",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().err
    return json.loads((out / "summary.json").read_text())


def worker_bytes_per_step(s: dict) -> float:
    workers = [v for k, v in s["per_node"].items() if k.startswith("worker")]
    moved = sum(w["sent"] + w["received"] for w in workers)
    return moved / sum(w["steps"] for w in workers)


def test_simulated_workers_move_rows_not_tables(tmp_path, capsys):
    sparse = simulate(tmp_path / "sparse", capsys)
    dense = simulate(tmp_path / "dense", capsys, "sparse.tables=[]")
    table_bytes = (2000 + 500 + 100 + 50) * 8 * 4
    plan = json.loads((tmp_path / "sparse" / "plan.json").read_text())
    assert sorted(t[0] for t in plan["tables"]) == [f"tables.{i}.weight" for i in range(4)]
    # whole tables: every step pushes their gradient and pulls their values
    assert worker_bytes_per_step(dense) > 2 * table_bytes
    # rows: a batch of 256 names at most 256 ids per field, each an id and a row each way
    assert worker_bytes_per_step(sparse) < worker_bytes_per_step(dense) / 3, (
        worker_bytes_per_step(sparse),
        worker_bytes_per_step(dense),
    )
    shards = list(sparse["shard_stats"].values())
    assert len(shards) == 2 and all(s.get("sparse_rows_updated", 0) > 0 for s in shards), shards
    for out in (tmp_path / "sparse", tmp_path / "dense"):
        evals = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "eval"]
        assert evals[-1]["auc"] > evals[0]["auc"] + 0.05, (out.name, evals[0], evals[-1])
