"""Recovery on real processes: a shard killed with SIGKILL and restarted
resumes from its checkpoint; a stopped run continues with `hetps run
--resume`; the scheduler restarts under a training cluster; dropped and
delayed messages are recovered by retries."""

from __future__ import annotations

import json
import os
import signal

import pytest
from cluster_util import (
    HELD,
    REPO,
    Daemons,
    assert_reached_target,
    log_tails,
    processes_mentioning,
    records,
    run_hetps,
    summary,
    wait_for,
)

pytestmark = pytest.mark.cluster


def faults(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()]


def test_killed_shard_restarts_from_its_checkpoint_and_the_run_reaches_target(run_dir):
    result = run_hetps(
        [
            "run",
            "configs/sync.yaml",
            "--out",
            str(run_dir),
            "--quiet",
            # four workers, as configs/sync.yaml, and a checkpoint every 10 updates: the restored
            # shard's half of the model is at most ~10 updates behind the other's. On two workers
            # (batch 64 a round), or 25 updates apart, the older half has been seen to diverge the
            # run to chance after the restart
            "checkpoint.every_updates=10",
            "cluster.retry_s=0.5",
            # a target far above the accuracy at the kill (~0.3-0.4 at 160 steps; the restored
            # version holds less): the run trained on after the restart. Evaluated every
            # second, the second evaluation at it comes soon after the first
            "stop.target_accuracy=0.9",
            "eval.every_s=1.0",
            HELD,
            "stop.max_seconds=150",
            # by step, not by seconds: 160 step records of 4 workers in sync are 40 rounds, past
            # several checkpoints however slowly a loaded machine trains
            "cluster.kill=[{node: ps1, at_step: 160, restart_after_s: 1}]",
        ],
        timeout_s=240,
    )
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    assert "fault injection: killing ps1 at step" in result.stderr
    kill, restart = faults(run_dir)
    assert (kill["action"], kill["node"], restart["action"]) == ("kill", "ps1", "restart")
    assert kill["steps"] >= 160
    assert kill["checkpoint_version"] is not None and kill["checkpoint_version"] >= 20
    s = summary(run_dir)
    ps1 = s["shard_stats"]["ps1"]
    assert ps1["restored_version"] == kill["checkpoint_version"]  # resumed at the version on disk
    assert ps1["version"] > ps1["restored_version"]  # and trained on from there
    assert [f["node"] for f in s["failures"] if f["kind"] == "shard_restarted"] == ["ps1"]
    assert_reached_target(s, 0.9)
    assert "restored version" in (run_dir / "logs" / "ps1.log").read_text()


def test_resume_continues_a_stopped_run_from_consistent_checkpoints(run_dir):
    first = run_hetps(
        [
            "run",
            "configs/sync.yaml",
            "--out",
            str(run_dir),
            "--quiet",
            # two workers: as many updates as four's 200 steps for half the gradients (the
            # checkpoints are the same two shards'; the steps each worker makes are not checked)
            "cluster.workers=2",
            "stop.target_accuracy=null",
            "stop.max_steps=100",
            "stop.max_seconds=120",
        ],
        timeout_s=200,
    )
    assert first.returncode == 0, first.stderr + log_tails(run_dir)
    stopped = summary(run_dir)
    versions = stopped["shard_versions"]
    assert len(set(versions.values())) == 1 and min(versions.values()) > 0, versions
    accuracy_before = stopped["final_accuracy"]

    resumed = run_hetps(
        # max_steps counts the whole run: 160 more steps
        ["run", "--resume", str(run_dir), "stop.max_steps=260", "stop.target_accuracy=null"],
        timeout_s=200,
    )
    assert resumed.returncode == 0, resumed.stderr + log_tails(run_dir)
    assert "resuming run" in resumed.stderr
    s = summary(run_dir)
    for name, v in versions.items():
        # resumed at the checkpointed versions
        assert s["shard_stats"][name]["restored_version"] == v
        assert s["shard_versions"][name] > v  # and went on from them
    # a continuation, not a restart from scratch: the first evaluation is already trained
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resumed_at = [i for i, r in enumerate(lines) if r["kind"] == "plan" and r["plan_id"] == 1][1]
    first_after_resume = next(r for r in lines[resumed_at:] if r["kind"] == "eval")
    assert first_after_resume["accuracy"] >= accuracy_before - 0.05, (
        first_after_resume,
        accuracy_before,
    )
    # 260 steps of two workers in sync in all (130 updates): four workers' 300 steps (75 updates)
    # once ended at 0.892, too close to the bar
    assert s["final_accuracy"] >= 0.9


def test_resume_without_checkpoints_is_a_clear_error(tmp_path):
    result = run_hetps(["run", "--resume", str(tmp_path)], timeout_s=60)
    assert result.returncode == 2 and "config.yaml: cannot read" in result.stderr
    (tmp_path / "config.yaml").write_text((REPO / "configs" / "sync.yaml").read_text())
    result = run_hetps(["run", "--resume", str(tmp_path)], timeout_s=60)
    assert result.returncode == 2
    assert "cannot resume" in result.stderr and "scheduler-state.json" in result.stderr


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_training_goes_on_through_a_scheduler_restart(tmp_path):
    run_dir = tmp_path / "run"
    config = str(REPO / "configs" / "sync.yaml")
    overrides = [
        "cluster.workers=2",
        "cluster.shards=1",
        "stop.target_accuracy=null",
        "stop.max_seconds=120",
        "eval.every_s=1.0",
        "cluster.heartbeat_s=0.25",
    ]
    daemons = Daemons(tmp_path, overrides)
    address = f"tcp://127.0.0.1:{free_port()}"
    scheduler_args = ["scheduler", "--config", config, "--bind", address, "--run-dir", str(run_dir)]
    try:
        daemons.start(scheduler_args)
        daemons.start(["ps", "--config", config, "--rank", "0", "--scheduler", address])
        for rank in range(2):
            daemons.start(
                ["worker", "--config", config, "--rank", str(rank), "--scheduler", address]
            )
        daemons.start(["worker", "--config", config, "--evaluator", "--scheduler", address])
        wait_for(
            lambda: (run_dir / "metrics.jsonl").exists() and records(run_dir, "eval"),
            90,
            "training",
        )
        os.killpg(daemons.procs[0].pid, signal.SIGKILL)
        daemons.procs[0].wait(timeout=10)
        steps_at_kill = max(r["global_steps"] for r in records(run_dir, "eval"))
        daemons.start(scheduler_args)  # same address, same run directory: it carries the run on
        wait_for(
            lambda: any(
                r["global_steps"] > steps_at_kill + 50 and r["accuracy"] >= 0.9
                for r in records(run_dir, "eval")
            ),
            90,
            "50 more steps and 90% after the restart",
        )
        daemons.procs[-1].send_signal(signal.SIGTERM)  # the new scheduler stops the run cleanly
        codes = daemons.wait(120)
    finally:
        daemons.close()
    assert codes[1:] == [0] * (len(codes) - 1), daemons.tails()
    s = summary(run_dir)
    assert s["stop_reason"] == "interrupted", s["stop_reason"]
    assert s["global_steps"] > steps_at_kill + 50, (s["global_steps"], steps_at_kill)
    # the final evaluation comes some updates after the one at 90%: at that point of the curve two sync
    # workers swing by points (0.903 then 0.866 seen in another test); 0.85 is the trained model
    assert s["final_accuracy"] >= 0.85, s
    assert not [f for f in s["failures"] if f["kind"].endswith("_dead")], s["failures"]
    assert "carrying on run" in (tmp_path / f"{len(daemons.procs) - 1}.log").read_text()
    assert not processes_mentioning(str(tmp_path))


def test_dropped_and_delayed_messages_are_retried_and_the_run_reaches_target(run_dir):
    result = run_hetps(
        [
            "run",
            "configs/sync.yaml",
            "--out",
            str(run_dir),
            "--quiet",
            "cluster.workers=2",
            "cluster.faults.drop=0.02",
            "cluster.faults.delay=0.05",
            "cluster.faults.delay_s=0.02",
            "cluster.retry_s=0.2",
            # far above chance (two workers are at ~0.6 after 65 steps): the run trained through
            # the faults; hundreds of messages by then, a few of them dropped
            "stop.target_accuracy=0.85",
            "eval.every_s=1.0",
            "stop.max_seconds=150",
        ],
        timeout_s=240,
    )
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    s = summary(run_dir)
    assert s["time_to_target_s"] is not None, s
    resent = sum(v.get("resent", 0) for v in s["per_node"].values())
    dropped = sum(v.get("dropped", 0) for v in s["per_node"].values())
    assert dropped > 0 and resent >= dropped, s["per_node"]
