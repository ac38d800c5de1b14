"""Heterogeneity efficiency and useful efficiency: the arithmetic on known
inputs, and how `hetps compare` reports them against a sync reference."""

from __future__ import annotations

import pytest

from hetps.frontend.compare import add_useful, aggregate, markdown
from hetps.scheduler.efficiency import heterogeneity_efficiency, useful_efficiency


def test_efficiency_is_cluster_throughput_over_the_sum_of_standalone_speeds():
    # workers at 100, 100, 33.3, 33.3 samples/s alone (266.7 together); the cluster did 10,667 samples in 100 s
    assert heterogeneity_efficiency(
        10_667, 100.0, [100.0, 100.0, 100 / 3, 100 / 3]
    ) == pytest.approx(0.4, abs=1e-4)
    # sync on [1, 1, 3, 3]: everyone at the slowest's pace -> 4 x 33.3 / 266.7 = 0.5
    assert heterogeneity_efficiency(
        4 * 100 / 3 * 60, 60.0, [100, 100, 100 / 3, 100 / 3]
    ) == pytest.approx(0.5)
    assert heterogeneity_efficiency(1000, 10.0, [50.0, 50.0]) == pytest.approx(1.0)


def test_efficiency_is_none_when_an_input_is_missing():
    assert heterogeneity_efficiency(0, 10.0, [1.0]) is None
    assert heterogeneity_efficiency(100, 0.0, [1.0]) is None
    assert heterogeneity_efficiency(100, 10.0, []) is None
    assert heterogeneity_efficiency(100, 10.0, [0.0, float("nan")]) is None


def test_useful_efficiency_charges_the_samples_needed_to_reach_the_target():
    # 0.9 efficient, but needed 30,000 samples where sync needed 20,000 -> 0.6
    assert useful_efficiency(0.9, 20_000, 30_000) == pytest.approx(0.6)
    assert useful_efficiency(0.5, 20_000, 20_000) == pytest.approx(0.5)  # sync against itself
    assert useful_efficiency(0.9, None, 30_000) is None
    assert useful_efficiency(0.9, 20_000, None) is None
    assert useful_efficiency(None, 20_000, 30_000) is None


def summary(
    efficiency: float | None, samples_to_target: int | None, ttt: float | None = 10.0
) -> dict:
    return {
        "time_to_target_s": ttt,
        "final_accuracy": 0.95,
        "bytes_sent": 1,
        "bytes_received": 1,
        "communication_rounds": 3,
        "shard_versions": {},
        "global_steps": 10,
        "run_dir": "r",
        "efficiency": {
            "heterogeneity_efficiency": efficiency,
            "samples_to_target": samples_to_target,
        },
    }


def test_compare_rows_carry_medians_and_useful_efficiency_against_sync():
    rows = [
        aggregate("sync", [summary(0.5, 20_000), summary(0.52, 22_000), summary(0.48, 18_000)]),
        aggregate("balanced", [summary(0.9, 24_000), summary(0.95, 30_000), summary(0.85, 27_000)]),
        aggregate("async", [summary(0.99, 50_000), summary(0.98, None, ttt=None)]),
    ]
    add_useful(rows, "sync")
    assert rows[0]["efficiency"] == 0.5 and rows[0]["samples_to_target"] == 20_000
    assert rows[0]["useful_efficiency"] == pytest.approx(0.5)
    assert rows[1]["useful_efficiency"] == pytest.approx(0.9 * 20_000 / 27_000)
    # a repeat missed the target: no median samples-to-target
    assert rows[2]["useful_efficiency"] is None
    md = markdown(rows, "t").splitlines()
    assert md[2].endswith("| efficiency | useful efficiency (vs sync) |")
    assert md[5].endswith("| 0.90 | 0.67 |"), md[5]


def test_without_a_reference_useful_efficiency_is_left_out():
    rows = add_useful([aggregate("grouping", [summary(0.8, 1000)])], "sync")
    assert rows[0]["useful_efficiency"] is None
    assert markdown(rows, "t").splitlines()[4].endswith("| 0.80 | - |")


def test_milestones_are_the_first_evaluation_at_each_accuracy(tmp_path):
    import json

    from hetps.frontend.compare import milestone_times

    evals = [(1.0, 0.90), (2.0, 0.951), (3.0, 0.94), (4.0, 0.972)]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"kind": "eval", "t": t, "accuracy": a}) + "\n" for t, a in evals)
    )
    assert milestone_times(tmp_path, [0.95, 0.97, 0.99]) == {"0.95": 2.0, "0.97": 4.0, "0.99": None}
    rows = [
        aggregate(
            "sync",
            [
                {**summary(0.5, 10), "milestones": {"0.95": 2.0, "0.97": 4.0}},
                {**summary(0.5, 10), "milestones": {"0.95": 3.0, "0.97": None}},
            ],
        )
    ]
    # a repeat that never got there: no median
    assert rows[0]["milestones"] == {"0.95": 2.5, "0.97": None}
    md = markdown(rows, "t").splitlines()
    assert "| time to 0.95 (s) | time to 0.97 (s) |" in md[2] and "| 2.5 (2.0–3.0) | - |" in md[4]
