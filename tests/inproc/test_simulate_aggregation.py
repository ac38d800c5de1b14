"""Group aggregation (comm.aggregate) on the simulator's virtual clock: the
members of a synchronous group wait for each other, their all-reduce and the
shared replies' broadcasts are charged with sim/costs.py's functions, each
shard takes one push per group-round (the real policy on a real PUSH with
`members`), and a member that dies leaves the others pushing on their own
until the re-plan; re-grouping keeps every contribution once."""

from __future__ import annotations

import json
import math

import pytest
from test_simulate import digits  # noqa: F401  (the fixture: mnist-5k loaded once)
from test_simulate import run as simulate_run

from hetps.scheduler.runlog import read_metrics
from hetps.sim.costs import group_allreduce_s, group_broadcast_s
from hetps.sim.events import Link

FREE_SHARDS = [
    "sim.shard_bytes_per_s=1e15",
    "sim.shard_message_s=0",
    "sim.shard_apply_s=0",
    "sim.shard_apply_bytes_per_s=1e15",
]


def run(tmp_path, digits, name, *overrides):
    """test_simulate.py's run, its groups reducing (comm.aggregate: on) at 1 ms a sample."""
    return simulate_run(
        tmp_path, digits, name, "comm.aggregate=on", "sim.sample_s=0.001", *overrides
    )


def steps_of(run_dir, worker: int) -> list[dict]:
    return [
        r
        for r in read_metrics(run_dir / "metrics.jsonl")
        if r["kind"] == "step" and r["worker"] == worker
    ]


def test_a_sync_round_is_the_slowest_compute_then_the_all_reduce_then_the_broadcast(
    tmp_path, digits
):
    # 2 workers of 16 samples at 1 ms/sample: 16 and 48 ms of compute; free shards, free links
    s, run_dir = run(
        tmp_path,
        digits,
        "sync",
        "algorithm.name=sync",
        "cluster.workers=[{slowdown: 1}, {slowdown: 3}]",
        "cluster.shards=1",
        "stop.max_seconds=0.5",
        *FREE_SHARDS,
    )
    shard = s["shard_stats"]["ps0"]
    rounds = sum(shard["group_updates"].values())
    assert rounds > 5 and shard["pushes"] == shard["aggregated"] == rounds
    assert shard["contributions"] == 2 * rounds and shard["pushes_per_round"] == 1.0
    # one round: 48 ms of compute, the all-reduce of the gradient (and its 2 x 24 bytes of
    # clocks), then the broadcast of the shard's values: the costs sim/costs.py gives
    plan = json.loads((run_dir / "plan.json").read_text())
    nbytes = sum(4 * math.prod(shape) for _, _, shape, _ in plan["tensors"])
    links = [Link(), Link()]
    round_s = 0.048 + group_allreduce_s(nbytes + 48, links) + group_broadcast_s(nbytes, links)
    steps = steps_of(run_dir, 0)
    assert [r["t"] for r in steps[:3]] == pytest.approx(
        [round_s, 2 * round_s, 3 * round_s], rel=1e-3
    )
    assert steps_of(run_dir, 1)[0]["t"] == pytest.approx(round_s, rel=1e-3)
    # summary.json's `aggregation`, as a real run reports it: every member counts the round,
    # the one shard is pushed by member 0, so member 1 left one push to it per round
    agg = s["aggregation"]
    assert agg["group_rounds"] == 2 * rounds and agg["failures"] == agg["partial_rounds"] == 0
    w0, w1 = agg["workers"]["worker0"], agg["workers"]["worker1"]
    assert w0["group_size"] == w1["group_size"] == 2 and w0["aggregate"] and w1["aggregate"]
    assert w0["collective_pushes_saved"] == 0 and w1["collective_pushes_saved"] == rounds
    # each round's all-reduce and broadcast, charged to both (the last reply's broadcast may be
    # the only one after the last all-reduce: within one round)
    each = group_allreduce_s(nbytes + 48, links) + group_broadcast_s(nbytes, links)
    assert w1["collective_s"] == pytest.approx(rounds * each, abs=each)


def test_a_sync_run_is_the_same_run_with_aggregation_or_without(tmp_path, digits):
    """The same updates in the same order: the same model, to every digit of the loss."""
    runs = [
        run(
            tmp_path,
            digits,
            mode,
            "algorithm.name=sync",
            "cluster.workers=[{slowdown: 1}, {slowdown: 1}, {slowdown: 5}, {slowdown: 5}]",
            "cluster.shards=2",
            "stop.max_steps=200",
            "stop.max_seconds=100",
            "eval.every_s=100",
            f"comm.aggregate={mode}",
        )[0]
        for mode in ("on", "off")
    ]
    on, off = runs
    assert on["shard_versions"] == off["shard_versions"] == {"ps0": 50, "ps1": 50}
    assert on["final_loss"] == off["final_loss"] and on["final_accuracy"] == off["final_accuracy"]
    assert on["shard_stats"]["ps0"]["pushes"] == 50 and off["shard_stats"]["ps0"]["pushes"] == 200


def test_a_dead_member_leaves_the_others_training_after_the_re_plan(tmp_path, digits):
    s, run_dir = run(
        tmp_path,
        digits,
        "kill",
        "algorithm.name=sync",
        "cluster.workers={count: 4}",
        "cluster.kill=[{node: worker1, at_s: 0.3}]",
        "stop.max_seconds=1.5",
    )
    assert [f["node"] for f in s["failures"] if f["kind"] == "worker_dead"] == ["worker1"]
    assert s["plan_id"] >= 2
    last = {w: steps_of(run_dir, w)[-1]["t"] for w in range(4)}
    assert last[1] <= 0.3 < min(last[w] for w in (0, 2, 3)) and min(last[0], last[2]) > 1.0
    shard = s["shard_stats"]["ps0"]
    assert shard["aggregated"] > 0 and s["final_accuracy"] > 0.5


def test_re_grouping_keeps_every_contribution_once(tmp_path, digits):
    s, run_dir = run(
        tmp_path,
        digits,
        "regroup",
        "algorithm.name=grouping",
        "algorithm.regroup=true",
        "algorithm.regroup_every_s=0.2",
        "cluster.workers=[{slowdown: 1}, {slowdown: 1, schedule: [{at_s: 0.5, slowdown: 5}]},"
        " {slowdown: 5}, {slowdown: 5}]",
        "cluster.shards=1",
        "stop.max_seconds=3",
        *FREE_SHARDS,
    )
    assert s["plan_id"] >= 2  # the slowed worker moved groups
    shard = s["shard_stats"]["ps0"]
    assert shard["duplicates"] == 0 and shard["aggregated"] > 0
    # every worker step reached the shard once: in an aggregated push or its own
    assert shard["contributions"] + shard["pending"] == s["global_steps"]
    assert s["best_accuracy"] > 0.3  # it trained (chance: 0.1); 280 steps, the slow group's stale
