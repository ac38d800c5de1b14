"""A shard killed with SIGKILL and restarted from its checkpoint
(`cluster.replicas: 0`) under async (one update per push) and cpsgd (model
averaging), on real processes: the run ends cleanly, the shard resumed at
the checkpointed version and trained on from it. (sync, to the target:
test_cluster_recovery.py. Every policy serving workers ahead of its restored
checkpoint, in one process: test_recovery.py; the restart path is the
launcher's and the same for every algorithm.)"""

from __future__ import annotations

import json

import pytest
from cluster_util import log_tails, run_hetps, summary

pytestmark = pytest.mark.cluster

CONFIGS = {"async": "configs/async.yaml", "cpsgd": "configs/cpsgd.yaml"}


@pytest.mark.parametrize("algorithm", list(CONFIGS))
def test_a_killed_shard_restarts_from_its_checkpoint_under(algorithm, run_dir):
    result = run_hetps(
        [
            "run",
            CONFIGS[algorithm],
            "--out",
            str(run_dir),
            "--quiet",
            "cluster.workers=2",
            "checkpoint.every_updates=10",
            "cluster.retry_s=0.5",
            "stop.target_accuracy=null",
            # a time limit well past the restart (~0.6 s after the kill; the restarted shard
            # serves within a second of it): a step limit may be reached before it (cpsgd's
            # local steps run at hundreds per second)
            "stop.max_seconds=4.5",
            "cluster.kill=[{node: ps1, at_s: 1.0, restart_after_s: 0.5}]",
        ],
        timeout_s=200,
    )
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    kill, restart = (
        json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()
    )
    assert (kill["action"], restart["action"]) == ("kill", "restart")
    s = summary(run_dir)
    assert s["algorithm"] == algorithm and s["stop_reason"].startswith("time limit"), s[
        "stop_reason"
    ]
    ps1 = s["shard_stats"]["ps1"]
    assert ps1["restored_version"] == kill["checkpoint_version"]  # resumed at the version on disk
    assert ps1["version"] > ps1["restored_version"]  # and trained on from there
    assert [f["node"] for f in s["failures"] if f["kind"] == "shard_restarted"] == ["ps1"]
