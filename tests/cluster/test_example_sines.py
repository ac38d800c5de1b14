"""The custom-task example (hetps.examples.sines, configs/sines.yaml: a 1-D CNN on noisy sine
waves, a macro-F1 Task whose `eval_sums` returns a confusion matrix, a schedule factory of its
own) trains to its macro-F1 target through `hetps run` and through `hetps.run`, as
docs/own-model.md walks through it: the run directory holds the files the walk names, the
best model loads back and scores what the run said, every evaluation row carries the
shards' lr under the example's schedule, and `hetps.run`'s on_step and on_end hooks are
called as documented."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re

import pytest
from cluster_util import REPO, log_tails, records, run_hetps, summary

import hetps
from hetps.examples import sines

CONFIG = REPO / "configs" / "sines.yaml"
WALK = (REPO / "docs" / "own-model.md").read_text().split("## A task of your own, end to end")[1]
WALK = WALK.split("\n## ", 1)[0]
TARGET = 0.9  # configs/sines.yaml stop.target
# a generous bound: the target comes after a few seconds of training on a loaded 2-core machine
BOUND = "stop.max_seconds=240"


def scheduled_lr(version: int) -> float:
    """configs/sines.yaml's lr after `version` shard updates (sgd 0.05, warmup_cosine)."""
    import torch

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05)
    factor = sines.warmup_cosine(optimizer, total_steps=1000, warmup_steps=20).lr_lambdas[0]
    return 0.05 * factor(version)


def measured(run_dir, model) -> dict:
    """The example task's metrics of `model` on the test split, in this process."""
    from hetps.runconfig.load import load_config
    from hetps.training.data import load_datasets
    from hetps.training.measure import measure
    from hetps.training.task import load_task

    cfg = load_config(run_dir / "config.yaml", import_targets=True)
    data = load_datasets(cfg.data, cfg.seed)
    return measure(load_task(cfg, data.num_classes), model, data.test, cfg, "cpu")


def assert_rows_carry_the_shards_lr(rows: list[dict]) -> None:
    assert rows and all(len(r["versions"]) == 1 for r in rows), rows
    for r in rows:
        assert r["lr"] == pytest.approx(scheduled_lr(r["versions"][0]), rel=1e-9), r


def test_the_example_reaches_its_macro_f1_target_through_hetps_run(run_dir, tmp_path):
    done = run_hetps(["run", str(CONFIG), BOUND, "--out", str(run_dir), "--quiet"], 400, tmp_path)
    assert done.returncode == 0, done.stderr + log_tails(run_dir)
    s = summary(run_dir)
    assert s["status"] == "completed", s
    assert s["metric"] == {"name": "macro_f1", "higher_is_better": True}, s
    assert s["stop_reason"].startswith("target macro_f1"), s
    assert s["time_to_target_s"] is not None and s["best"] >= TARGET, s
    # every file and folder docs/own-model.md's walk says the run directory holds
    held = WALK.split("**What the run directory holds**")[1].split("**Loading the model.**")[0]
    named = re.findall(r"`([\w.-]+(?:\.\w+|/))`", held)
    assert {"config.yaml", "best.safetensors", "macro_f1_vs_time.png", "logs/"} <= set(named)
    for name in named:
        path = run_dir / name if not name.endswith(".log") else run_dir / "logs" / name
        assert path.is_dir() if name.endswith("/") else path.is_file(), name
    evals = records(run_dir, "eval")
    assert all(r["watch"] == "macro_f1" for r in evals)
    assert_rows_carry_the_shards_lr(evals)
    # the untrained model (the first evaluation, at version 0) is far from it
    assert evals[0]["versions"] != [0] or evals[0]["macro_f1"] < 0.5, evals[0]
    # the best model loads back and scores the run's best, its macro-F1 from the confusion matrix
    best = json.loads((run_dir / "best.json").read_text())
    again = measured(run_dir, hetps.load_model(run_dir, best=True))
    assert again["macro_f1"] == pytest.approx(s["best"], rel=1e-6), (again, s["best"])
    assert again["macro_f1"] == pytest.approx(best["metrics"]["macro_f1"], rel=1e-6)
    # the walk's loading snippet, as written but for the run directory, prints the best's metrics;
    # run as a script's own module in this process, which never held the model
    (snippet,) = re.findall(r"\*\*Loading the model\.\*\*.*?```python\n(.*?)```", WALK, re.S)
    snippet = snippet.replace('"runs/sines"', repr(str(run_dir)))
    printed_out = io.StringIO()
    with contextlib.chdir(tmp_path), contextlib.redirect_stdout(printed_out):
        exec(compile(snippet, "docs/own-model.md", "exec"), {"__name__": "__main__"})
    printed = ast.literal_eval(printed_out.getvalue().strip())  # a dict of floats
    assert printed["macro_f1"] == pytest.approx(s["best"], rel=1e-6), (printed, s["best"])
    # the final model is the one the final evaluation measured
    final = measured(run_dir, hetps.load_model(run_dir, best=False))
    assert final["macro_f1"] == pytest.approx(s["final_metrics"]["macro_f1"], rel=1e-6)


def test_the_example_reaches_its_target_through_hetps_run_with_every_hook(run_dir):
    seen, steps, ended = [], [], []
    result = hetps.run(
        hetps.config(CONFIG, BOUND),
        out=run_dir,
        on_eval=seen.append,
        on_step=steps.append,
        step_every=10,
        on_end=ended.append,
    )
    assert result.status == "completed" and result.metric == "macro_f1", result
    assert result.stop_reason.startswith("target macro_f1"), result
    assert result.best >= TARGET and result.time_to_target_s is not None, result
    assert set(result.metrics) == {"macro_f1", "accuracy", "loss"}, result.metrics
    assert ended == [result]
    # on_eval: every evaluation row, each with the shards' lr at the versions it measured
    assert seen == result.rows and seen[-1]["final"] is True
    assert_rows_carry_the_shards_lr(seen)
    # on_step: each worker's steps 10, 20, ... as metrics.jsonl recorded them, in order
    assert steps and all(r["kind"] == "step" and r["step"] % 10 == 0 for r in steps), steps[:5]
    recorded = [r for r in records(run_dir, "step") if r["step"] % 10 == 0]
    assert steps == recorded
    assert {r["worker"] for r in steps} == {0, 1}
    for worker in (0, 1):
        mine = [r["step"] for r in steps if r["worker"] == worker]
        assert mine == sorted(mine) and mine[0] == 10, mine
