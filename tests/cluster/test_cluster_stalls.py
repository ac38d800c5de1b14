"""Stall attribution on real processes: a worker 10x slower than the others
is named within two heartbeats, for compute; a worker stopped with SIGSTOP
is named as unresponsive before the scheduler declares it dead."""

from __future__ import annotations

import os
import signal

import pytest
from cluster_util import (
    background_run,
    log_tails,
    records,
    run_hetps,
    summary,
    wait_for,
    worker_pid,
)

pytestmark = [pytest.mark.cluster, pytest.mark.exclusive]  # stalls named within heartbeat periods
HB = 1.0  # cluster.heartbeat_s
SLACK_S = 1.0  # upper bound on a loaded machine's scheduling delay on top of two heartbeats


def test_a_ten_times_slower_worker_is_named_within_two_heartbeats(run_dir):
    proc = run_hetps(
        [
            "run",
            "configs/sync.yaml",
            "cluster.workers=[{slowdown: 1}, {slowdown: 1}, {slowdown: 10}]",
            "cluster.shards=1",
            f"cluster.heartbeat_s={HB}",
            "stop.target_accuracy=null",
            "stop.max_seconds=6",
            "eval.every_s=3.0",
            "--out",
            str(run_dir),
        ],
        timeout_s=240,
    )
    assert proc.returncode == 0, proc.stderr + log_tails(run_dir)
    first_step = min(r["t"] for r in records(run_dir, "step"))
    named = [r for r in records(run_dir, "stall") if r["node"] == "worker2"]
    assert named, records(run_dir, "stall")
    assert named[0]["t"] - first_step <= 2 * HB + SLACK_S, (first_step, named[0])
    assert {(r["reason"], r["waiting"]) for r in named} == {("compute", 2)}, named
    stalls = summary(run_dir)["stalls"]
    wall = summary(run_dir)["wall_s"]
    assert stalls["worker2"]["held_s"] >= 0.5 * (wall - first_step), (wall, stalls)
    assert stalls["worker2"]["shard_held_s"] > 0, stalls
    others = sum(v["held_s"] for n, v in stalls.items() if n != "worker2")
    assert others <= 0.2 * stalls["worker2"]["held_s"], stalls


def test_a_stopped_worker_is_named_unresponsive_before_it_is_declared_dead(run_dir):
    dead_after_s = 6.0  # unresponsive after min(3 heartbeats, dead_after_s / 2) = 1.5 s of silence
    with background_run(
        [
            "configs/sync.yaml",
            "cluster.workers=3",
            "cluster.shards=1",
            "cluster.heartbeat_s=0.5",
            f"cluster.dead_after_s={dead_after_s}",
            "stop.target_accuracy=null",
            "stop.max_seconds=60",
            "eval.every_s=3.0",
            "--out",
            str(run_dir),
            "--quiet",
        ]
    ) as proc:
        wait_for(
            lambda: (
                (run_dir / "metrics.jsonl").exists()
                and any(r["worker"] == 2 and r["step"] >= 5 for r in records(run_dir, "step"))
            ),
            120,
            "worker2 training",
        )
        pid = worker_pid(run_dir, 2)
        os.kill(pid, signal.SIGSTOP)
        try:
            replan = wait_for(
                lambda: [r for r in records(run_dir, "plan") if r["plan_id"] > 1],
                60,
                "the re-plan without worker2",
            )[0]
        finally:
            os.kill(pid, signal.SIGKILL)  # a stopped process dies on SIGKILL; the launcher reaps it
        wait_for(
            lambda: any(r["t"] > replan["t"] + 1.0 for r in records(run_dir, "step")),
            60,
            "training after the re-plan",
        )
        os.kill(proc.pid, signal.SIGINT)  # a clean stop
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err + log_tails(run_dir)
    named = [r for r in records(run_dir, "stall") if r["node"] == "worker2"]
    unresponsive = [r for r in named if r["reason"] == "unresponsive"]
    assert unresponsive and unresponsive[0]["t"] < replan["t"], (named, replan)
    assert unresponsive[0]["waiting"] == 2, unresponsive
    dead = [f for f in summary(run_dir)["failures"] if f["kind"] == "worker_dead"]
    assert [f["node"] for f in dead] == ["worker2"] and unresponsive[0]["t"] < dead[0]["t"], (
        dead,
        named,
    )
    # the re-plan ended the stall
    assert any(r["ended"] and r["t"] >= replan["t"] for r in named), named
    assert summary(run_dir)["stalls"]["worker2"]["by_reason"]["unresponsive"] > 0
