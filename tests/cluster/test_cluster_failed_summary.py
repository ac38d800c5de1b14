"""A run `hetps run` marks failed keeps what the scheduler knew: a shard that
dies in training (SIGKILL from outside, not `cluster.kill`: a crash) fails
the run, and its summary.json holds the scheduler's own fields (steps,
traffic, evaluations, the failures with their causes), not only the launcher's
verdict. The scheduler's stop is a long one here: it waits for the nodes to
leave, the dead shard until it is declared dead (`cluster.dead_after_s`,
longer than the launcher's wait for the other processes), before it writes
its summary, and the launcher waits for it. Real processes on loopback, the
real mnist-5k digits."""

from __future__ import annotations

import os
import signal

import pytest
from cluster_util import background_run, log_tails, records, shard_pid, summary, wait_for

from hetps.frontend.launcher import REAP_WAIT_S
from hetps.scheduler.coordinator import EXIT_GRACE_S

pytestmark = pytest.mark.cluster

RUN_S = 240.0
# the scheduler's stop waits this long for the dead shard, then ends with everyone gone: the
# least the test's first assertion allows, 1 s over the launcher's wait for the others (+ 5 s)
DEAD_AFTER_S = REAP_WAIT_S + 6.0
STEPS_BEFORE_KILL = 20


def test_a_run_failed_by_a_dead_shard_keeps_the_schedulers_summary(run_dir):
    assert REAP_WAIT_S + 5.0 < DEAD_AFTER_S < EXIT_GRACE_S - 5.0
    args = [
        "configs/async.yaml",
        "cluster.workers=2",
        "cluster.shards=2",
        "cluster.profile_steps=2",
        f"cluster.dead_after_s={DEAD_AFTER_S}",
        "stop.target_accuracy=null",
        f"stop.max_seconds={RUN_S}",
        "eval.every_s=1.0",
        "--out",
        str(run_dir),
        "--quiet",
    ]
    with background_run(args) as proc:
        wait_for(
            lambda: (
                (run_dir / "metrics.jsonl").exists()
                and len(records(run_dir, "step")) >= STEPS_BEFORE_KILL
                and records(run_dir, "eval")
            ),
            RUN_S / 2,
            f"{STEPS_BEFORE_KILL} steps and an evaluation",
        )
        os.kill(shard_pid(run_dir, 1), signal.SIGKILL)
        _, err = proc.communicate(timeout=RUN_S)
    assert proc.returncode == 1, err + log_tails(run_dir)
    assert "ps1 failed: ps1 exited with -9" in err, err
    s = summary(run_dir)
    # the launcher's verdict
    assert s["status"] == "failed" and s["failed_node"] == "ps1", s
    assert s["detail"] == s["stop_reason"] == "ps1 exited with -9", s
    # ... on the scheduler's summary: what it counted and measured before the stop
    assert s["algorithm"] == "async" and s["name"] == "async", s
    assert s["global_steps"] >= STEPS_BEFORE_KILL, s
    assert s["evals"] >= 1 and s["final_accuracy"] is not None, s
    assert s["bytes_sent"] > 0 and set(s["per_node"]) >= {"worker0", "worker1"}, s
    assert set(s["shard_versions"]) == {"ps0", "ps1"}, s
    # and the failure with its cause: ps1 went silent and was declared dead
    dead = [f for f in s["failures"] if f["kind"] == "shard_dead"]
    assert [f["node"] for f in dead] == ["ps1"] and dead[0]["silent_s"] > DEAD_AFTER_S, s
    assert "ps1" not in s["not_left"] and "worker0" not in s["not_left"], s


def test_a_scheduler_dead_for_good_leaves_what_its_state_file_and_step_records_hold(run_dir):
    """No scheduler writes the summary: `hetps run` fills it from scheduler-state.json and the
    step records in metrics.jsonl (was: the launcher's four verdict fields alone)."""
    from cluster_util import REPO, run_hetps

    result = run_hetps(
        [
            "run",
            str(REPO / "configs" / "sync.yaml"),
            # two workers: the summary is filled from the state file and the step records, whoever
            # wrote them
            "cluster.workers=2",
            "stop.target_accuracy=null",
            "stop.max_seconds=60",
            "cluster.kill=[{node: scheduler, at_step: 100}]",
            "--out",
            str(run_dir),
        ],
        timeout_s=180,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    s = summary(run_dir)
    assert (s["status"], s["failed_node"], s["from_state"]) == ("failed", "scheduler", True)
    assert s["global_steps"] >= 100 and s["wall_s"] > 0, s
    assert s["run_id"] and isinstance(s["failures"], list)
