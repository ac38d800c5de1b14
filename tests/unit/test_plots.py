"""The plots' data: accuracy curves against time, steps or bytes, the median and min-max
band over repeats, the per-group lanes, the run's title; that the plot functions
write their files from a run directory's records (not their pixels); and the live
progress line's plan and groups."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hetps.frontend.cli import main as hetps_main
from hetps.frontend.plots import (
    eval_curve,
    first_reach,
    group_lanes,
    lane_members,
    median_band,
    plot_compare,
    plot_run,
    run_title,
)
from hetps.frontend.report import Progress


def ev(t, acc, steps, nbytes=None, loss=1.0):
    rec = {
        "kind": "eval",
        "t": t,
        "accuracy": acc,
        "loss": loss,
        "global_steps": steps,
        "final": False,
    }
    return rec if nbytes is None else {**rec, "bytes": nbytes}


def step(t, worker, n, group, loss=0.5):
    return {
        "kind": "step",
        "t": t,
        "worker": worker,
        "step": n,
        "loss": loss,
        "staleness": 1,
        "group": group,
        "compute_s": 0.01,
        "step_s": 0.02,
    }


def test_eval_curve_on_each_axis():
    records = [ev(1.0, 0.5, 10, 1000), step(1.5, 0, 1, 0), ev(2.0, 0.8, 30, 3000)]
    assert eval_curve(records, "time") == ([1.0, 2.0], [0.5, 0.8])
    assert eval_curve(records, "steps") == ([10.0, 30.0], [0.5, 0.8])
    assert eval_curve(records, "bytes") == ([1000.0, 3000.0], [0.5, 0.8])
    with pytest.raises(ValueError, match="time, steps, bytes"):
        eval_curve(records, "epochs")
    # a run recorded before evals carried bytes
    with pytest.raises(ValueError, match="do not record 'bytes'"):
        eval_curve([ev(1.0, 0.5, 10)], "bytes")


def test_first_reach_is_the_first_evaluation_at_the_target():
    assert first_reach([1, 2, 3, 4], [0.5, 0.95, 0.94, 0.97], 0.95) == (2, 0.95)
    assert first_reach([1, 2], [0.5, 0.6], 0.95) is None
    assert first_reach([1, 2], [0.5, 0.6], None) is None


def test_median_band_over_repeats_carries_values_forward():
    a = ([1.0, 3.0], [0.2, 0.6])
    b = ([2.0, 3.0, 5.0], [0.4, 0.8, 0.9])
    c = ([1.0, 4.0], [0.1, 0.3])
    band = median_band([a, b, c])
    np.testing.assert_array_equal(band["x"], [1, 2, 3, 4, 5])
    # b has no value before its first evaluation
    np.testing.assert_array_equal(band["n"], [2, 3, 3, 3, 3])
    # at x=1: a 0.2, c 0.1 | x=2: a 0.2, b 0.4, c 0.1 | x=3: 0.6, 0.8, 0.1 | x=4: 0.6, 0.8, 0.3 | x=5: 0.6, 0.9, 0.3
    np.testing.assert_allclose(band["median"], [0.15, 0.2, 0.6, 0.6, 0.6])
    np.testing.assert_allclose(band["low"], [0.1, 0.1, 0.1, 0.3, 0.3])
    np.testing.assert_allclose(band["high"], [0.2, 0.4, 0.8, 0.8, 0.9])
    assert median_band([])["x"].size == 0 and median_band([([], [])])["median"].size == 0


def test_group_lanes_take_each_rounds_first_record_per_plan():
    records = [
        {"kind": "plan", "t": 0.0, "plan_id": 1, "groups": [[4, 5], [6, 7]]},
        step(1.0, 0, 1, 0),
        step(1.1, 1, 1, 0),  # group 0 round 1: applied by 1.0
        step(1.5, 2, 1, 1),
        step(1.4, 3, 1, 1),  # group 1 round 1: by 1.4
        step(2.0, 0, 2, 0),
        step(2.2, 1, 2, 0),
        {"kind": "eval", "t": 2.5, "accuracy": 0.9, "loss": 0.3, "global_steps": 6},
        {"kind": "plan", "t": 3.0, "plan_id": 2, "groups": [[4, 5, 6, 7]]},
        step(3.5, 2, 5, 0),
        step(3.6, 0, 5, 0),  # after the re-plan, group 0 is everyone
        # a last step under plan 1 (plan 2 has no group 1)
        step(3.2, 3, 4, 1),
        {**step(3.0, 9, 1, 0), "group": None},
    ]  # no group: skipped
    lanes = group_lanes(records)
    assert lanes == {(1, 0): [1.0, 2.0], (1, 1): [1.4, 3.2], (2, 0): [3.5]}
    assert lane_members(records, lanes) == {(1, 0): [0, 1], (1, 1): [2, 3], (2, 0): [0, 2]}


def test_run_title_says_what_ran_and_how_it_ended():
    summary = {
        "name": "default",
        "algorithm": "grouping",
        "per_node": {"worker0": {}, "worker1": {}, "evaluator0": {}},
        "target_accuracy": 0.95,
        "time_to_target_s": 3.61,
        "final_accuracy": 0.963,
    }
    assert run_title(summary) == "default: grouping, 2 workers: 95% reached at 3.6 s, final 0.9630"
    assert run_title({**summary, "time_to_target_s": None}).endswith(
        "95% not reached, final 0.9630"
    )
    assert run_title({}, "fallback") == "fallback"


def write_run(run_dir, algorithm, evals, steps=(), target=0.9):
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for rec in [*evals, *steps]:
            f.write(json.dumps(rec) + "\n")
        f.write('{"kind": "eval", "t": 9')  # a torn last line, as a killed run leaves it
    reached = first_reach([e["t"] for e in evals], [e["accuracy"] for e in evals], target)
    (run_dir / "summary.json").write_text(
        json.dumps(
            {
                "name": "t",
                "algorithm": algorithm,
                "target_accuracy": target,
                "final_accuracy": evals[-1]["accuracy"],
                "time_to_target_s": reached[0] if reached else None,
                "per_node": {"worker0": {}, "worker1": {}},
            }
        )
    )
    return str(run_dir)


def test_plot_run_writes_accuracy_and_group_lanes(tmp_path):
    grouping = tmp_path / "grouping"
    write_run(
        grouping,
        "grouping",
        [ev(1.0, 0.5, 4, 10), ev(2.0, 0.92, 8, 20)],
        [step(0.5, 0, 1, 0), step(0.6, 1, 1, 1), step(1.5, 0, 2, 0)],
    )
    assert plot_run(grouping) == grouping / "accuracy_vs_time.png"
    for name in ("accuracy_vs_time.png", "groups.png"):
        assert (grouping / name).read_bytes().startswith(b"\x89PNG")
    single = tmp_path / "sync"
    write_run(single, "sync", [ev(1.0, 0.5, 4, 10)], [step(0.5, 0, 1, 0), step(0.6, 1, 1, 0)])
    plot_run(single)
    assert not (single / "groups.png").exists()  # one group: no lanes to compare


def test_compare_plot_on_every_axis_and_hetps_plot(tmp_path, capsys):
    runs = [
        write_run(
            tmp_path / f"sync-{r}", "sync", [ev(1.0 + r, 0.5, 4, 100), ev(2.0 + r, 0.9, 8, 200)]
        )
        for r in range(3)
    ]
    rows = [{"algorithm": "sync", "runs": runs}]
    for x in ("time", "steps", "bytes"):
        assert plot_compare(rows, tmp_path, x).read_bytes().startswith(b"\x89PNG")
    (tmp_path / "compare.json").write_text(json.dumps(rows))
    (tmp_path / "compare.png").unlink()
    assert hetps_main(["plot", str(tmp_path), "--x", "steps"]) == 0
    assert (tmp_path / "compare.png").exists()
    assert hetps_main(["plot", runs[0]]) == 0 and capsys.readouterr().out.strip().endswith(
        "accuracy_vs_time.png"
    )
    assert hetps_main(["plot", str(tmp_path / "nothing-here")]) == 2
    old = tmp_path / "old"
    write_run(old, "sync", [ev(1.0, 0.5, 4)])
    (tmp_path / "compare.json").write_text(json.dumps([{"algorithm": "sync", "runs": [str(old)]}]))
    assert hetps_main(["plot", str(tmp_path), "--x", "bytes"]) == 2
    assert "do not record 'bytes'" in capsys.readouterr().err


def test_progress_line_shows_the_plan_and_its_groups(tmp_path):
    path = tmp_path / "metrics.jsonl"
    progress = Progress(path, target=0.95, max_seconds=60)
    with open(path, "w") as f:
        f.write(
            json.dumps({"kind": "plan", "t": 0.0, "plan_id": 1, "groups": [[4, 5], [6, 7]]}) + "\n"
        )
        f.write(json.dumps(step(1.0, 0, 3, 0)) + "\n")
    progress.poll()
    assert progress.line().endswith("steps/s  plan 1: groups 2+2"), progress.line()
    with open(path, "a") as f:
        f.write(
            json.dumps({"kind": "plan", "t": 2.0, "plan_id": 2, "groups": [[4, 5, 6, 7]]}) + "\n"
        )
    progress.poll()
    assert progress.line().endswith("plan 2: 1 group") and "[    2.0s/60s]" in progress.line()


def test_progress_line_says_which_groups_reduce_before_the_shards(tmp_path):
    """comm.aggregate: groups of `reduced_from` members or more push once per group-round."""
    path = tmp_path / "metrics.jsonl"
    progress = Progress(path, target=0.95, max_seconds=60, reduced_from=3)
    with open(path, "w") as f:
        plan = {"kind": "plan", "t": 0.0, "plan_id": 1, "groups": [[4, 5, 6], [7, 8]]}
        f.write(json.dumps(plan) + "\n")
        f.write(json.dumps(step(1.0, 0, 3, 0)) + "\n")
    progress.poll()
    assert progress.line().endswith("plan 1: groups 3+2 (1 reduced)"), progress.line()
    with open(path, "a") as f:
        f.write(json.dumps({**plan, "t": 2.0, "plan_id": 2, "groups": [[4, 5, 6, 7, 8]]}) + "\n")
    progress.poll()
    assert progress.line().endswith("plan 2: 1 group reduced"), progress.line()


def test_a_big_groups_legend_names_how_many_workers_not_every_rank():
    from hetps.frontend.plots import workers_label

    assert workers_label([4, 5]) == "workers 4, 5"
    assert workers_label(list(range(10, 94))) == "84 workers: 10, 11, ... 93"
