"""Every reader of metrics.jsonl survives what is in it: records the decoder
lets through (a step with only `worker`, `step` and `t`: a client that sends
no loss), and records a file edited by hand or written by another version may
hold (a field missing or of another type, a line that is no record, bytes that
are no UTF-8). Such a record is skipped; the rest is read as before.

Readers: the live progress line (frontend/report.py), the plots
(frontend/plots.py, `hetps plot`), `hetps compare`'s milestones
(frontend/compare.py), the measured cost model (sim/costs.py) and
read_metrics itself (scheduler/runlog.py)."""

from __future__ import annotations

import json

import pytest

from hetps.frontend.cli import main as hetps_main
from hetps.frontend.compare import milestone_times
from hetps.frontend.plots import eval_curve, group_lanes, lane_members, plot_run
from hetps.frontend.report import Progress
from hetps.runconfig.schema import ConfigError
from hetps.scheduler.runlog import read_metrics
from hetps.sim.costs import measured_costs


def step(t, worker, n, group, loss=0.5, compute_s=0.01, step_s=0.03):
    return {
        "kind": "step",
        "t": t,
        "worker": worker,
        "step": n,
        "loss": loss,
        "staleness": 0,
        "group": group,
        "compute_s": compute_s,
        "step_s": step_s,
    }


GOOD = [
    {"kind": "register", "t": 0.0, "node": "worker0", "host": "h"},
    {"kind": "plan", "t": 0.0, "plan_id": 1, "groups": [[1], [2]], "speeds": {}, "wall": 1.0},
    step(0.5, 0, 1, 0),
    step(0.6, 1, 1, 1, compute_s=0.02, step_s=0.05),
    {"kind": "eval", "t": 1.0, "accuracy": 0.5, "loss": 1.2, "global_steps": 2, "bytes": 10},
    step(1.5, 0, 2, 0, loss=0.25),
    {"kind": "eval", "t": 2.0, "accuracy": 0.9, "loss": 0.4, "global_steps": 3, "bytes": 20},
]
# what the scheduler writes for a client that sends only `step` (and `ago`): the least a record holds
LEAN_STEP = {"kind": "step", "t": 1.7, "worker": 0, "step": 5}
ODD = [
    {"kind": "step", "t": 0.7, "ago": 0.1},  # no worker, no step, no loss
    {"kind": "step", "t": "soon", "worker": "0", "step": "7", "loss": "low", "group": "0"},
    {"kind": "step", "t": 0.9, "worker": 1, "step": 9.5, "loss": None, "group": [1]},
    {"kind": "step", "t": 1.1, "worker": 1.5, "step": True, "compute_s": "x", "step_s": None},
    {"kind": "eval", "t": 1.5},  # no accuracy
    {"kind": "eval", "t": 1.6, "accuracy": "high", "loss": None, "bytes": "many"},
    {"kind": "eval", "t": None, "accuracy": 0.99},
    {"kind": "plan", "t": 0.2, "plan_id": "2", "groups": 3},
    {"kind": "plan", "t": 0.3, "plan_id": 3, "groups": [4, 5]},
    {"kind": "stall", "t": 1.0, "node": ["w"], "for_s": "long"},
    {"kind": "stall", "t": "x", "node": "worker1", "for_s": 2.0},
    {"kind": "register", "t": 0.1, "node": {"a": 1}},
    {"kind": 7, "t": 1.0},
    {"no": "kind"},
    [1, 2],
    3,
    "text",
]


def write_metrics(run_dir, records, raw_lines=()) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "wb") as f:
        for r in records:
            f.write(json.dumps(r).encode() + b"\n")
        for line in raw_lines:
            f.write(line + b"\n")


RAW = [
    b"not json {",
    b'{"kind": "step", "t": 1.0, "worker": 0, "step": 4, "note": "\xff\xfe"}',
    b"",
]


def mixed(run_dir):
    """GOOD with every ODD record and RAW line in between."""
    records = [*GOOD[:3], *ODD, *GOOD[3:], LEAN_STEP]
    write_metrics(run_dir, records, RAW)


def test_read_metrics_returns_records_only(tmp_path):
    mixed(tmp_path)
    got = read_metrics(tmp_path / "metrics.jsonl")
    assert all(isinstance(r, dict) and isinstance(r.get("kind"), str) for r in got)
    assert GOOD[2] in got and LEAN_STEP in got and [1, 2] not in got
    # + LEAN_STEP, and RAW's step whose string held bytes that are no UTF-8 (replaced)
    assert len(got) == len(GOOD) + 2 + sum(
        isinstance(r, dict) and isinstance(r.get("kind"), str) for r in ODD
    )
    assert {"kind": "step", "t": 1.0, "worker": 0, "step": 4, "note": "\ufffd\ufffd"} in got


def test_the_progress_line_counts_the_steps_it_can_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    mixed(tmp_path)
    progress = Progress(path, expected=["worker0", "worker1"], target=0.95, max_seconds=60)
    progress.poll()
    # worker0's latest step is 5 (the lean record), worker1's 1; nothing else counted
    assert progress.steps == {0: 5, 1: 1}
    assert progress.accuracy == 0.9 and progress.t == 2.0
    assert progress.plan == (1, 2) and progress.registered == ["worker0"]
    line = progress.line()
    assert "steps       6" in line and "test acc 0.9000" in line and "plan 1" in line, line
    # a later line is read from where the last poll stopped, a torn one not yet
    with open(path, "a") as f:
        f.write(json.dumps(step(2.5, 1, 4, 1)) + "\n" + '{"kind": "step", "t": 3')
    progress.poll()
    assert progress.steps == {0: 5, 1: 4} and progress.t == 2.5


def test_the_plots_draw_what_they_can_read(tmp_path):
    mixed(tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert eval_curve(records, "time") == ([1.0, 2.0], [0.5, 0.9])
    assert eval_curve(records, "bytes") == ([10.0, 20.0], [0.5, 0.9])
    lanes = group_lanes(records)
    assert lanes == {(1, 0): [0.5, 1.5], (1, 1): [0.6]}
    assert lane_members(records, lanes) == {(1, 0): [0], (1, 1): [1]}
    assert plot_run(tmp_path).read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "groups.png").exists()
    assert hetps_main(["plot", str(tmp_path)]) == 0


def test_a_run_whose_steps_carry_no_loss_still_plots(tmp_path):
    write_metrics(tmp_path, [GOOD[1], LEAN_STEP, GOOD[4]])
    assert plot_run(tmp_path).read_bytes().startswith(b"\x89PNG")


def test_compare_reads_the_milestones_it_can(tmp_path):
    mixed(tmp_path)
    assert milestone_times(tmp_path, [0.5, 0.9, 0.95]) == {"0.5": 1.0, "0.9": 2.0, "0.95": None}


def test_the_cost_model_takes_the_steps_that_were_measured(tmp_path):
    mixed(tmp_path)
    costs = measured_costs(tmp_path)
    assert [c["step_s"] for c in costs] == [0.01, 0.02]
    # half the smallest median time outside compute: worker0's 0.02 s
    assert costs[0]["latency_ms"] == pytest.approx(10.0)
    write_metrics(tmp_path, [LEAN_STEP])
    with pytest.raises(ConfigError, match="no step records"):
        measured_costs(tmp_path)


def test_the_steps_recorded_are_each_workers_highest_step_summed():
    from hetps.scheduler.runlog import steps_recorded

    records = [
        {"kind": "register", "t": 9.0, "node": "ps0"},  # not a step: its time is not training's
        {"kind": "step", "t": 1.0, "worker": 0, "step": 0},
        {"kind": "step", "t": 1.5, "worker": 1, "step": 0},
        {"kind": "step", "t": 2.0, "worker": 0, "step": 1},
        {"kind": "step", "t": 2.5, "worker": 1, "step": 4},  # records may be sampled
        {"kind": "step", "t": 3.0, "worker": "x", "step": 9},  # odd: skipped
    ]
    assert steps_recorded(records) == (2 + 5, 2.5)
    assert steps_recorded([]) == (0, 0.0)
