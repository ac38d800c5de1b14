"""The Python API (`import hetps`) runs a real local cluster from a plain script with no
`if __name__ == "__main__":` guard (the daemons are forked without running the script
again), returns the result, calls back once per evaluation, ships a task object to the worker
processes, refuses one they cannot import, raises a failure naming its cause, and
`hetps.load_model` gives back the model its final evaluation measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from cluster_util import CHARLM_TARGET, REPO, kill_leftovers, records

pytestmark = pytest.mark.own_fork_server  # the script forks its daemons as a user's would

# beside the script: a task the worker processes import by reference (its class), its state
# (the tag) pickled by hetps.run
TASK_MODULE = """
from hetps import Metric
from hetps.training.task import Classification


class Tagged(Classification):
    def __init__(self, tag):
        super().__init__(num_classes=10)
        self.tag = tag
        self.metrics = (Metric("accuracy", True), Metric("loss", False), Metric(f"error_{tag}", False))

    def reduce(self, sums):
        out = super().reduce(sums)
        return {**out, f"error_{self.tag}": 1.0 - out["accuracy"]}


def bad_loss():
    return BadLoss(num_classes=10)


class BadLoss(Classification):
    def loss(self, model, batch):
        return model(batch[0]).sum(1)  # one value per sample: not a scalar
"""

SCRIPT = """
import json, sys
import hetps
from hetps.training.data import load_datasets, test_batches
from hetps.training.task import evaluate_task, Classification
from mytask import Tagged, bad_loss

out = {}
cfg = hetps.config(
    sys.argv[1],
    "cluster.workers=2",
    cluster__shards=1,
    stop={"max_steps": 150, "target_accuracy": None},
    eval__every_s=0.5,
)
seen = []
result = hetps.run(cfg, task=Tagged("xy"), out="run", on_eval=seen.append)
out["result"] = {k: str(v) if k.endswith(("_path", "run_dir")) else v
                 for k, v in vars(result).items() if k not in ("rows", "summary")}
out["seen"] = seen
out["rows"] = result.rows

model = hetps.load_model(result.run_dir, best=False)  # the final model (default: the best)
data = load_datasets(cfg.data, cfg.seed)
out["reloaded"] = evaluate_task(Classification(10), model, test_batches(data.test, 500), "cpu")


class InMain(Classification):
    pass


try:
    hetps.run(cfg, task=InMain(), out="refused")
except hetps.proto.errors.ConfigError as exc:
    out["refused"] = str(exc)

try:
    hetps.run(cfg, task=bad_loss, out="failed")
except hetps.RunFailed as exc:
    out["failed"] = str(exc)
json.dump(out, open("out.json", "w"))
"""


def run_script(tmp_path, args: list[str], cwd=None) -> tuple[subprocess.CompletedProcess, list]:
    """`python ARGS` as a user runs a script (its own fork server, not the suite's), in
    `cwd` (default tmp_path); then every process left under tmp_path killed and named."""
    env = {k: v for k, v in os.environ.items() if k != "HETPS_FORK_SERVER"}
    try:
        done = subprocess.run(
            [sys.executable, *args],
            cwd=cwd or tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
    finally:
        leftovers = kill_leftovers(str(tmp_path))
    return done, leftovers


def test_a_script_without_a_main_guard_runs_a_cluster_and_gets_its_result(tmp_path):
    (tmp_path / "mytask.py").write_text(textwrap.dedent(TASK_MODULE))
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    done, leftovers = run_script(tmp_path, [str(script), str(REPO / "configs" / "default.yaml")])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    # the script ran once: no daemon ran it again (multiprocessing's re-import of __main__)
    assert "bootstrapping phase" not in done.stderr and not leftovers, done.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    result, rows = out["result"], out["rows"]
    assert result["status"] == "completed" and result["exit_code"] == 0, result
    assert result["stop_reason"].startswith("step limit") and result["global_steps"] >= 150
    assert result["metric"] == "accuracy" and result["higher_is_better"] is True

    # once per evaluation, in order: what metrics.jsonl holds
    written = records(tmp_path / "run", "eval")
    assert out["seen"] == rows == written and len(written) >= 2
    assert written[-1]["final"] and result["metrics"]["accuracy"] == written[-1]["accuracy"]
    # the task object reached the evaluator: its own metric, named by its pickled state
    assert all(r["error_xy"] == pytest.approx(1 - r["accuracy"]) for r in written)
    assert result["metrics"]["accuracy"] > 0.3  # trained: chance is 0.1

    # the saved model, loaded in another process, measures what the final evaluation did
    assert out["reloaded"]["accuracy"] == pytest.approx(result["metrics"]["accuracy"], abs=1e-6)
    assert result["model_path"].endswith("run/model.safetensors")

    # a task class defined in __main__ is refused before anything starts, naming the fix
    assert "defined in __main__" in out["refused"] and "module of its own" in out["refused"]
    assert not (tmp_path / "refused").exists()
    # a failure is an exception naming the cause; the run's summary says failed
    assert "loss" in out["failed"] and "scalar" in out["failed"], out["failed"]
    assert json.loads((tmp_path / "failed" / "summary.json").read_text())["status"] == "failed"


def readme_python() -> str:
    """The README quick start's Python block that runs a cluster, as a user would paste it."""
    text = (REPO / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    return next(b for b in blocks if "hetps.run(" in b)


def test_the_readme_python_quick_start_runs_as_written(tmp_path):
    """Pasted into a script in the repository (its configs/ path), it trains the shipped
    language model to its target, prints the result and generates text with the model."""
    block = readme_python()
    assert len(block.strip().splitlines()) <= 10
    script = tmp_path / "quick.py"
    # the run directory goes to tmp_path (runs/ of the checkout is the user's)
    script.write_text(
        block.replace("hetps.run(cfg,", f"hetps.run(cfg, out={str(tmp_path / 'run')!r},")
    )
    done, leftovers = run_script(tmp_path, [str(script)], cwd=REPO)
    assert done.returncode == 0 and not leftovers, done.stdout[-3000:] + done.stderr[-5000:]
    lines = done.stdout.splitlines()
    status = next(line for line in lines if line.startswith(("completed", "failed", "interrupted")))
    assert status.startswith("completed"), done.stdout[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["best"] <= CHARLM_TARGET and summary["time_to_target_s"] is not None, summary
    # what test_examples.py checks of the example under sync and diloco: stopped on the target,
    # learned from about 256 (one in 256 byte values), every worker trained, the slow ones too
    assert summary["metric"]["name"] == "perplexity", summary
    assert summary["stop_reason"].startswith("target perplexity"), summary
    evals = records(tmp_path / "run", "eval")
    assert evals[0]["perplexity"] > 4 * CHARLM_TARGET, evals[0]
    assert evals[-1]["perplexity"] < 1.1 * CHARLM_TARGET, evals[-1]
    assert {r["worker"] for r in records(tmp_path / "run", "step")} == {0, 1, 2, 3}
    # the generated text: the prompt and 200 sampled bytes after it
    generated = done.stdout.split("The assert statement", 1)
    assert len(generated) == 2 and len(generated[1]) > 40, done.stdout[-3000:]
