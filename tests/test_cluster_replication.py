"""Replicated shards on real processes (`cluster.replicas: 1`): a shard
killed with SIGKILL is not restarted; its backup, held by the other shard
process, is promoted and training goes on to the target."""
from __future__ import annotations

import json

import pytest

from cluster_util import assert_reached_target, log_tails, records, run_hetps, summary

pytestmark = pytest.mark.cluster
DEAD_AFTER_S = 2.0


def test_a_killed_shard_fails_over_to_its_backup_without_a_restart(run_dir):
    result = run_hetps(["run", "configs/sync.yaml", "--out", str(run_dir), "--quiet", "cluster.replicas=1",
                        "cluster.workers=2", f"cluster.dead_after_s={DEAD_AFTER_S}", "cluster.retry_s=0.5",
                        "stop.target_accuracy=0.95",
                        "stop.max_seconds=120", "cluster.kill=[{node: ps1, at_s: 2.0}]"], timeout_s=240)
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    assert "exited with" not in result.stderr, result.stderr + log_tails(run_dir)  # every worker went on
    kill = json.loads((run_dir / "faults.jsonl").read_text().splitlines()[0])
    assert (kill["action"], kill["node"]) == ("kill", "ps1")
    s = summary(run_dir)
    assert_reached_target(s, 0.95)
    kinds = [(f["kind"], f.get("node")) for f in s["failures"]]
    assert ("shard_failover", "ps1") in kinds and not any(k == "shard_restarted" for k, _ in kinds), kinds
    failover = next(f for f in s["failures"] if f["kind"] == "shard_failover")
    assert list(failover["served_by"]) == [str(failover["node_id"])]   # ps0's process serves ps1's tensors
    # training went on within 2x dead-after of the kill: a step finished after it by then
    resumed = min(r["t"] for r in records(run_dir, "step") if r["t"] > failover["t"])
    assert resumed - kill["t"] <= 2 * DEAD_AFTER_S, (kill, failover, resumed)
    ps0 = s["shard_stats"]["ps0"]
    backup = ps0["backup"]
    assert backup["role"] == "primary" and backup["of"] == failover["node_id"], backup
    # every acknowledged push was applied once on each range: both took the same pushes
    steps = s["global_steps"]
    workers = sum(1 for name in s["per_node"] if name.startswith("worker"))
    for accepted in (ps0["accepted"], backup["accepted"]):
        assert steps <= accepted <= steps + workers, (steps, ps0["accepted"], backup)
    # sync: one update per round on both (the round open at the stop may have closed on one only)
    assert abs(ps0["version"] - backup["version"]) <= 1, (ps0, backup)
