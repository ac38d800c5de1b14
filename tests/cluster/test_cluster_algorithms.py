"""eager, cpsgd and wpsgd on real processes: each trains LeNet-5 on
mnist-5k to >= 93% test accuracy with its config from configs/, and its
summary shows the algorithm's own bookkeeping. adpsgd (cpsgd's worker loop
with a growing period) and simuparallel (wpsgd's with equal weights) run
the same code paths; their own rules are checked on the virtual clock
(test_simulate_local.py), where they also train to the target."""

from __future__ import annotations

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


def check_eager(s: dict, steps: list[dict]) -> None:
    for shard in s["shard_stats"].values():
        assert shard["rounds"] == shard["version"] > 0
        assert shard["late"] > 0 and shard["barriers"] > 0, shard  # the straggler made late pushes
        assert shard["fresh"] + shard["late"] + shard["folded"] == shard["contributions"]


def check_cpsgd(s: dict, steps: list[dict]) -> None:
    period = 8
    assert {r["period"] for r in steps if "period" in r} == {period}
    assert s["global_steps"] >= 4 * period * (s["communication_rounds"] - 1)


def check_weights(s: dict, steps: list[dict]) -> None:
    weighted = [r["weights"] for r in steps if "weights" in r]
    assert weighted
    for w in weighted:
        assert sum(w) == pytest.approx(1.0, abs=1e-4)
        # slowdowns [1, 1, 2, 4]: the slowest worker did the fewest steps
        assert w[3] < min(w[0], w[1]), w


ALGORITHMS = {
    "eager": ("configs/eager.yaml", check_eager),
    "cpsgd": ("configs/cpsgd.yaml", check_cpsgd),
    "wpsgd": ("configs/wpsgd.yaml", check_weights),
}


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_algorithm_trains_to_93_percent(algorithm, run_dir):
    config, check = ALGORITHMS[algorithm]
    result = run_hetps(
        [
            "run",
            config,
            "stop.target_accuracy=0.93",
            HELD,
            "stop.max_seconds=60",
            "stop.max_steps=20000",
            "eval.every_s=1.0",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=180,
    )
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    s = summary(run_dir)
    assert s["algorithm"] == algorithm
    # eager's quorum rounds leave stragglers' gradients to later rounds: its curve swings like async's
    assert_reached_target(s, 0.93, slack=0.06 if algorithm == "eager" else FINAL_SLACK)
    assert s["failures"] == [] and s["not_left"] == []
    assert s["communication_rounds"] > 0
    workers = {k: v for k, v in s["per_node"].items() if k.startswith("worker")}
    assert len(workers) == 4 and all(v["sent"] > 0 and v["received"] > 0 for v in workers.values())
    steps = records(run_dir, "step")
    assert {r["worker"] for r in steps} == {0, 1, 2, 3}
    check(s, steps)
