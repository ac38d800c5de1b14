"""A resumed run reads as one run (scheduler/segments.py): the earlier segments' totals taken
from the stopped segment's saved state, every record of the new segment shifted onto the run's
clock and counts (metrics.jsonl and the TensorBoard sink alike), the progress line starting
afresh at a `segment` record, the plot's segment marks, and the resume's stop-limit rules."""

from __future__ import annotations

import json

import pytest

from hetps.frontend.plots import eval_curve, segment_starts
from hetps.frontend.report import Progress
from hetps.frontend.resume import ResumePoint, check_limits, resume_line
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ConfigError
from hetps.scheduler import segments
from hetps.scheduler.runlog import RunLog, read_metrics


def saved_state(elapsed, steps, samples=None, sent=100, earlier=None, count=3, best=0.8):
    """A scheduler-state.json's content as far as segments.after reads it."""
    samples = samples or {r: 32 * s for r, s in steps.items()}
    nodes = [
        {
            "node_id": r + 3,
            "role": "worker",
            "rank": r,
            "stats": {"steps": s, "samples": samples[r], "bytes_sent": sent, "bytes_received": 2},
        }
        for r, s in steps.items()
    ]
    nodes.append({"node_id": 1, "role": "ps", "rank": 0, "stats": {"steps": 0, "version": 50}})
    nodes.append({"node_id": 9, "role": "evaluator", "rank": 0, "stats": {"bytes_received": 7}})
    return {
        "elapsed_s": elapsed,
        "nodes": nodes,
        "evals": {"target": 0.9, "patience": 2, "streak": 1, "count": count, "best": best},
        "stop": {"reason": "step limit 100", "failed": None},
        "earlier": earlier or {},
    }


def test_the_earlier_segments_add_up_over_two_resumes():
    first = segments.after(saved_state(10.0, {0: 30, 1: 20}))
    assert (first.segment, first.t, first.total("steps"), first.worker_steps()) == (
        2,
        10.0,
        50,
        {0: 30, 1: 20},
    )
    # the second segment's state holds only its own counts, and the first segment as `earlier`
    second = segments.after(
        saved_state(4.5, {0: 5, 1: 6}, earlier=first.to_dict(), count=7, best=0.95)
    )
    assert second.segment == 3 and second.t == pytest.approx(14.5)
    assert second.worker_steps() == {0: 35, 1: 26} and second.total("steps") == 61
    assert second.total("samples") == 32 * 61
    assert second.count("evaluator0", "bytes_received") == 14
    # the evaluation track goes on, but its streak and the config's target do not
    assert second.evals == {"count": 7, "best": 0.95}
    assert [s["segment"] for s in second.segments] == [1, 2]
    assert [s["started_at_s"] for s in second.segments] == [0.0, 10.0]
    assert [s["global_steps"] for s in second.segments] == [50, 11]
    assert [s["evals"] for s in second.segments] == [3, 4]
    assert second.segments[1]["stop_reason"] == "step limit 100"
    # through JSON (the state file) unchanged
    assert segments.Earlier.from_dict(json.loads(json.dumps(second.to_dict()))) == second


def test_records_of_a_resumed_segment_carry_the_runs_time_and_counts(tmp_path):
    earlier = segments.after(saved_state(10.0, {0: 30, 1: 20}, sent=1000))
    got = []

    class Sink:  # what the TensorBoard sink is given
        def record(self, kind, values):
            got.append((kind, values))

        def close(self):
            pass

    log = RunLog(tmp_path)
    log.sink, log.earlier = Sink(), earlier
    log.record("register", t=0.5, node="worker0")  # counts from the scheduler's start
    log.record("step", t=0.25, worker=1, step=3, loss=0.1)
    log.record("step", t=0.25, worker=7, step=3)  # a rank the earlier segments did not have
    log.record("eval", t=1.0, accuracy=0.9, global_steps=4, global_samples=128, bytes=10)
    log.record("stop", t=2.0, reason="x", global_steps=9)
    log.close()
    written = read_metrics(tmp_path / "metrics.jsonl")
    assert [{k: v for k, v in r.items() if k != "kind"} for r in written] == [v for _, v in got]
    register, step1, step7, evaluation, stop = written
    assert register["t"] == 0.5
    assert (step1["t"], step1["step"], step7["step"]) == (10.25, 23, 3)
    assert evaluation["t"] == 11.0 and evaluation["global_steps"] == 54
    assert evaluation["global_samples"] == 128 + 32 * 50
    assert evaluation["bytes"] == 10 + 2 * 1000 + 2 * 2  # the workers' sent and received
    assert (stop["t"], stop["global_steps"]) == (12.0, 59)


def test_a_first_segment_writes_its_records_unchanged(tmp_path):
    log = RunLog(tmp_path)
    log.record("eval", t=1.0, accuracy=0.9, global_steps=4)
    log.close()
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["global_steps"] == 4


def write_lines(path, records):
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def segment_one():
    return [
        {"kind": "register", "t": 0.1, "node": "worker0"},
        {"kind": "plan", "t": 0.0, "plan_id": 1, "groups": [[3, 4]]},
        {"kind": "step", "t": 1.0, "worker": 0, "step": 30},
        {"kind": "step", "t": 1.0, "worker": 1, "step": 20},
        {"kind": "eval", "t": 2.0, "accuracy": 0.8, "global_steps": 50, "loss": 1.0},
        {"kind": "stop", "t": 10.0, "reason": "step limit 50", "global_steps": 50},
    ]


def test_the_progress_line_follows_the_new_segment(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_lines(path, segment_one())
    progress = Progress(path, expected=["worker0", "worker1"], max_seconds=5, max_steps=100)
    progress.poll()
    write_lines(
        path,
        [
            {"kind": "segment", "t": 10.0, "segment": 2, "global_steps": 50, "workers": {"0": 30}},
            {"kind": "register", "t": 0.2, "node": "worker0"},
        ],
    )
    progress.poll()
    # the cluster forms again
    assert not progress.planned and progress.registered == ["worker0"]
    assert "registered 1/2" in progress.line()
    write_lines(
        path,
        [
            {"kind": "plan", "t": 10.0, "plan_id": 1, "groups": [[3, 4]]},
            {"kind": "step", "t": 11.0, "worker": 0, "step": 31},
            {"kind": "step", "t": 12.5, "worker": 0, "step": 40},
            {"kind": "step", "t": 12.5, "worker": 1, "step": 2},
        ],
    )
    progress.poll()
    line = progress.line()
    assert line.startswith("[   12.5s, segment 2: 2.5s/5s] steps      42/100"), line
    assert progress.rate > 0


def test_the_plotted_curve_of_a_resumed_run_is_one_and_its_segments_are_marked(tmp_path):
    records = [
        *segment_one(),
        {"kind": "segment", "t": 10.0, "segment": 2, "global_steps": 50, "workers": {}},
        {"kind": "eval", "t": 10.5, "accuracy": 0.85, "global_steps": 50, "loss": 1.0},
        {"kind": "eval", "t": 12.0, "accuracy": 0.9, "global_steps": 80, "loss": 1.0},
    ]
    xs, ys = eval_curve(records, "time")
    assert xs == [2.0, 10.5, 12.0] and ys == [0.8, 0.85, 0.9]
    assert segment_starts(records) == [(2, 10.0)]
    assert segment_starts(segment_one()) == []


def test_the_step_limit_counts_the_whole_run_and_the_time_limit_the_segment(tmp_path):
    earlier = segments.after(saved_state(10.0, {0: 30, 1: 20}))
    point = ResumePoint("abc", {0: 12, 1: 12}, True, earlier=earlier)
    cfg = load_config("configs/sync.yaml", ["stop.max_steps=50", "stop.max_seconds=5"])
    with pytest.raises(ConfigError) as raised:
        check_limits(point, cfg)
    assert "made 50 steps of stop.max_steps=50" in str(raised.value)
    assert "stop.max_steps=100" in str(raised.value)
    cfg = load_config("configs/sync.yaml", ["stop.max_steps=80", "stop.max_seconds=5"])
    check_limits(point, cfg)
    line = resume_line(point, tmp_path, cfg)
    assert "as segment 2, after 50 steps and 10.0s of training" in line
    assert "stop.max_steps=80 counts the whole run (30 more steps)" in line
    assert "stop.max_seconds=5 counts this segment" in line
