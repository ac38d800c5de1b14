"""`hetps simulate` of the local-step algorithms (cpsgd, adpsgd, wpsgd,
diloco): the real trainers' local steps and round logic on the virtual
clock, the real averaging and diloco shard policies. In-process, a few
seconds each. (The shard's mean of a round is checked against the pushed
models in test_algorithms.py.)
"""

from __future__ import annotations

import pytest
from test_simulate import comparable

from hetps.runconfig.load import load_config
from hetps.scheduler.runlog import read_metrics
from hetps.sim.engine import simulate
from hetps.training.data import load_datasets

BASE = [
    "data.batch_size=16",
    "eval.every_s=0.25",
    "cluster.heartbeat_s=0.1",
    "cluster.dead_after_s=0.5",
    "optimizer.lr=0.05",
    "optimizer.momentum=0.9",
    "cluster.shards=2",
    "sim.sample_s=0.0005",
    "cluster.workers=[{slowdown: 1}, {slowdown: 1}, {slowdown: 3}]",
]
ALGORITHMS = {
    "cpsgd": ["algorithm.name=cpsgd", "algorithm.period=4"],
    "adpsgd": ["algorithm.name=adpsgd", "algorithm.budget_rounds=0", "algorithm.warmup_rounds=2"],
    "wpsgd": ["algorithm.name=wpsgd", "algorithm.period_s=0.1", "optimizer.weight_decay=0.0005"],
    "diloco": ["algorithm.name=diloco", "algorithm.period=6", "optimizer.momentum=0"],
}


@pytest.fixture(scope="module")
def digits():
    return load_datasets(load_config(None).data, 0)


def run(tmp_path, digits, name, *overrides):
    cfg = load_config(None, BASE + list(overrides))
    return simulate(cfg, tmp_path / name, data=digits), tmp_path / name


def rounds_of(run_dir) -> dict[int, list[dict]]:
    """Per worker rank, its step records that ended a round."""
    out: dict[int, list[dict]] = {}
    for r in read_metrics(run_dir / "metrics.jsonl"):
        if r.get("kind") == "step" and "round" in r:
            out.setdefault(r["worker"], []).append(r)
    return out


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_local_step_algorithms_reach_the_target(tmp_path, digits, algorithm):
    summary, _ = run(
        tmp_path,
        digits,
        algorithm,
        *ALGORITHMS[algorithm],
        "stop.target_accuracy=0.9",
        "stop.max_seconds=6",
    )
    assert "target accuracy" in summary["stop_reason"], summary["stop_reason"]
    assert summary["best_accuracy"] >= 0.9 and summary["mode"] == "simulated"
    # the final model is measured after the stop, once the last pushes were averaged in: under
    # wpsgd (seeded, deterministic) that average measures 0.868 where the target was met at 0.908
    assert summary["final_accuracy"] >= 0.85
    assert not summary["simulation"]["stalled"]
    assert min(summary["shard_versions"].values()) >= 2  # rounds closed on both shards


def test_cpsgd_rounds_are_period_local_steps_and_wait_for_the_slowest(tmp_path, digits):
    summary, run_dir = run(
        tmp_path,
        digits,
        "cpsgd",
        *ALGORITHMS["cpsgd"],
        "stop.target_accuracy=null",
        "stop.max_seconds=0.5",
    )
    rounds = rounds_of(run_dir)
    # the round's push follows `period` local steps on every worker
    for records in rounds.values():
        assert [r["step"] for r in records] == [4 * r["round"] for r in records]
    # 16 samples x 0.5 ms x slowdown 3 = 24 ms per local step on the slow worker: a round takes >= 96 ms,
    # and the fast worker (8 ms steps) waits for it
    fast, slow = rounds[0], rounds[2]
    assert len(fast) == len(slow) >= 3
    assert all(b["t"] - a["t"] >= 0.095 for a, b in zip(fast, fast[1:]))  # (t is rounded to 1 us)
    assert summary["shard_versions"]["ps0"] == len(slow)


def test_diloco_local_steps_follow_speed(tmp_path, digits):
    _, run_dir = run(
        tmp_path,
        digits,
        "diloco",
        *ALGORITHMS["diloco"],
        "stop.target_accuracy=null",
        "stop.max_seconds=0.5",
    )
    rounds = rounds_of(run_dir)
    # H_i = 6 x speed
    assert {r["period"] for r in rounds[0]} == {6} and {r["period"] for r in rounds[2]} == {2}
    # rounds take about the same virtual time: the fast and the slow worker close as many
    assert abs(len(rounds[0]) - len(rounds[2])) <= 1


def test_wpsgd_final_average_closes_a_last_round(tmp_path, digits):
    # period_s 0: only the final average, over models of unequal local work
    summary, run_dir = run(
        tmp_path,
        digits,
        "wpsgd",
        "algorithm.name=wpsgd",
        "algorithm.period_s=0",
        "optimizer.weight_decay=0.0005",
        "stop.target_accuracy=null",
        "stop.max_seconds=0.5",
    )
    assert summary["shard_versions"] == {"ps0": 1, "ps1": 1}  # the one final round
    # carried to its last message, not to later timers
    assert summary["simulation"]["virtual_s"] < 0.6
    stats = summary["shard_stats"]["ps0"]
    # W_i = 1 - (1 - lr wd)^T_i, normalised: the slow worker did a third of the steps
    weights = stats["weights"]
    assert weights[0] == pytest.approx(weights[1]) and weights[2] == pytest.approx(
        weights[0] / 3, rel=0.05
    )
    final = [e for e in read_metrics(run_dir / "metrics.jsonl") if e.get("kind") == "eval"][-1]
    assert final["final"] and final["accuracy"] > 0.5


@pytest.mark.parametrize("algorithm", ["adpsgd", "diloco"])
def test_same_config_and_seed_give_the_same_summary(tmp_path, digits, algorithm):
    overrides = (*ALGORITHMS[algorithm], "stop.target_accuracy=null", "stop.max_seconds=0.4")
    first, _ = run(tmp_path, digits, "a", *overrides)
    second, _ = run(tmp_path, digits, "b", *overrides)
    assert first["global_steps"] > 30
    assert comparable(first) == comparable(second)


def test_averaging_goes_on_without_a_killed_worker(tmp_path, digits):
    # worker 2 goes silent at 0.2 s; once it is declared dead the shards adopt the new plan (closing the
    # open round over the models it has) and the survivors' rounds close without it
    summary, run_dir = run(
        tmp_path,
        digits,
        "kill",
        *ALGORITHMS["cpsgd"],
        "stop.target_accuracy=null",
        "stop.max_seconds=1.0",
        "cluster.kill=[{node: worker2, at_s: 0.2}]",
    )
    assert summary["plan_id"] == 2 and not summary["simulation"]["stalled"]
    # after dead_after_s and a heartbeat
    late = [r for r in rounds_of(run_dir)[0] if r["t"] > 0.2 + 0.5 + 0.1]
    assert len(late) >= 3
    # no longer waiting for the slow worker
    assert all(b["t"] - a["t"] < 0.096 for a, b in zip(late, late[1:]))


def test_adpsgd_periods_start_at_one_and_never_shrink(tmp_path, digits):
    summary, run_dir = run(
        tmp_path,
        digits,
        "adpsgd",
        *ALGORITHMS["adpsgd"],
        "stop.target_accuracy=null",
        "stop.max_seconds=1.0",
    )
    periods = {w: [r["period"] for r in rs] for w, rs in rounds_of(run_dir).items()}
    assert set(periods) == {0, 1, 2}, periods
    for worker, ps in periods.items():
        assert ps[0] == 1 and ps == sorted(ps), (worker, ps)
    assert max(max(ps) for ps in periods.values()) > 1, periods  # the period grew


def test_simuparallel_weights_every_worker_equally(tmp_path, digits):
    summary, _ = run(
        tmp_path,
        digits,
        "simuparallel",
        "algorithm.name=simuparallel",
        "algorithm.period_s=0",
        "stop.target_accuracy=null",
        "stop.max_seconds=0.5",
    )
    # unequal local work (slowdown 3), equal weights
    weights = summary["shard_stats"]["ps0"]["weights"]
    assert weights == pytest.approx([1 / 3] * 3), weights
