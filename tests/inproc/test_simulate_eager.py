"""eager-SGD's quorums on the virtual clock (`hetps simulate`): solo never
waits for a straggler, majority waits for the ceil(P/2)-th fastest worker,
sync for the slowest. Asserted on the virtual times of the step records, so
no wall-clock timing is involved.
"""

from __future__ import annotations

import pytest

from hetps.runconfig.load import load_config
from hetps.scheduler.runlog import read_metrics
from hetps.sim.engine import simulate
from hetps.training.data import load_datasets

# 3 workers of 16 samples at 1 ms/sample and slowdowns 1, 3, 5: steps of 16, 48 and 80 ms;
# no network or shard cost; limiter 0: no barrier rounds
BASE = [
    "data.batch_size=16",
    "eval.every_s=0.25",
    "stop.target_accuracy=null",
    "cluster.heartbeat_s=0.1",
    "optimizer.lr=0.05",
    "sim.sample_s=0.001",
    "sim.shard_bytes_per_s=1e15",
    "sim.shard_message_s=0",
    "sim.shard_apply_s=0",
    "sim.shard_apply_bytes_per_s=1e15",
    "stop.max_seconds=0.5",
    "cluster.workers=[{slowdown: 1}, {slowdown: 3}, {slowdown: 5}]",
]


@pytest.fixture(scope="module")
def digits():
    return load_datasets(load_config(None).data, 0)


def step_times(tmp_path, digits, name: str, *overrides: str) -> dict[int, list[float]]:
    """Virtual end time of each worker's steps, rounded to the microsecond."""
    cfg = load_config(None, BASE + list(overrides))
    summary = simulate(cfg, tmp_path / name, data=digits)
    assert summary["mode"] == "simulated" and summary["status"] != "failed"
    times: dict[int, list[float]] = {0: [], 1: [], 2: []}
    for r in read_metrics(tmp_path / name / "metrics.jsonl"):
        if r["kind"] == "step":
            times[r["worker"]].append(round(r["t"], 6))
    return times


def multiples(step_s: float, n: int = 5) -> list[float]:
    return [round(step_s * k, 6) for k in range(1, n + 1)]


def test_solo_quorum_never_waits_for_a_straggler(tmp_path, digits):
    times = step_times(
        tmp_path, digits, "solo", "algorithm={name: eager, quorum: solo, limiter: 0}"
    )
    assert times[0][:5] == multiples(0.016)  # the fastest closes a round at every push
    assert times[1][:5] == multiples(0.048)  # the others' pushes are late: answered at once
    assert times[2][:5] == multiples(0.080)


def test_majority_quorum_waits_for_half_the_workers(tmp_path, digits):
    times = step_times(
        tmp_path, digits, "majority", "algorithm={name: eager, quorum: majority, limiter: 0}"
    )
    # ceil(3/2) = 2 fresh pushes close a round: the fastest waits for the second fastest, not the slowest
    assert times[0][:5] == multiples(0.048)
    assert times[1][:5] == multiples(0.048)
    assert times[2][:5] == multiples(0.080)  # always late, so never waits


def test_sync_waits_for_the_slowest(tmp_path, digits):
    times = step_times(tmp_path, digits, "sync", "algorithm.name=sync")
    assert times[0][:5] == times[1][:5] == times[2][:5] == multiples(0.080)
