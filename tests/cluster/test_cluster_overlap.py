"""`comm.overlap` with real daemons: sync training with overlapped pushes and
pulls, one tensor cut over both shards (overlap on and off against each other
in one process: tests/inproc/test_overlap.py)."""

from __future__ import annotations

import json

from cluster_util import HELD, assert_reached_target, log_tails, records, run_hetps, summary


def test_cluster_with_overlap_and_chunks_trains(run_dir):
    """Real daemons: sync with `comm.overlap`, one tensor cut over both shards."""
    # 4 KiB parts: wherever the shards' measured speeds put the boundary (but at a ratio of 4.35-4.85,
    # the edge between fc1 and fc2), a tensor is cut across it; with 40 kB, any ratio above 3.1 put none
    result = run_hetps(
        [
            "run",
            "configs/sync.yaml",
            "comm.overlap=true",
            "cluster.chunk_bytes=4096",
            "cluster.workers=2",
            "stop.target_accuracy=0.92",
            HELD,
            "stop.max_seconds=120",
            "eval.every_s=1.0",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=200,
    )
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    s = summary(run_dir)
    assert_reached_target(s, 0.92)
    assert s["failures"] == [] and s["not_left"] == []
    steps = records(run_dir, "step")
    assert {r["worker"] for r in steps} == {0, 1} and all("wait_s" in r for r in steps)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert any(
        len({plan["placement"][p] for p in c["parts"]}) == 2 for c in plan["chunks"].values()
    ), plan["shards"]
