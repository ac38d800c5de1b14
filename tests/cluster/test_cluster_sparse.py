"""Sparse tables in real processes: the byte-level language model
(configs/charlm.yaml) with its token embedding served row by row
(`sparse.tables=[tokens]`), on 2 shards and 2 workers, under sync (rounds per
id) and async (per push). It must reach a perplexity below what the byte
distribution alone gives (about 25: only the token embedding carries the input),
the shards must have updated rows, and the run's model file must hold the whole
table and give back the final evaluation in the test process, which never held
the model (the run's daemons trained it)."""

from __future__ import annotations

import json

import pytest
import torch
from cluster_util import REPO, log_tails, run_hetps, summary

from hetps.training.export import main as export_main

# below the byte distribution's ~25 (from ~256 untrained): reached in about 6 s of training on
# 2 workers, where the shipped 12 takes about 20 s on 4; what is checked is the sparse path
TARGET = 20.0


def measured_again(run_dir):
    """The final model (model.safetensors) loaded into the factory's model and measured."""
    import hetps
    from hetps.runconfig.load import load_config
    from hetps.training.data import load_datasets
    from hetps.training.measure import measure
    from hetps.training.task import load_task

    cfg = load_config(run_dir / "config.yaml", import_targets=True)
    model = hetps.load_model(run_dir, best=False)  # the final evaluation's
    data = load_datasets(cfg.data, cfg.seed)
    return measure(load_task(cfg, data.num_classes), model, data.test, cfg, "cpu")


@pytest.mark.parametrize("algorithm", ["sync", "async"])
def test_a_sparse_embedding_trains_to_the_target(algorithm, run_dir, tmp_path):
    done = run_hetps(
        [
            "run",
            str(REPO / "configs" / "charlm.yaml"),
            f"algorithm.name={algorithm}",
            "sparse.tables=[tokens]",
            "sparse.optimizer.name=adam",
            "sparse.optimizer.lr=0.003",
            "cluster.shards=2",
            "cluster.workers=2",  # two processes on two cores; the shipped 4 oversubscribe them
            f"stop.target={{metric: perplexity, value: {TARGET}}}",
            "stop.max_seconds=240",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=400,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr + log_tails(run_dir)
    s = summary(run_dir)
    assert s["status"] == "completed" and s["best"] <= TARGET, s
    plan = json.loads((run_dir / "plan.json").read_text())
    assert [t[0] for t in plan["tables"]] == ["tokens.weight"], plan["tables"]
    assert "tokens.weight" not in plan["placement"]  # served row by row, not placed
    shards = {n: st for n, st in s["per_node"].items() if n.startswith("ps")} or {
        n: st for n, st in s.get("shard_stats", {}).items()
    }
    updated = [st.get("sparse_rows_updated", 0) for st in shards.values()]
    assert len(updated) == 2 and all(u > 0 for u in updated), shards
    # (an untrained byte model is near perplexity 256: reaching TARGET is the learning)
    # the model file holds the whole table: loaded into the factory's model in this process
    # (which never held it), it gives the final evaluation again
    again = measured_again(run_dir)["perplexity"]
    assert again == pytest.approx(s["final_metrics"]["perplexity"], rel=1e-5)
    if algorithm == "sync":
        # `hetps export` joins the shards' checkpointed slices (written when they stopped,
        # after the last update) into the same whole table; its entry point in this process
        # (`hetps export` execs `python -m hetps.training.export`)
        exported = tmp_path / "exported.safetensors"
        assert export_main([str(run_dir), "--out", str(exported)]) == 0
        from safetensors.torch import load_file

        table = load_file(str(exported))["tokens.weight"]
        assert table.shape == (256, 64)
        assert torch.equal(table, load_file(str(run_dir / "model.safetensors"))["tokens.weight"])
