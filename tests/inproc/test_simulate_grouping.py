"""Grouping-SGD's live re-grouping on the virtual clock (`hetps simulate`):
the real coordinator re-forms the groups when a worker's speed changes, and
the shard loses and doubles nothing across the change. Deterministic (no
wall clock); real processes adopting a new plan are covered by
test_cluster_membership.py (a worker killed or joining late)."""

from __future__ import annotations

import json

from cluster_util import REPO, records

from hetps.runconfig.load import load_config
from hetps.sim.engine import simulate

# configs/default.yaml (automatic groups, re-grouping on); worker 1 slows from 1 to 5 at 0.5 virtual
# seconds; 7 virtual seconds are about 700 steps, enough for 90% on mnist-5k
REGROUP = [
    "cluster.workers=[{slowdown: 1}, {slowdown: 1, schedule: [{at_s: 0.5, slowdown: 5}]},"
    " {slowdown: 5}, {slowdown: 5}]",
    "cluster.shards=1",
    "stop.target_accuracy=null",
    "stop.max_seconds=7",
    "algorithm.regroup_every_s=0.2",
    "sim.sample_s=0.0005",
    "eval.every_s=1.0",
    "cluster.heartbeat_s=0.1",
    # the shard cost these 700 steps were sized with (bytes only): the test is about re-grouping
    "sim.shard_message_s=0",
    "sim.shard_bytes_per_s=1e9",
    "sim.shard_apply_s=0",
    "sim.shard_apply_bytes_per_s=1e15",
    "comm.aggregate=off",  # counts one push per worker step (aggregated: test_simulate_aggregation.py)
]


def test_regrouping_when_a_worker_slows_down(tmp_path):
    run_dir = tmp_path / "regroup"
    s = simulate(load_config(str(REPO / "configs" / "default.yaml"), REGROUP), run_dir)
    plans = sorted(run_dir.glob("plan-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    assert len(plans) >= 2 and s["plan_id"] >= 2, [p.name for p in plans]
    plans = [json.loads(p.read_text()) for p in plans]
    workers = [w["node_id"] for w in plans[0]["workers"]]
    mover = workers[1]

    def together(plan, a, b):
        return any(a in g and b in g for g in plan["groups"])

    # the slowed worker moved from the fast group to the slow one
    slowed = sorted([[workers[0]], sorted(workers[1:])])
    first_slowed = next(
        (i for i, p in enumerate(plans) if sorted(map(sorted, p["groups"])) == slowed), None
    )
    # some plan after the first has it in the slow group
    assert first_slowed, [p["groups"] for p in plans]
    assert any(together(p, mover, workers[0]) for p in plans[:first_slowed]), [
        p["groups"] for p in plans
    ]
    shard = next(iter(s["shard_stats"].values()))
    assert shard["duplicates"] == 0
    assert shard["accepted"] == shard["contributions"] + shard["pending"]  # nothing lost or doubled
    assert s["global_steps"] <= shard["accepted"] <= s["global_steps"] + 4
    assert s["failures"] == [] and s["final_accuracy"] >= 0.9, s
    plan_records = records(run_dir, "plan")
    assert [r["plan_id"] for r in plan_records][:2] == [1, 2]
    # the mover kept training in its new group
    assert any(
        r["worker"] == 1 and r["t"] > plan_records[-1]["t"] for r in records(run_dir, "step")
    )
