"""Grouping-SGD on real processes: groups of similar speed that update
independently. (Live re-grouping when a worker's speed changes:
test_simulate_grouping.py, on the virtual clock.)"""

from __future__ import annotations

import json

import pytest
from cluster_util import HELD, assert_reached_target, log_tails, run_hetps, summary

pytestmark = pytest.mark.cluster


def test_groups_update_independently(run_dir):
    result = run_hetps(
        [
            "run",
            "configs/default.yaml",
            "algorithm.groups=2",
            "algorithm.regroup=false",
            "cluster.workers=[{slowdown: 1}, {slowdown: 1}, {slowdown: 10}, {slowdown: 10}]",
            "stop.target_accuracy=0.94",
            HELD,
            "stop.max_seconds=120",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=200,
    )
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    s = summary(run_dir)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert len(plan["groups"]) == 2
    worker_ids = [w["node_id"] for w in plan["workers"]]
    fast, slow = plan["groups"]
    assert set(fast) == set(worker_ids[:2]) and set(slow) == set(worker_ids[2:]), plan
    # data shares follow the slowest speed in each group
    assert plan["shares"][str(fast[0])] > 2 * plan["shares"][str(slow[0])]
    for shard in s["shard_stats"].values():
        updates = shard["group_updates"]
        # the fast group kept updating while the slow group's rounds were open (a 10x compute gap, so
        # the ratio stays above 2 even when communication takes much of a step on a loaded machine)
        assert updates["0"] >= 2 * updates["1"] > 0, shard
        assert updates["0"] + updates["1"] == shard["version"]
        assert shard["group_staleness"]["1"] > 1  # slow group's updates were damped
        assert shard["duplicates"] == 0
        assert shard["accepted"] == shard["contributions"] + shard["pending"]
    assert_reached_target(s, 0.94)
