"""A sparse table under replication on real processes (`cluster.replicas: 1`):
the byte-level language model (configs/charlm.yaml) with its token embedding
served row by row on 2 shards under async; ps0 is killed with SIGKILL at a
step, its backup (held by ps1's process) is promoted, and the workers' row
exchanges follow it. The run completes, and no acknowledged row update was
lost: every step pushes one PUSH_ROWS to every shard (empty where it touched
none of its rows) and completes only once all are acknowledged, and under
async each applied push is one update; so the promoted backup, which replayed
ps0's pushes up to the kill and took the rest, counts exactly the workers'
steps, as the surviving ps1 does (up to one last push per worker that the
stop left without a counted step)."""

from __future__ import annotations

import json

import pytest
from cluster_util import REPO, log_tails, run_hetps, summary

pytestmark = pytest.mark.cluster
WORKERS = 2
KILL_AT_STEP = 40
MAX_STEPS = 100  # 60 steps after the kill: the failover, then steps on the promoted backup


def test_a_killed_shard_loses_no_acknowledged_row_update(run_dir, tmp_path):
    done = run_hetps(
        [
            "run",
            str(REPO / "configs" / "charlm.yaml"),
            "algorithm.name=async",
            "sparse.tables=[tokens]",
            "sparse.optimizer.name=adam",
            "sparse.optimizer.lr=0.003",
            "cluster.shards=2",
            f"cluster.workers={WORKERS}",
            "cluster.replicas=1",
            "cluster.dead_after_s=2.0",
            "cluster.retry_s=0.5",
            "stop.target=null",
            f"stop.max_steps={MAX_STEPS}",
            "stop.max_seconds=200",
            "eval.every_s=30",
            f"cluster.kill=[{{node: ps0, at_step: {KILL_AT_STEP}}}]",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=400,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr + log_tails(run_dir)
    kill = json.loads((run_dir / "faults.jsonl").read_text().splitlines()[0])
    assert (kill["action"], kill["node"]) == ("kill", "ps0")
    s = summary(run_dir)
    assert s["status"] == "completed", s
    assert ("shard_failover", "ps0") in [(f["kind"], f.get("node")) for f in s["failures"]], s[
        "failures"
    ]
    steps = s["global_steps"]
    assert steps >= MAX_STEPS, s
    survivor = s["shard_stats"]["ps1"]
    promoted = survivor["backup"]
    assert promoted["role"] == "primary", promoted  # ps0's tables are served from ps1's process
    # the steps after the failover reached the promoted backup
    assert promoted["row_pushes"] > KILL_AT_STEP, promoted
    # one update per applied row push; a step counts once all its pushes were acknowledged, so
    # nothing acknowledged was lost when applied >= steps on the promoted backup as on the
    # survivor. A worker's last row push may be applied without its step counting (the stop
    # came before its dense push), one per worker at most; a push re-sent after the kill and
    # applied twice would show as more.
    for shard in (survivor, promoted):
        assert steps <= shard["sparse_updates"] <= steps + WORKERS, (shard, steps)
