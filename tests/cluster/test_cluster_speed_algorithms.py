"""balanced and diloco on real processes (workers at slowdown [1, 1, 3, 3]):
balanced gives the fast workers the larger batches and each worker trains on
the batch the plan gave it; asynchronous diloco trains LeNet-5 on mnist-5k to
95% with local steps in proportion to speed. Both report heterogeneity
efficiency in summary.json."""

from __future__ import annotations

import json

import pytest
from cluster_util import (
    FINAL_SLACK,
    HELD,
    assert_reached_target,
    log_tails,
    records,
    run_hetps,
    summary,
)

pytestmark = pytest.mark.cluster


def check_efficiency(s: dict) -> None:
    eff = s["efficiency"]
    assert (
        eff["samples"]
        == sum(v["samples"] for k, v in s["per_node"].items() if k.startswith("worker"))
        > 0
    )
    assert eff["standalone_samples_per_s"] > 0 and 0 < eff["heterogeneity_efficiency"] < 2, eff


@pytest.mark.exclusive  # batches from profiled speeds: other tests' load would blur them
def test_balanced_workers_train_on_the_plans_speed_proportional_batches(run_dir):
    result = run_hetps(
        [
            "run",
            "configs/balanced.yaml",
            # what is checked is the plan's batches and the steps made with them, not accuracy:
            # a short run, and one evaluation besides the final one
            "stop.max_seconds=2",
            "stop.target_accuracy=1.0",
            "eval.every_s=30",
            "algorithm.regroup=false",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=150,
    )
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    s = summary(run_dir)
    plan = json.loads((run_dir / "plan.json").read_text())
    rank_of = {str(w["node_id"]): w["rank"] for w in plan["workers"]}
    batches = {rank_of[w]: int(b) for w, b in plan["batches"].items()}
    assert sum(batches.values()) == 128
    # slowdown 1 against 3: the fast workers get the larger batches (equal batches would be 32
    # each). The ratio follows the speeds profiled on a shared machine, 3 when quiet and as
    # low as 1.86 seen while two cores ran four profiling workers, so only its direction and
    # a clear margin are asserted (proportional_sizes: tests/inproc/test_balanced.py)
    assert min(batches[0], batches[1]) > max(batches[2], batches[3]), batches
    assert batches[0] + batches[1] > 1.3 * (batches[2] + batches[3]), batches
    for rank, batch in batches.items():
        node = s["per_node"][f"worker{rank}"]
        # a batch is counted when computed; the stop may leave its step unfinished
        assert node["steps"] > 0 and node["samples"] in (
            node["steps"] * batch,
            (node["steps"] + 1) * batch,
        ), (rank, batch, node)
    steps = {rank: s["per_node"][f"worker{rank}"]["steps"] for rank in batches}
    assert max(steps.values()) - min(steps.values()) <= 2, steps  # one synchronous group: lock-step
    check_efficiency(s)


def test_diloco_trains_to_95_percent_asynchronously(run_dir):
    result = run_hetps(
        [
            "run",
            "configs/diloco.yaml",
            "stop.target_accuracy=0.95",
            HELD,
            "stop.max_seconds=60",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=180,
    )
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    s = summary(run_dir)
    assert s["algorithm"] == "diloco" and s["failures"] == []
    assert_reached_target(s, 0.95, slack=FINAL_SLACK)
    steps = records(run_dir, "step")
    periods = {
        w: {r["period"] for r in steps if r["worker"] == w and "period" in r} for w in range(4)
    }
    assert all(periods.values()), periods
    # slowdown 1 workers take the full period (16), slowdown 3 workers about a third of it
    assert min(periods[0] | periods[1]) > max(periods[2] | periods[3]), periods
    assert max(r["staleness"] for r in steps) > 0  # asynchronous: pushes met updates of others
    check_efficiency(s)
