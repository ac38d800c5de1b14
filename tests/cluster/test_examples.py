"""The two examples that ship with hetps train to their targets in real processes:
the byte-level transformer language model (configs/charlm.yaml) on 4 workers at slowdown
[1, 1, 3, 3] under sync and diloco (under grouping it is the README's Python quick start, which
test_python_api.py runs with the same checks), and the Auto MPG regression
(configs/regression.yaml). Both name their model and data by module path
(hetps.examples.*), as a user's own would be, and run from a directory outside the repository.

`hetps run` is called in the test process (support/inprocess_cli.py), from that directory with
the import path a fresh `hetps` there has: its daemons are real processes all the same, forked
from the suite's fork server; the command's own process, which would import torch again (~3 s of
CPU a run), is not what these tests check (the console script has tests of its own)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cluster_util import CHARLM_TARGET, REPO, log_tails, records, summary
from inprocess_cli import run_entry_point


def hetps_run(args: list[str], cwd: Path):
    """`hetps run ARGS` from `cwd` (in this process): the import path a fresh `hetps` there has,
    its folder first, nothing of the checkout's tests or root (the examples are imported from the
    installed package). The suite's per-test timeout bounds it, and the config's stop.max_seconds."""
    from hetps.frontend.cli import main

    def outside(p: str) -> bool:
        path = Path(p).absolute()
        return p not in ("", ".") and path != REPO and not path.is_relative_to(REPO / "tests")

    path = [str(cwd), *filter(outside, sys.path)]
    return run_entry_point(main, ["run", *args], cwd, path, drop_env=("PYTHONPATH",))


def measured_best(run_dir):
    """The best model (eval.keep_best) loaded back and measured on the test split, in the test
    process (which never held it: the run's daemons trained it)."""
    import hetps
    from hetps.runconfig.load import load_config
    from hetps.training.data import load_datasets
    from hetps.training.measure import measure
    from hetps.training.task import load_task

    cfg = load_config(run_dir / "config.yaml", import_targets=True)
    model = hetps.load_model(run_dir, best=True)
    data = load_datasets(cfg.data, cfg.seed)
    return measure(load_task(cfg, data.num_classes), model, data.test, cfg, "cpu")


@pytest.mark.parametrize("algorithm", ["sync", "diloco"])
def test_the_language_model_reaches_its_perplexity_target(algorithm, run_dir, tmp_path):
    done = hetps_run(
        [
            str(REPO / "configs" / "charlm.yaml"),
            f"algorithm.name={algorithm}",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        cwd=tmp_path,  # the examples are imported from the installed package, not the checkout
    )
    assert done.returncode == 0, done.stderr + log_tails(run_dir)
    s = summary(run_dir)
    assert s["status"] == "completed" and s["metric"]["name"] == "perplexity", s
    assert s["time_to_target_s"] is not None and s["best"] <= CHARLM_TARGET, s
    assert s["stop_reason"].startswith("target perplexity"), s
    evals = records(run_dir, "eval")
    # it learned: from about 256 (one in 256 byte values) before training
    assert evals[0]["perplexity"] > 4 * CHARLM_TARGET, evals[0]
    assert evals[-1]["perplexity"] < 1.1 * CHARLM_TARGET, evals[-1]
    # every worker trained, the slow ones too
    steps = {r["worker"] for r in records(run_dir, "step")}
    assert steps == {0, 1, 2, 3}, steps
    if algorithm == "sync":
        # keep_best keeps the lowest-perplexity evaluation, and its file reproduces it
        lowest = min(e["perplexity"] for e in evals)
        assert s["best"] == pytest.approx(lowest), (s["best"], lowest)
        best = json.loads((run_dir / "best.json").read_text())
        assert best["metrics"]["perplexity"] == pytest.approx(lowest), best
        assert measured_best(run_dir)["perplexity"] == pytest.approx(lowest, rel=1e-5)


def test_the_regression_reaches_its_r2_target(run_dir, tmp_path):
    config = REPO / "configs" / "regression.yaml"
    done = hetps_run([str(config), "--out", str(run_dir), "--quiet"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr + log_tails(run_dir)
    s = summary(run_dir)
    assert s["status"] == "completed" and s["metric"] == {"name": "r2", "higher_is_better": True}
    assert s["time_to_target_s"] is not None and s["best"] >= 0.85, s
    # mse is in units of the standardized target's variance: about 1 - R²
    final = s["final_metrics"]
    assert final["r2"] >= 0.8 and final["mse"] < 0.3 and final["mae"] < 0.5, final
    # the model the run started from (the seeded factory's, which worker 0 offered the shards)
    # is far from it; the run's first evaluation may already see a few updates of this tiny model
    from hetps.runconfig.load import load_config
    from hetps.training.measure import measure
    from hetps.training.preflight import build_checked
    from hetps.training.task import load_task

    cfg = load_config(run_dir / "config.yaml", import_targets=True)
    data, untrained = build_checked(cfg)
    assert measure(load_task(cfg, data.num_classes), untrained, data.test, cfg, "cpu")["r2"] < 0.5


def test_a_builtin_model_trained_for_regression_loads_back_with_its_output_size(run_dir, tmp_path):
    """model.json records what the model was built with (one output per target value for a
    regression, not the dataset's absent class count), so `hetps.load_model` rebuilds it."""
    import hetps
    from hetps.runconfig.load import load_config
    from hetps.training.data import load_datasets
    from hetps.training.measure import measure
    from hetps.training.task import load_task

    config = REPO / "configs" / "regression.yaml"
    # one worker: what is checked is the saved model, not the cluster that trained it
    overrides = ["model.name=mlp", "model.kwargs={hidden: [32]}", "stop.max_steps=50"]
    overrides.append("cluster.workers=1")
    done = hetps_run([str(config), *overrides, "--out", str(run_dir), "--quiet"], cwd=REPO)
    assert done.returncode == 0, done.stderr + log_tails(run_dir)
    assert json.loads((run_dir / "model.json").read_text())["num_classes"] == 1
    model = hetps.load_model(run_dir, best=False)  # model.safetensors
    cfg = load_config(run_dir / "config.yaml", import_targets=True)
    data = load_datasets(cfg.data, cfg.seed)
    again = measure(load_task(cfg, data.num_classes), model, data.test, cfg, "cpu")
    assert again["r2"] == pytest.approx(summary(run_dir)["final_metrics"]["r2"], abs=1e-6)


def test_the_ctr_example_comes_within_001_auc_of_its_planted_model(run_dir, tmp_path):
    """configs/ctr.yaml as shipped (sparse tables on, async, 2 shards, 2 workers): the
    DLRM comes within 0.01 AUC of the planted model, the big tables' rows are updated on
    the shards, and a step moves far less than the tables (the dense path would pull and
    push every table whole each step)."""
    import yaml

    from hetps.examples import ctr

    planted = ctr.planted_metrics()["auc"]  # the best any model can score on the test split
    config = REPO / "configs" / "ctr.yaml"
    shipped = yaml.safe_load(config.read_text())["stop"]["target"]
    # the shipped target is planted - 0.01 rounded down to 3 decimals; the test asks for
    # planted - 0.01 itself, so that the run stops only where the claim holds
    assert planted - 0.011 < shipped["value"] <= planted - 0.01, (shipped, planted)
    target = planted - 0.01
    done = hetps_run(
        [
            str(config),
            f"stop.target={{metric: auc, value: {target!r}}}",
            "stop.max_seconds=240",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr + log_tails(run_dir)
    s = summary(run_dir)
    assert s["status"] == "completed" and s["metric"]["name"] == "auc", s
    assert s["stop_reason"].startswith("target auc"), s
    assert s["time_to_target_s"] is not None and s["best"] >= target, (s["best"], planted)
    # the model the run started from (the seeded factory's) is far from it; the run's first
    # evaluation may already see some updates on a loaded machine
    from hetps.runconfig.load import load_config
    from hetps.training.measure import measure
    from hetps.training.preflight import build_checked
    from hetps.training.task import load_task

    cfg = load_config(run_dir / "config.yaml", import_targets=True)
    data, untrained = build_checked(cfg)
    assert measure(load_task(cfg, data.num_classes), untrained, data.test, cfg, "cpu")["auc"] < 0.7
    # the tables of at least 1,000 rows were served sparse: both shards updated rows
    for shard in ("ps0", "ps1"):
        assert s["shard_stats"][shard]["sparse_rows_updated"] > 0, s["shard_stats"][shard]
    # bytes the workers moved per step, against the tables' size (float32)
    model = ctr.dlrm(**yaml.safe_load(config.read_text())["model"]["kwargs"])
    table_bytes = sum(t.weight.numel() * 4 for t in model.tables)  # about 12 MB
    workers = [v for k, v in s["per_node"].items() if k.startswith("worker")]
    assert len(workers) == 2 and all(w["steps"] > 0 for w in workers), s["per_node"]
    per_step = sum(w["sent"] + w["received"] for w in workers) / s["global_steps"]
    assert per_step < table_bytes / 20, (per_step, table_bytes)
