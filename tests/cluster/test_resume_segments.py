"""A run resumed twice with `hetps run --resume` reads as one run: summary.json counts the whole
run and lists each segment, metrics.jsonl's time, global steps and each worker's steps go on
across segments, the plot is one curve with its segments marked, the progress line follows
the new segment, TensorBoard's steps go on, `stop.max_steps` counts the whole run, and
best.safetensors holds the best evaluation of all segments (measured again in a fresh
process). Step limits, not seconds, bound every segment."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from cluster_util import REPO, log_tails, records, run_hetps, summary

from hetps.frontend.plots import eval_curve, segment_starts
from hetps.frontend.report import Progress
from hetps.runtime import checkpoint
from hetps.scheduler.runlog import read_metrics

pytestmark = pytest.mark.cluster

# every checkpoint kept: the third segment is resumed from the first one's last checkpoint
FIRST = ["stop.target_accuracy=null", "stop.max_seconds=120", "checkpoint.keep=1000"]
# the second segment's limit, counted over the whole run: the first one's ~100-130 steps (about
# 30% accuracy) and ~300 more reach ~95%, far above what the third makes of the first one's model
WHOLE_RUN = 400

EVALUATE = """
import json, sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from hetps.runconfig.load import load_config
from hetps.training.measure import evaluate
from hetps.training.preflight import build_checked

run_dir = Path(sys.argv[1])
cfg = load_config(run_dir / "config.yaml", import_targets=True)
data, model = build_checked(cfg)
model.load_state_dict(load_file(run_dir / "best.safetensors"))
accuracy, _ = evaluate(model, data.test, cfg.data.eval_batch_size, torch.device("cpu"))
print(json.dumps({"accuracy": accuracy}))
"""


def fresh_accuracy(run_dir) -> float:
    """best.safetensors loaded into the run's model in a fresh process, measured on the test split."""
    out = subprocess.run(
        [sys.executable, "-c", EVALUATE, str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["accuracy"]


def resume(run_dir, *overrides: str) -> subprocess.CompletedProcess:
    result = run_hetps(
        ["run", "--resume", str(run_dir), "stop.target_accuracy=null", *overrides], timeout_s=240
    )
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    return result


def last_progress_line(stderr: str) -> str:
    return [line for line in stderr.splitlines() if line.startswith("[")][-1]


def roll_back_checkpoints(run_dir, version: int) -> None:
    """Remove every shard's checkpoints newer than `version`: the next resume restores it."""
    for folder in run_dir.glob("checkpoints/*/ps*"):
        for v, path in checkpoint.checkpoints(folder):
            if v > version:
                path.unlink()


def test_a_run_resumed_twice_reads_as_one_run(run_dir):
    first = run_hetps(
        [
            "run",
            "configs/sync.yaml",
            "--out",
            str(run_dir),
            "--quiet",
            "stop.max_steps=100",
            *FIRST,
        ],
        timeout_s=240,
    )
    assert first.returncode == 0, first.stderr + log_tails(run_dir)
    one = summary(run_dir)
    first_versions = set(one["shard_versions"].values())
    assert len(first_versions) == 1, one["shard_versions"]

    # max_steps counts the whole run: a limit the run already reached is refused up front
    refused = run_hetps(["run", "--resume", str(run_dir), "stop.max_steps=100"], timeout_s=60)
    assert refused.returncode == 2, refused.stderr
    assert f"the run already made {one['global_steps']} steps of stop.max_steps=100" in (
        refused.stderr
    )

    second = resume(run_dir, f"stop.max_steps={WHOLE_RUN}")
    assert "as segment 2" in second.stderr
    assert f"stop.max_steps={WHOLE_RUN} counts the whole run" in second.stderr
    two = summary(run_dir)
    # stopped by the run's WHOLE_RUN steps, not after WHOLE_RUN of its own
    assert two["stop_reason"] == f"step limit {WHOLE_RUN}", two
    assert two["global_steps"] >= WHOLE_RUN, two
    own = two["segments"][1]["global_steps"]
    assert own < WHOLE_RUN - one["global_steps"] + 100, two["segments"]
    # the third segment trains on from the first one's last model (its newer checkpoints
    # removed): all its evaluations are worse than the second segment's best
    roll_back_checkpoints(run_dir, first_versions.pop())
    third = resume(run_dir, f"stop.max_steps={two['global_steps'] + 40}")
    assert "as segment 3" in third.stderr
    s = summary(run_dir)

    # summary.json: the whole run, and what each segment did
    segs = s["segments"]
    assert [g["segment"] for g in segs] == [1, 2, 3]
    assert s["global_steps"] == sum(g["global_steps"] for g in segs)
    assert (
        segs[0]["global_steps"] == one["global_steps"] and s["global_steps"] > two["global_steps"]
    )
    assert s["wall_s"] == pytest.approx(sum(g["wall_s"] for g in segs), abs=0.01)
    assert [g["started_at_s"] for g in segs] == pytest.approx(
        [0.0, segs[0]["wall_s"], segs[0]["wall_s"] + segs[1]["wall_s"]], abs=0.01
    )
    assert s["bytes_sent"] == sum(g["bytes_sent"] for g in segs) > two["bytes_sent"]
    assert s["evals"] == sum(g["evals"] for g in segs) and all(g["evals"] for g in segs)
    worker_steps = sum(v["steps"] for n, v in s["per_node"].items() if n.startswith("worker"))
    assert worker_steps == s["global_steps"]

    # metrics.jsonl: one clock, one step count, each worker's steps going on
    recs = read_metrics(run_dir / "metrics.jsonl")
    starts = [r for r in recs if r["kind"] == "segment"]
    assert [(r["segment"], r["global_steps"]) for r in starts] == [
        (2, one["global_steps"]),
        (3, two["global_steps"]),
    ]
    evals = records(run_dir, "eval")
    times = [e["t"] for e in evals]
    assert times == sorted(times) and len(set(times)) == len(times), times
    steps = [e["global_steps"] for e in evals]
    assert steps == sorted(steps) and steps[-1] <= s["global_steps"], steps
    for rank in range(4):
        mine = [r["step"] for r in records(run_dir, "step") if r["worker"] == rank]
        assert mine == sorted(mine) and len(set(mine)) == len(mine), (rank, mine)
        assert mine[-1] <= s["per_node"][f"worker{rank}"]["steps"]
    for start, previous_t in zip(
        starts, [segs[0]["wall_s"], segs[0]["wall_s"] + segs[1]["wall_s"]]
    ):
        assert start["t"] == pytest.approx(previous_t, abs=0.01)
        before = [r["t"] for r in recs[: recs.index(start)] if r["kind"] not in ("register",)]
        assert max(before) <= start["t"] + 0.01

    # the plot: one curve, increasing in time and steps, the segments marked where they began
    xs, _ = eval_curve(recs, "time")
    assert xs == sorted(xs) and xs[-1] <= s["wall_s"]
    by_steps, _ = eval_curve(recs, "steps")
    assert by_steps == sorted(by_steps)
    assert [seg for seg, _ in segment_starts(recs)] == [2, 3]
    assert (run_dir / "accuracy_vs_time.png").stat().st_size > 0

    # the progress line followed the new segment (not frozen on the earlier ones)
    line = last_progress_line(third.stderr)
    assert "segment 3:" in line, line
    shown = int(re.search(r"steps +(\d+)/", line).group(1))
    assert shown > two["global_steps"], (line, two["global_steps"])
    progress = Progress(run_dir / "metrics.jsonl", max_steps=s["global_steps"])
    progress.poll()
    assert progress.segment == 3 and progress.t > progress.segment_t == starts[1]["t"]

    # the best model: the best evaluation of all segments, wherever it was measured
    best_measured = max(e["accuracy"] for e in evals)
    assert max(e["accuracy"] for e in evals if e["t"] >= starts[1]["t"]) < best_measured
    assert s["best_accuracy"] == pytest.approx(best_measured)
    best = json.loads((run_dir / "best.json").read_text())
    assert best["final_accuracy"] == pytest.approx(best_measured), best
    assert fresh_accuracy(run_dir) == pytest.approx(best_measured, abs=1e-6)


def tensorboard_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # no purging: a step that went back would drop the earlier segment's scalars, not show it
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_steps_go_on_across_segments(run_dir):
    pytest.importorskip(
        "tensorboard",
        reason="tensorboard not installed (pip install 'hetps[tensorboard]'): "
        "the event files cannot be written or read",
    )
    first = run_hetps(
        [
            "run",
            "configs/sync.yaml",
            "--out",
            str(run_dir),
            "--quiet",
            "--tensorboard",
            "stop.max_steps=80",
            *FIRST,
        ],
        timeout_s=240,
    )
    assert first.returncode == 0, first.stderr + log_tails(run_dir)
    resume(run_dir, "stop.max_steps=200", "--quiet")
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    evals = records(run_dir, "eval")
    # one series over both segments, at the run's global steps, as metrics.jsonl has them
    assert [step for step, _ in scalars["eval/accuracy"]] == [e["global_steps"] for e in evals]
    assert [v for _, v in scalars["eval/accuracy"]] == pytest.approx(
        [e["accuracy"] for e in evals], abs=1e-6
    )
    mine = [step for step, _ in scalars["worker1/loss"]]
    assert mine == sorted(mine) and len(set(mine)) == len(mine)
    assert mine == [r["step"] for r in records(run_dir, "step") if r["worker"] == 1]
