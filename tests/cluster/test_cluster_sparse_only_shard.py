"""A shard that holds only sparse rows, in real processes: a recommender whose dense part is
one scalar bias (its three embedding tables served row by row) on two shards, so the
placement gives ps1 no dense tensor. The run must train (steps > 0), evaluate and
complete, and both shards must have updated rows (it used to hang at step 0: every
worker's and the evaluator's PULL to ps1 was parked for good)."""

from __future__ import annotations

import json
import textwrap

from cluster_util import REPO, log_tails, run_hetps, summary

PKG = "hetps_sparse_bias"
VOCAB = [2000, 1000, 500]

MODEL = '''
import torch
from torch import nn


class BiasedTables(nn.Module):
    """A logit per field from its table, plus one scalar bias: (B, 1) for ids (B, fields)."""

    def __init__(self, vocab):
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(int(v), 1) for v in vocab)
        self.bias = nn.Parameter(torch.zeros(()))

    def forward(self, ids):
        logits = sum(table(ids[:, f]) for f, table in enumerate(self.tables))
        return logits + self.bias


def biased_tables(vocab):
    return BiasedTables(vocab)
'''


def test_a_shard_with_only_sparse_rows_trains(run_dir, tmp_path):
    pkg = tmp_path / "pkg" / PKG
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(textwrap.dedent(MODEL))
    done = run_hetps(
        [
            "run",
            str(REPO / "configs" / "ctr.yaml"),
            f"model.name={PKG}.model:biased_tables",
            f"model.kwargs={{vocab: {VOCAB}}}",
            f"data.kwargs={{train_size: 4000, test_size: 1000, vocab: {VOCAB}}}",
            "sparse.min_rows=100",
            "algorithm.name=sync",
            "cluster.shards=2",
            "cluster.request_timeout_s=30",
            "stop.max_steps=40",
            "stop.max_seconds=120",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=300,
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path / "pkg")},
    )
    assert done.returncode == 0, done.stderr + log_tails(run_dir)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["placement"] == {"bias": 0}, plan["placement"]  # ps of index 1: no dense tensor
    assert len(plan["tables"]) == len(VOCAB)
    s = summary(run_dir)
    assert s["status"] == "completed" and s["global_steps"] > 0, s
    assert "auc" in s["final_metrics"], s["final_metrics"]
    shards = {n: st for n, st in s["per_node"].items() if n.startswith("ps")} or s.get(
        "shard_stats", {}
    )
    updated = [st.get("sparse_rows_updated", 0) for st in shards.values()]
    assert len(updated) == 2 and all(u > 0 for u in updated), shards
