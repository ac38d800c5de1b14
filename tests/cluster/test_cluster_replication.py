"""Replicated shards on real processes (`cluster.replicas: 1`): a shard
killed with SIGKILL is not restarted; its backup, held by the other shard
process, is promoted and training goes on to the target."""

from __future__ import annotations

import json
import os
import signal
import traceback

import pytest
from cluster_util import (
    background_run,
    log_tails,
    records,
    shard_pid,
    summary,
    trained_to_after_replan,
    wait_for,
)

pytestmark = pytest.mark.cluster
DEAD_AFTER_S = 2.0
KILL_AT_STEPS = 30


@pytest.mark.parametrize(
    "config,killed,survivor",
    [("configs/sync.yaml", "ps1", "ps0"), ("configs/async.yaml", "ps0", "ps1")],
)
def test_a_killed_shard_fails_over_to_its_backup_without_a_restart(
    run_dir, config, killed, survivor
):
    # no target stop: a fast run could reach its target before the dead shard is noticed, and stop
    # without failing over; the test stops it (Ctrl-C) once the failover happened and two evaluations
    # in a row after it reached 90% (far above the ~0.1-0.45 at the kill: it trained on; 95% took
    # twice as long, on the plateau two workers climb slowly)
    with background_run(
        [
            config,
            "--out",
            str(run_dir),
            "--quiet",
            "cluster.replicas=1",
            "cluster.workers=2",
            f"cluster.dead_after_s={DEAD_AFTER_S}",
            "cluster.retry_s=0.5",
            "stop.target_accuracy=null",
            "eval.every_s=0.5",
            "stop.max_seconds=120",
            f"cluster.kill=[{{node: {killed}, at_s: 2.0}}]",
        ]
    ) as proc:
        try:
            wait_for(
                lambda: (
                    (run_dir / "metrics.jsonl").exists()
                    and trained_to_after_replan(run_dir, 0.9, held=2)
                ),
                120,
                "a failover, then 90% twice after it",
            )
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        except BaseException:
            raise AssertionError(f"{traceback.format_exc()}\n{log_tails(run_dir)}") from None
    assert proc.returncode == 130, err + log_tails(run_dir)
    assert "exited with" not in err, err + log_tails(run_dir)  # every worker went on
    kill = json.loads((run_dir / "faults.jsonl").read_text().splitlines()[0])
    assert (kill["action"], kill["node"]) == ("kill", killed)
    s = summary(run_dir)
    # 90% was reached after the failover (what the test waited for); the Ctrl-C lands at any point
    # after that, where an evaluation may still swing (seen under sync with two workers: 0.952, then a
    # final 0.892; async swings 10-20 points): the final model is a trained one, the best one is kept
    assert s["best_accuracy"] >= 0.9 and s["final_accuracy"] >= (
        0.85 if "sync" in config else 0.6
    ), s
    assert json.loads((run_dir / "best.json").read_text())["final_accuracy"] == s["best_accuracy"]
    # after the failover the dead shard held nobody up: its stall ended when its backup took over
    assert s["stalls"][killed]["held_s"] <= failover_after_kill_s(s, run_dir) + 1.0, s["stalls"]
    kinds = [(f["kind"], f.get("node")) for f in s["failures"]]
    assert ("shard_failover", killed) in kinds and not any(
        k == "shard_restarted" for k, _ in kinds
    ), kinds
    failover = next(f for f in s["failures"] if f["kind"] == "shard_failover")
    # the survivor serves the dead one's tensors
    assert list(failover["served_by"]) == [str(failover["node_id"])]
    # training went on within 2x dead-after of the kill: a step finished after it by then
    resumed = min(r["t"] for r in records(run_dir, "step") if r["t"] > failover["t"])
    assert resumed - kill["t"] <= 2 * DEAD_AFTER_S, (kill, failover, resumed)
    own = s["shard_stats"][survivor]
    backup = own["backup"]
    assert backup["role"] == "primary" and backup["of"] == failover["node_id"], backup
    # every acknowledged push was applied once on each range: both took the same pushes
    steps = s["global_steps"]
    workers = sum(1 for name in s["per_node"] if name.startswith("worker"))
    for accepted in (own["accepted"], backup["accepted"]):
        assert steps <= accepted <= steps + workers, (steps, own["accepted"], backup)
    # sync: one update per round on both (the round open at the stop may have closed on one only);
    # async: one per push, a push in flight per worker at most at the stop
    slack = 1 if config.endswith("sync.yaml") else workers
    assert abs(own["version"] - backup["version"]) <= slack, (own, backup)


def failover_after_kill_s(s: dict, run_dir) -> float:
    """Seconds from the kill to the failover (the dead shard's stall lasts that long at most)."""
    kill = json.loads((run_dir / "faults.jsonl").read_text().splitlines()[0])
    return next(f["t"] for f in s["failures"] if f["kind"] == "shard_failover") - kill["t"]


def test_grouping_fails_over_when_a_shard_is_killed_at_a_step_count(run_dir):
    """Grouping-SGD (a fast group of two, a slow one of one): ps1 is killed with
    SIGKILL once the workers recorded KILL_AT_STEPS steps (an event, not a time);
    its backup on ps0 takes over and both groups go on updating both ranges."""
    args = [
        "configs/default.yaml",
        "--out",
        str(run_dir),
        "--quiet",
        "cluster.replicas=1",
        "algorithm.groups=2",
        "algorithm.regroup=false",
        "cluster.workers=[{slowdown: 1}, {slowdown: 1}, {slowdown: 4}]",
        f"cluster.dead_after_s={DEAD_AFTER_S}",
        "cluster.retry_s=0.5",
        "stop.target_accuracy=null",
        "eval.every_s=1.0",
        "stop.max_seconds=8",
    ]
    with background_run(args) as proc:
        try:
            wait_for(
                lambda: (
                    (run_dir / "metrics.jsonl").exists()
                    and len(records(run_dir, "step")) >= KILL_AT_STEPS
                ),
                90,
                f"{KILL_AT_STEPS} training steps",
            )
            os.kill(shard_pid(run_dir, 1), signal.SIGKILL)
            _, err = proc.communicate(timeout=90)
        except BaseException:
            raise AssertionError(f"{traceback.format_exc()}\n{log_tails(run_dir)}") from None
    assert proc.returncode == 0, err + log_tails(run_dir)
    s = summary(run_dir)
    failover = next(f for f in s["failures"] if f["kind"] == "shard_failover")
    assert failover["node"] == "ps1" and list(failover["served_by"]) == [
        str(failover["node_id"])
    ], failover
    plan = json.loads((run_dir / "plan-1.json").read_text())
    assert len(plan["groups"]) == 2, plan
    # both groups stepped after the failover (each step is recorded with its worker's group)
    after = {r["group"] for r in records(run_dir, "step") if r["t"] > failover["t"]}
    assert after == {0, 1}, after
    ps0 = s["shard_stats"]["ps0"]
    backup = ps0["backup"]
    assert backup["role"] == "primary" and backup["of"] == failover["node_id"], backup
    steps, workers = s["global_steps"], 3
    # every acknowledged push applied once on each range
    for accepted in (ps0["accepted"], backup["accepted"]):
        assert steps <= accepted <= steps + workers, (steps, ps0["accepted"], backup)
    assert abs(ps0["version"] - backup["version"]) <= len(plan["groups"]), (ps0, backup)
