"""Several shard ranks in one process (cluster.shard_processes) in a real `hetps run`
over the local run's unix sockets (comm.local_transport: ipc); the in-process
checks are in tests/inproc/test_colocated.py."""

from __future__ import annotations

import json

from cluster_util import log_tails, run_hetps, summary


def test_hetps_run_serves_both_shards_from_one_process_over_ipc(run_dir):
    """`hetps run` with cluster.shard_processes: 1: one shard process (ps0-1) serves
    ranks 0 and 1, each on its own unix socket in the run directory, and both
    apply pushes while sync training reaches a modest accuracy."""
    result = run_hetps(
        [
            "run",
            "configs/sync.yaml",
            "cluster.shard_processes=1",
            "cluster.workers=2",
            "stop.target_accuracy=0.85",
            "stop.max_seconds=60",
            "eval.every_s=1.0",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=120,
    )
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    s = summary(run_dir)
    assert s["best_accuracy"] >= 0.85 and s["failures"] == [] and s["not_left"] == [], s
    assert all(s["shard_stats"][f"ps{r}"]["pushes"] > 0 for r in (0, 1)), s["shard_stats"]
    # sync: both ranks took every round
    assert s["shard_versions"]["ps0"] == s["shard_versions"]["ps1"] > 0
    logs = {p.stem for p in (run_dir / "logs").glob("ps*.log")}
    assert logs == {"ps0-1"}, logs
    sockets = (run_dir / "sockets").resolve()
    plan = json.loads((run_dir / "plan.json").read_text())
    assert sorted(sh["address"] for sh in plan["shards"]) == [
        f"ipc://{sockets}/ps0",
        f"ipc://{sockets}/ps1",
    ]
    assert (run_dir / "scheduler.addr").read_text().strip() == f"ipc://{sockets}/scheduler"
