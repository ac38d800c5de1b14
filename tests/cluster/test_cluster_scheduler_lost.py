"""Daemons started by hand whose scheduler dies for good: after
cluster.scheduler_grace_s every shard, worker and evaluator exits with
status 3 and a message naming the lost scheduler's address; the shard writes
a last checkpoint first. Real processes on loopback, the scheduler killed
with SIGKILL once training runs."""

from __future__ import annotations

import os
import signal

import pytest
from cluster_util import REPO, Daemons, processes_mentioning, records, wait_for

from hetps.runtime import checkpoint

pytestmark = pytest.mark.cluster

GRACE_S = 4.0


def test_daemons_exit_3_naming_the_scheduler_once_it_is_lost(tmp_path):
    run_dir, ckpt = tmp_path / "run", tmp_path / "checkpoints"
    run_dir.mkdir()
    config = str(REPO / "configs" / "sync.yaml")
    # checkpoints only at INIT and on the way out: a version above 0 on disk is the last one
    overrides = [
        "cluster.workers=1",
        "cluster.shards=1",
        "stop.target_accuracy=null",
        "stop.max_seconds=300",
        "eval.every_s=0.5",
        "cluster.heartbeat_s=0.25",
        f"cluster.scheduler_grace_s={GRACE_S}",
        f"checkpoint.dir={ckpt}",
        "checkpoint.every_s=0",
        "checkpoint.every_updates=0",
    ]
    daemons = Daemons(tmp_path, overrides)
    try:
        address = daemons.scheduler(config, run_dir)
        daemons.start(["ps", "--config", config, "--rank", "0", "--scheduler", address])
        daemons.start(["worker", "--config", config, "--rank", "0", "--scheduler", address])
        daemons.start(["worker", "--config", config, "--evaluator", "--scheduler", address])
        wait_for(
            lambda: (run_dir / "metrics.jsonl").exists() and records(run_dir, "eval"),
            120,
            "training",
        )
        os.killpg(daemons.procs[0].pid, signal.SIGKILL)
        daemons.procs[0].wait(timeout=10)
        codes = [p.wait(timeout=60) for p in daemons.procs[1:]]
    finally:
        daemons.close()
    assert codes == [3, 3, 3], daemons.tails()
    for i, role in ((1, "ps 0"), (2, "worker 0"), (3, "evaluator 0")):
        log = (tmp_path / f"{i}.log").read_text()
        assert f"hetps {role}: lost the scheduler at {address}" in log, log[-2000:]
        assert "exiting with status 3" in log
    (folder,) = [p for p in ckpt.rglob("ps0") if p.is_dir()]
    newest, _ = checkpoint.checkpoints(folder)[-1]
    assert newest > 0, "no last checkpoint written on the way out"
    assert not processes_mentioning(str(tmp_path))
