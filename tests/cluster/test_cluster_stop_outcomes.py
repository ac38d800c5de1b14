"""How a run ends, on real processes: a scheduler killed while the run stops
and restarted at its address finishes that stop instead of waiting for a
time limit; one worker pushing NaN gradients under `cluster.nonfinite: skip`
does not end the run as diverged. In one process:
tests/inproc/test_coordinator_stop.py."""

from __future__ import annotations

import os
import signal
import socket

from cluster_util import HELD, REPO, Daemons, records, summary, wait_for

from hetps.proto.messages import Stop
from hetps.proto.rpc import RpcClient

SUPPORT = REPO / "tests" / "support"
CONFIG = str(REPO / "configs" / "sync.yaml")


def free_port() -> int:
    """A port to bind the scheduler on, so that its restart can bind the same one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_scheduler_killed_as_the_run_stops_finishes_the_stop_once_restarted(tmp_path):
    """The stop is decided (a STOP request here: its ACK says when, to the
    millisecond, where a target or a step limit would be seen only by polling
    the run log, while the nodes may already be leaving) and the scheduler is
    SIGKILLed at once: some nodes may have heard the stop, some not. The
    scheduler restarted at the same address with the same run directory
    carries that stop on: the run ends for the same reason, every daemon
    exits 0, long before the time limit."""
    run_dir = tmp_path / "run"
    max_seconds = 120
    daemons = Daemons(
        tmp_path,
        [
            "cluster.workers=2",
            "cluster.shards=1",
            "stop.target_accuracy=null",
            f"stop.max_seconds={max_seconds}",
            "eval.every_s=0.5",
            "cluster.heartbeat_s=0.25",
        ],
    )
    address = f"tcp://127.0.0.1:{free_port()}"
    scheduler = ["scheduler", "--config", CONFIG, "--bind", address, "--run-dir", str(run_dir)]
    reason = "test stop: the scheduler is killed now"
    ctl = RpcClient(address, timeout_s=30)
    try:
        daemons.start(scheduler)
        daemons.start(["ps", "--config", CONFIG, "--rank", "0", "--scheduler", address])
        for rank in range(2):
            daemons.start(
                ["worker", "--config", CONFIG, "--rank", str(rank), "--scheduler", address]
            )
        daemons.start(["worker", "--config", CONFIG, "--evaluator", "--scheduler", address])
        wait_for(
            lambda: (run_dir / "metrics.jsonl").exists() and records(run_dir, "eval"),
            120,
            "training",
        )
        assert ctl.call(Stop(reason=reason)).stop
        os.killpg(daemons.procs[0].pid, signal.SIGKILL)
        daemons.procs[0].wait(timeout=10)
        daemons.start(scheduler)  # same address, same run directory: it carries the stop on
        codes = daemons.wait(60)
    finally:
        ctl.close()
        daemons.close()
    assert codes[1:] == [0] * (len(codes) - 1), daemons.tails()
    (stop,) = records(run_dir, "stop")
    assert stop["reason"] == reason, stop
    s = summary(run_dir)
    assert (s["status"], s["stop_reason"]) == ("completed", reason), s
    assert s["wall_s"] < stop["t"] + 30 < max_seconds, (s["wall_s"], stop)
    assert not [f for f in s["failures"] if f["kind"].endswith("_dead")], s["failures"]
    restarted = (tmp_path / f"{len(codes) - 1}.log").read_text()
    assert "carrying on run" in restarted and "carrying on the stop" in restarted, restarted


def test_one_worker_pushing_nan_under_skip_does_not_end_the_run_as_diverged(tmp_path):
    """Sync, two workers, `cluster.nonfinite: skip`; worker 1's training loss
    and gradients are NaN from its 60th step on (support/nan_model.py). The
    shards skip its pushes, the model trains on worker 0's gradients, and the
    run reaches the target: completed, exit 0, worker 1's NaN losses counted
    in the summary."""
    run_dir = tmp_path / "run"
    daemons = Daemons(
        tmp_path,
        [
            "model.name=nan_model:lenet5_nan_when_told",
            "cluster.workers=2",
            "cluster.shards=1",
            "cluster.nonfinite=skip",
            "stop.target_accuracy=0.9",
            HELD,
            "stop.max_seconds=150",
            "eval.every_s=1.0",
        ],
    )
    path = os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path}
    try:
        address = daemons.scheduler(CONFIG, run_dir)
        daemons.start(["ps", "--config", CONFIG, "--rank", "0", "--scheduler", address], env=env)
        daemons.start(
            ["worker", "--config", CONFIG, "--rank", "0", "--scheduler", address], env=env
        )
        daemons.start(
            ["worker", "--config", CONFIG, "--rank", "1", "--scheduler", address],
            env={**env, "HETPS_TEST_NAN_AFTER": "60"},
        )
        daemons.start(
            ["worker", "--config", CONFIG, "--evaluator", "--scheduler", address], env=env
        )
        codes = daemons.wait(200)
    finally:
        daemons.close()
    s = summary(run_dir)
    assert codes == [0] * len(codes), daemons.tails()
    assert s["status"] == "completed" and s["detail"] is None, s
    assert s["stop_reason"].startswith("target accuracy 0.9 reached"), s["stop_reason"]
    # the final model is the one measured after the stop, a few updates past the target's
    # evaluation (it swings by a point or two); NaN applied to it would leave it at chance (~0.1)
    assert s["final_accuracy"] >= 0.8, s
    # worker 1 went on stepping with NaN: its pushes skipped, its losses counted
    assert s["per_node"]["worker1"]["steps"] > 60, s["per_node"]
    assert s["nonfinite_losses"]["worker1"] >= s["per_node"]["worker1"]["steps"] - 61 > 0, s
    assert "worker0" not in s["nonfinite_losses"], s["nonfinite_losses"]
    assert s["shard_stats"]["ps0"]["nonfinite"] > 0, s["shard_stats"]
