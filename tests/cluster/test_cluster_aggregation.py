"""Groups that reduce before the shards (comm.aggregate) on real processes:
`hetps run` with real gloo collectives between worker processes and real
shards. The shards take one push per group-round, and the bytes they take per
round fall by the group's size; a member killed (SIGKILL) or frozen (SIGSTOP)
during its group's collectives never hangs the others: their collective fails,
the scheduler re-plans without it and the run reaches its target; a scheduler
restart leaves the groups reducing. (comm.aggregate: on, as these groups of 2
to 4 are below auto's aggregate_min_group.) Every fault is triggered by an event (steps
recorded), never by a sleep.

The runs on sync.yaml keep as few workers as their checks need (4 sync workers on 2 cores train
slower per second than 2): a group of 2 where one group reduces, 3 where a member is lost and
the others must still reduce in a group (of 2) after the re-plan."""

from __future__ import annotations

import contextlib
import os
import signal
import traceback

import pytest
from cluster_util import (
    background_run,
    log_tails,
    records,
    run_hetps,
    summary,
    wait_for,
    worker_pid,
)

pytestmark = pytest.mark.cluster
DEAD_AFTER_S = 2.0


def shard_figures(s: dict) -> list[dict]:
    return [s["shard_stats"][name] for name in sorted(s["shard_stats"])]


def collective(s: dict, worker: str, key: str) -> int:
    return s["aggregation"]["workers"][worker].get(key, 0)


# what the pushes and bytes per round show needs a trained run, not sync.yaml's 95%: 80% on
# mnist-5k (the untrained model: 10%) is reached in about half the steps
TRAINED = 0.8

# one sync group of two: every figure below is a multiple of the group's size, and a group that
# did not reduce (each member pushing its own gradient) shows as twice the pushes and bytes
GROUP = 2


def test_sync_shards_take_one_push_per_round_and_one_group_size_th_of_the_bytes(tmp_path):
    runs = {}
    for mode in ("on", "off"):
        out = tmp_path / mode
        done = run_hetps(
            [
                "run",
                "configs/sync.yaml",
                "--out",
                str(out),
                "--quiet",
                f"cluster.workers={GROUP}",
                f"comm.aggregate={mode}",
                f"stop.target_accuracy={TRAINED}",
                # 80% is reached within a second of training: stop at the evaluation after it,
                # not up to 2 s later
                "eval.every_s=0.5",
            ],
            timeout_s=300,
        )
        assert done.returncode == 0, done.stderr[-3000:] + log_tails(out)
        runs[mode] = summary(out)
    on, off = runs["on"], runs["off"]
    for s in (on, off):
        assert s["status"] == "completed" and s["best_accuracy"] >= TRAINED, s
    for shard in shard_figures(on):
        # every push carried the group's mean: one per round of the group's workers
        assert shard["pushes"] == shard["aggregated"] == sum(shard["group_updates"].values())
        assert shard["pushes_per_round"] == 1.0
        assert shard["contributions"] == GROUP * shard["pushes"]
    for b in shard_figures(off):
        # a round still open at the stop holds pushes (`pending`) that no update counts yet
        rounds = sum(b["group_updates"].values())
        assert b["pushes"] - b["pending"] == GROUP * rounds and "aggregated" not in b, b
    assert off["aggregation"] == {}
    # bytes into the shards per round fall by the group's size (each slice once, not once per
    # member; the shards' order follows their measured speed, so the two runs' ps0 may hold
    # different slices)
    per_round = {m: sum(x["push_bytes_per_round"] for x in shard_figures(runs[m])) for m in runs}
    assert per_round["on"] * GROUP == pytest.approx(per_round["off"], rel=0.01), per_round
    assert sorted(on["aggregation"]["workers"]) == [f"worker{r}" for r in range(GROUP)]
    for w in (f"worker{r}" for r in range(GROUP)):
        assert collective(on, w, "collective_group_rounds") > 0
        mine = on["aggregation"]["workers"][w]
        assert mine["group_size"] == GROUP and mine["aggregate"] is True
        assert collective(on, w, "collective_failures") == 0


def test_the_default_experiment_reduces_inside_its_groups_and_reaches_its_target(tmp_path):
    out = tmp_path / "run"
    done = run_hetps(
        ["run", "configs/default.yaml", "--out", str(out), "--quiet", "comm.aggregate=on"],
        timeout_s=300,
    )
    assert done.returncode == 0, done.stderr[-3000:] + log_tails(out)
    s = summary(out)
    assert s["status"] == "completed" and s["best_accuracy"] >= 0.95, s
    for shard in shard_figures(s):
        # two groups of two (the speed classes): one push per group update, not two
        assert shard["aggregated"] > 0 and shard["pushes_per_round"] < 2.0, shard
    assert sum(collective(s, f"worker{r}", "collective_group_rounds") for r in range(4)) > 0


def steps_recorded(run_dir, n: int) -> bool:
    return (run_dir / "metrics.jsonl").exists() and len(records(run_dir, "step")) >= n


def others_stepped_after_replan(run_dir) -> bool:
    replans = [r["t"] for r in records(run_dir, "plan") if r["plan_id"] > 1]
    return bool(replans) and any(
        r["t"] > replans[0] and r["worker"] != 1 for r in records(run_dir, "step")
    )


# a sync group of three: one lost, the other two still reduce in a group after the re-plan
LOSING_ONE = 3
# the target after the loss: trained on by the group left, not the first plan's 10-odd rounds
# (sync.yaml's 95% is no promise of these tests; 90% takes fewer of the slower rounds)
TRAINED_ON = 0.9


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_a_member_killed_or_frozen_during_its_groups_collectives_never_hangs_the_others(
    tmp_path, fault
):
    run_dir = tmp_path / "run"
    frozen = None
    with background_run(
        [
            "configs/sync.yaml",
            "--out",
            str(run_dir),
            "--quiet",
            f"cluster.workers={LOSING_ONE}",
            f"cluster.dead_after_s={DEAD_AFTER_S}",
            "comm.aggregate=on",
            "comm.collective_timeout_s=3",
            f"stop.target_accuracy={TRAINED_ON}",
            "stop.max_seconds=200",
            "eval.every_s=0.5",
        ]
    ) as proc:
        try:
            # every step of a sync group is a collective of all its members: they wait in one
            wait_for(lambda: steps_recorded(run_dir, 40), 120, "40 steps recorded")
            victim = worker_pid(run_dir, 1)
            if fault == "kill":
                os.kill(victim, signal.SIGKILL)
            else:
                os.kill(victim, signal.SIGSTOP)  # alive, silent: heartbeats stop too
                frozen = victim  # to the end: the launcher reaps a node still frozen
            _, err = proc.communicate(timeout=200)
        except BaseException:
            raise AssertionError(f"{traceback.format_exc()}\n{log_tails(run_dir)}") from None
        finally:
            if frozen is not None:  # hetps run has killed it at its end, unless it failed first
                with contextlib.suppress(ProcessLookupError):
                    os.kill(frozen, signal.SIGCONT)
    assert proc.returncode == 0, err + log_tails(run_dir)
    s = summary(run_dir)
    assert s["status"] == "completed" and s["best_accuracy"] >= TRAINED_ON, s
    dead = [f for f in s["failures"] if f["kind"] == "worker_dead"]
    assert [f["node"] for f in dead] == ["worker1"], s["failures"]
    # the others' collective failed, and they trained on in a group of the rest after the re-plan
    for w in (f"worker{r}" for r in range(LOSING_ONE) if r != 1):
        assert collective(s, w, "collective_failures") >= 1, s["aggregation"]
        assert s["aggregation"]["workers"][w]["group_size"] == LOSING_ONE - 1, s["aggregation"]
    assert others_stepped_after_replan(run_dir)
    for shard in shard_figures(s):
        assert shard["aggregated"] > 0


def test_a_scheduler_restart_leaves_the_groups_reducing(tmp_path):
    run_dir = tmp_path / "run"
    done = run_hetps(
        [
            "run",
            "configs/sync.yaml",
            "--out",
            str(run_dir),
            "--quiet",
            f"cluster.workers={GROUP}",
            "comm.aggregate=on",
            # 60 steps (30 rounds): well before the first evaluation, which alone can stop the run
            "cluster.kill=[{node: scheduler, at_step: 60, restart_after_s: 1}]",
            f"stop.target_accuracy={TRAINED_ON}",
            "stop.max_seconds=200",
        ],
        timeout_s=300,
    )
    assert done.returncode == 0, done.stderr[-3000:] + log_tails(run_dir)
    faults = (run_dir / "faults.jsonl").read_text()
    assert '"kill"' in faults and '"restart"' in faults and "scheduler" in faults, faults
    s = summary(run_dir)
    assert s["status"] == "completed" and s["best_accuracy"] >= TRAINED_ON, s
    # the groups' store lives on their first member, not the scheduler: no collective failed
    assert sorted(s["aggregation"]["workers"]) == [f"worker{r}" for r in range(GROUP)]
    for w in (f"worker{r}" for r in range(GROUP)):
        assert collective(s, w, "collective_failures") == 0, s["aggregation"]
        assert collective(s, w, "collective_group_rounds") > 0
    for shard in shard_figures(s):
        assert shard["pushes"] == shard["aggregated"]
