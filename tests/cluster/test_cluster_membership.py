"""Membership changes on real processes: a worker killed with SIGKILL leaves
the plan and the others go on; a worker started late joins a group. (The
`cluster.kill` setting killing a named node: test_cluster_recovery.py and
test_cluster_shard_kill.py.)"""

from __future__ import annotations

import json
import os
import signal

import pytest
from cluster_util import (
    REPO,
    Daemons,
    background_run,
    log_tails,
    processes_mentioning,
    records,
    summary,
    trained_to_after_replan,
    wait_for,
    worker_pid,
)

pytestmark = pytest.mark.cluster
DEAD_AFTER_S = 2.0


# cpsgd: the others wait at an averaging round the dead worker never joins; adopting the new plan closes it.
# Sync is tested on the virtual clock (test_simulate.py: the same detection and re-plan, deterministic).
@pytest.mark.parametrize("config", ["configs/default.yaml", "configs/cpsgd.yaml"])
def test_killed_worker_leaves_the_plan_and_the_run_reaches_target(config, run_dir):
    # no target stop: the default config can reach its target (0.95, as configs/cpsgd.yaml's) within
    # a second of the kill, before the worker is declared dead, and the run would end without a
    # re-plan; the test stops it (Ctrl-C) once the re-plan happened and the others trained on to
    # the target after it
    with background_run(
        [
            config,
            f"cluster.dead_after_s={DEAD_AFTER_S}",
            "stop.target_accuracy=null",
            "stop.max_seconds=120",
            "eval.every_s=0.5",
            "--out",
            str(run_dir),
            "--quiet",
        ]
    ) as proc:
        wait_for(
            lambda: (
                (run_dir / "metrics.jsonl").exists()
                and any(r["global_steps"] >= 40 for r in records(run_dir, "eval"))
            ),
            90,
            "training under way",
        )
        os.kill(worker_pid(run_dir, 1), signal.SIGKILL)
        wait_for(
            lambda: trained_to_after_replan(run_dir, 0.95, held=2),
            90,
            "a re-plan, then 95% twice after it",
        )
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err + log_tails(run_dir)
    s = summary(run_dir)
    dead = [f for f in s["failures"] if f["kind"] == "worker_dead"]
    assert [f["node"] for f in dead] == ["worker1"], s["failures"]
    # the final evaluation follows the Ctrl-C: under grouping the slow group's last (stale) updates can
    # swing it by points (0.964 then 0.891 seen on a loaded machine); 0.85 is still the trained model
    assert s["best_accuracy"] >= 0.95 and s["final_accuracy"] >= 0.85, s
    # the re-plan came within 2x the dead-after timeout of the worker's last step
    last_step = max(r["t"] for r in records(run_dir, "step") if r["worker"] == 1)
    replans = [r for r in records(run_dir, "plan") if r["plan_id"] > 1 and r["t"] > last_step]
    assert replans and replans[0]["t"] - last_step <= 2 * DEAD_AFTER_S + 1.0, (last_step, replans)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert len(plan["workers"]) == 3
    # and the others kept training after it
    assert any(r["t"] > replans[0]["t"] for r in records(run_dir, "step"))


def test_late_worker_joins_a_group_and_its_pushes_are_applied(tmp_path):
    run_dir = tmp_path / "join"
    overrides = [
        "cluster.workers=2",
        "cluster.shards=1",
        "stop.target_accuracy=null",
        "stop.max_seconds=120",
        "eval.every_s=1.0",
    ]
    config = str(REPO / "configs" / "default.yaml")
    daemons = Daemons(tmp_path, overrides)
    try:
        addr = daemons.scheduler(config, run_dir)
        daemons.start(["ps", "--config", config, "--rank", "0", "--scheduler", addr])
        for rank in range(2):
            daemons.start(["worker", "--config", config, "--rank", str(rank), "--scheduler", addr])
        daemons.start(["worker", "--config", config, "--evaluator", "--scheduler", addr])
        wait_for(
            lambda: (
                (run_dir / "metrics.jsonl").exists()
                and any(r["global_steps"] >= 40 for r in records(run_dir, "eval"))
            ),
            90,
            "training under way",
        )
        daemons.start(["worker", "--config", config, "--rank", "2", "--scheduler", addr])
        wait_for(
            lambda: sum(r["worker"] == 2 for r in records(run_dir, "step")) > 20,
            90,
            "20 steps of the late worker",
        )
        daemons.procs[0].send_signal(signal.SIGTERM)  # the scheduler stops the run cleanly
        codes = daemons.wait(120)
    finally:
        daemons.close()
    assert codes == [0] * len(codes), daemons.tails()
    s = summary(run_dir)
    assert s["stop_reason"] == "interrupted", s["stop_reason"]
    plan = json.loads((run_dir / "plan.json").read_text())
    assert s["plan_id"] >= 2 and len(plan["workers"]) == 3, plan
    late = plan["workers"][2]["node_id"]
    assert any(late in g for g in plan["groups"])
    assert s["per_node"]["worker2"]["steps"] > 10, s["per_node"]
    shard = s["shard_stats"]["ps0"]
    assert shard["accepted"] == shard["contributions"] + shard["pending"]
    # the late worker's pushes are among those applied
    assert shard["accepted"] >= s["global_steps"]
    assert not processes_mentioning(str(tmp_path))
