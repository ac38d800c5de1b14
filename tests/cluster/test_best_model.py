"""The model the user gets is the one the run reports (issue 42, item 4), and the progress
line names the watched metric from the start, the same in `hetps run` and `hetps.run`.

The runs train a task (written beside the config, as a user's module) that watches its test
loss as if higher were better: the best evaluation is the least trained one, so
best.safetensors and model.safetensors always hold different models, and a reader that
confuses them is caught. `hetps run`'s closing line and `hetps compare` name the file that
holds each value; `hetps.load_model(RUN_DIR)` loads the best model (best.safetensors), as
Lightning's `ckpt_path="best"` does, and `best=False` the final one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from cluster_util import REPO, kill_leftovers, log_tails, records, run_hetps, summary
from safetensors.torch import load_file

import hetps
from hetps.frontend.launcher import progress_for
from hetps.frontend.watch import number
from hetps.runconfig.load import load_config

TASK_MODULE = """
from hetps import Metric
from hetps.training.task import Classification


class Untrained(Classification):
    # the test loss, watched as if higher were better: the first evaluation is the best
    def __init__(self):
        super().__init__(num_classes=10)
        self.metrics = (Metric("untrained", True), Metric("accuracy", True), Metric("loss", False))

    def reduce(self, sums):
        out = super().reduce(sums)
        return {**out, "untrained": out["loss"]}


def untrained():
    return Untrained()
"""

# short runs: 2 workers, 1 shard, an evaluation every 0.5 s; the metric named outright (and
# no accuracy target), so the watched metric is `untrained` whatever the defaults
OVERRIDES = [
    "task.name=besttask:untrained",
    "eval.metric=untrained",
    "stop.target_accuracy=null",
    "stop.max_steps=80",
    "stop.max_seconds=120",
    "eval.every_s=0.5",
    "cluster.workers=2",
    "cluster.shards=1",
]
CONFIG = REPO / "configs" / "sync.yaml"

# `hetps run`'s progress line once training began (frontend/report.py Progress.line)
PROGRESS = re.compile(
    r"^\[\s*[\d.]+s/[\d.]+s\] steps\s+\d+/\d+  test (\S+) +(\S+)(?:  lr \S+)?  +[\d.]+ steps/s  plan \d+"
)


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user")
    (folder / "besttask.py").write_text(textwrap.dedent(TASK_MODULE))
    return folder


@pytest.fixture(scope="module")
def cli_run(user_dir):
    """One `hetps run` of the task, its output kept (the module's module is on PYTHONPATH)."""
    run_dir = user_dir / "run"
    try:
        done = run_hetps(
            ["run", str(CONFIG), *OVERRIDES, "--out", str(run_dir)],
            timeout_s=300,
            cwd=user_dir,
            env={"PYTHONPATH": str(user_dir)},
        )
    finally:
        leftovers = kill_leftovers(str(run_dir))
    assert not leftovers, f"processes left behind: {leftovers}"
    assert done.returncode == 0, done.stderr[-3000:] + log_tails(run_dir)
    return done, run_dir


def state_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_closing_line_names_the_file_of_each_value(cli_run):
    done, run_dir = cli_run
    s = summary(run_dir)
    assert s["metric"]["name"] == "untrained", s["metric"]
    final, best = s["final_metrics"]["untrained"], s["best"]
    assert best > final, (best, final)  # the least trained evaluation is the best
    assert (
        f"final untrained {number(final)} (model.safetensors), "
        f"best {number(best)} (best.safetensors: hetps.load_model's)"
    ) in done.stdout, done.stdout
    # each file holds the value the line gives it
    assert json.loads((run_dir / "model.json").read_text())["metrics"]["untrained"] == final
    assert json.loads((run_dir / "best.json").read_text())["metrics"]["untrained"] == best


def test_load_model_gives_the_best_model_and_best_false_the_final_one(cli_run, monkeypatch):
    _, run_dir = cli_run
    monkeypatch.syspath_prepend(str(run_dir.parent))  # besttask, as the run imported it
    best_file = load_file(str(run_dir / "best.safetensors"))
    final_file = load_file(str(run_dir / "model.safetensors"))
    assert not same(best_file, final_file)  # two models: a mix-up would show
    assert same(state_of(hetps.load_model(run_dir)), best_file)
    assert same(state_of(hetps.load_model(run_dir, best=True)), best_file)
    assert same(state_of(hetps.load_model(run_dir, best=False)), final_file)


def test_the_progress_line_names_the_watched_metric_before_the_first_evaluation(
    cli_run, tmp_path, monkeypatch
):
    done, run_dir = cli_run
    # the run's records up to its first evaluation: what the line had read by then
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    first_eval = next(i for i, line in enumerate(lines) if json.loads(line)["kind"] == "eval")
    (tmp_path / "metrics.jsonl").write_text("".join(lines[:first_eval]))
    monkeypatch.syspath_prepend(str(run_dir.parent))
    progress = progress_for(load_config(run_dir / "config.yaml", import_targets=True), tmp_path)
    progress.poll()
    shown = PROGRESS.match(progress.line())
    assert shown is not None and shown.groups() == ("untrained", "-"), progress.line()
    # and every training line `hetps run` printed names it too
    printed = [m for m in map(PROGRESS.match, done.stderr.splitlines()) if m]
    assert printed and {m[1] for m in printed} == {"untrained"}, done.stderr[-2000:]


def test_compare_shows_the_final_and_the_best_value_and_their_files(user_dir, tmp_path):
    out = tmp_path / "cmp"
    try:
        done = run_hetps(
            ["compare", str(CONFIG), "--algorithms", "sync", *OVERRIDES, "--out", str(out)],
            timeout_s=300,
            cwd=user_dir,
            env={"PYTHONPATH": str(user_dir)},
        )
    finally:
        leftovers = kill_leftovers(str(out))
    assert not leftovers, f"processes left behind: {leftovers}"
    assert done.returncode == 0, done.stderr[-3000:] + log_tails(out / "sync-0")
    s = summary(out / "sync-0")
    final, best = s["final_metrics"]["untrained"], s["best"]
    assert best > final
    [row] = json.loads((out / "compare.json").read_text())
    assert (row["final_metric"], row["best_metric"]) == (final, best)
    table = (out / "compare.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| algorithm"))
    cells = [c.strip() for c in header.split("|")]
    at = cells.index("final untrained (median, model.safetensors)")
    assert cells[at + 1] == "best untrained (median, best.safetensors)", header
    values = [c.strip() for c in table.splitlines()[4].split("|")]
    assert values[at : at + 2] == [number(final), number(best)], table
    assert "hetps.load_model(RUN_DIR) loads the best one" in table
    # each run's line says which file holds which value, as `hetps run`'s closing line
    assert (
        f"hetps compare: sync run 1: sync: completed, final untrained {number(final)} "
        f"(model.safetensors), best {number(best)} (best.safetensors: hetps.load_model's)"
    ) in done.stderr, done.stderr[-2000:]


SCRIPT = """
import sys
import hetps

hetps.run(hetps.config(sys.argv[1], *sys.argv[2:]), out="run", progress=True)
"""


@pytest.mark.own_fork_server  # the script forks its daemons as a user's would
def test_progress_true_prints_the_line_hetps_run_prints(tmp_path):
    (tmp_path / "besttask.py").write_text(textwrap.dedent(TASK_MODULE))
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if k != "HETPS_FORK_SERVER"}
    try:
        done = subprocess.run(
            [sys.executable, "train.py", str(CONFIG), *OVERRIDES],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        leftovers = kill_leftovers(str(tmp_path))
    assert not leftovers, f"processes left behind: {leftovers}"
    assert done.returncode == 0, done.stderr[-3000:] + log_tails(tmp_path / "run")
    # every line about the steps is hetps run's line, once per evaluation or less
    lines = [line for line in done.stderr.splitlines() if "steps" in line]
    shown = [PROGRESS.match(line) for line in lines]
    assert shown and all(shown), done.stderr[-3000:]
    assert {m[1] for m in shown if m} == {"untrained"}
    assert len(shown) <= len(records(tmp_path / "run", "eval"))
    # the last one shows the final evaluation's value
    final = summary(tmp_path / "run")["final_metrics"]["untrained"]
    assert shown[-1] is not None and shown[-1][2] == number(final), lines[-1]
