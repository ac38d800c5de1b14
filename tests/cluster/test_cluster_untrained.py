"""A run that trains nothing never says it completed, on real processes: a shard that
cannot build its lr schedule ends the run at once, named (exit 1, summary failed), and a
run stopped before any training step is failed with the reason. The config check that
refuses a schedule factory's wrong keywords before anything starts:
tests/unit/test_schedule_checks.py."""

from __future__ import annotations

import textwrap

from cluster_util import REPO, Daemons, log_tails, run_hetps, summary

from hetps.proto.messages import Stop
from hetps.proto.rpc import RpcClient

CONFIG = str(REPO / "configs" / "sync.yaml")
SMALL = ["cluster.workers=2", "cluster.shards=1", "cluster.profile_steps=2"]
FAILURE_WAIT_S = 10.0  # from the shard's failure report to the end of the run, at most

# a schedule that cannot be built in a shard daemon (`--scheduler` on its command line, the
# shard's module first: `hetps.ps` forked, .../ps/__main__.py exec'd), as one reading a file
# only the shards' hosts lack: the config check, the workers' own check and the dry step pass
# (a worker failing too would race the shard to be the run's named failure)
SHARD_ONLY = """
import os
import sys
import torch

def cosine(optimizer, t_max):
    shard = sys.argv[0] == "hetps.ps" or sys.argv[0].endswith(os.path.join("ps", "__main__.py"))
    if "--scheduler" in sys.argv and shard:
        raise FileNotFoundError("/nonexistent/schedule.json")
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=t_max)
"""


def test_a_shard_that_cannot_build_its_schedule_ends_the_run_naming_it(run_dir, tmp_path):
    (tmp_path / "shardsched.py").write_text(textwrap.dedent(SHARD_ONLY))
    result = run_hetps(
        [
            "run",
            CONFIG,
            *SMALL,
            "optimizer.schedule.name=shardsched:cosine",
            "optimizer.schedule.kwargs={t_max: 5}",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=120,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 1, result.stderr + log_tails(run_dir)
    first = result.stderr.strip().splitlines()[0]
    assert first.startswith("hetps run: ps0 failed: "), result.stderr
    assert "optimizer.schedule.name 'shardsched:cosine'" in first, first
    assert "FileNotFoundError: /nonexistent/schedule.json" in first, first
    s = summary(run_dir)
    assert (s["status"], s["failed_node"], s["global_steps"]) == ("failed", "ps0", 0), s
    (failure,) = [f for f in s["failures"] if f["kind"] == "startup_failed"]
    assert failure["node"] == "ps0" and "schedule.json" in failure["error"], failure
    assert s["wall_s"] - failure["t"] < FAILURE_WAIT_S, s  # not the time limit (240 s)


def test_a_run_stopped_before_any_training_step_failed(tmp_path):
    run_dir = tmp_path / "run"
    daemons = Daemons(tmp_path, SMALL)
    try:
        address = daemons.scheduler(CONFIG, run_dir)
        # no node registered yet: the run stops with 0 steps
        ctl = RpcClient(address, timeout_s=30)
        try:
            assert ctl.call(Stop(reason="stopped by the test")).stop
        finally:
            ctl.close()
        (code,) = daemons.wait(30)
    finally:
        daemons.close()
    assert code == 1, daemons.tails()
    s = summary(run_dir)
    why = "no training step was taken before the run stopped (stopped by the test)"
    assert (s["status"], s["detail"], s["global_steps"]) == ("failed", why, 0), s
    assert [f["kind"] for f in s["failures"]] == ["no_steps"], s["failures"]
