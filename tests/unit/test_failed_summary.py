"""A failed run's summary.json is the scheduler's own, marked failed
(scheduler/runlog.py SummaryFile.mark_failed), and the launcher waits for a stopping
scheduler as long as the scheduler itself may take to stop, so that it has
written that summary (frontend/launcher.py). The real-process case:
tests/cluster/test_cluster_failed_summary.py."""

from __future__ import annotations

import json

from hetps.frontend.launcher import SCHEDULER_STOP_S
from hetps.scheduler.coordinator import EXIT_GRACE_S
from hetps.scheduler.runlog import SummaryFile

SCHEDULERS = {
    "status": "interrupted",
    "failed_node": None,
    "detail": None,
    "algorithm": "async",
    "global_steps": 412,
    "final_accuracy": 0.91,
    "per_node": {"worker0": {"steps": 200}, "worker1": {"steps": 212}},
    "failures": [{"kind": "shard_dead", "node": "ps1", "t": 12.5, "silent_s": 5.2}],
    "stop_reason": "interrupted",
}


def test_the_schedulers_fields_are_kept_and_the_verdict_added(tmp_path):
    SummaryFile(tmp_path).write(SCHEDULERS)
    SummaryFile(tmp_path).mark_failed("ps1", "ps1 exited with -9")
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s == {
        **SCHEDULERS,
        "status": "failed",
        "failed_node": "ps1",
        "detail": "ps1 exited with -9",
        # `interrupted` was the launcher's own stop after the failure: the run stopped for it
        "stop_reason": "ps1 exited with -9",
    }


def test_a_stop_reason_of_the_schedulers_own_is_kept(tmp_path):
    SummaryFile(tmp_path).write({**SCHEDULERS, "stop_reason": "time limit 60s"})
    SummaryFile(tmp_path).mark_failed("worker1", "exited 1")
    s = json.loads((tmp_path / "summary.json").read_text())
    assert (s["status"], s["stop_reason"], s["global_steps"]) == ("failed", "time limit 60s", 412)


def test_without_a_summary_the_verdict_alone_is_written(tmp_path):
    SummaryFile(tmp_path).mark_failed("ps0", "ps0 exited with 1")
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s == {
        "status": "failed",
        "failed_node": "ps0",
        "detail": "ps0 exited with 1",
        "stop_reason": "ps0 exited with 1",
    }


def test_the_launcher_adds_to_the_schedulers_summary_and_an_interrupt_wins(tmp_path):
    summary = SummaryFile(tmp_path)
    summary.write({**SCHEDULERS, "status": "completed", "stop_reason": "time limit 60s"})
    assert summary.update(startup={"train_s": 1.5})["startup"] == {"train_s": 1.5}
    summary.mark_interrupted()
    assert summary.read() == {
        **SCHEDULERS,
        "startup": {"train_s": 1.5},
        "status": "interrupted",
        "stop_reason": "interrupted",
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # no lock or tmp file


def test_the_launcher_waits_for_a_stopping_scheduler_as_long_as_it_may_take():
    assert SCHEDULER_STOP_S >= EXIT_GRACE_S + 5.0
