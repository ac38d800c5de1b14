"""`hetps simulate`: the real coordinator, shards and gradients on a virtual
clock, in this process. Deterministic: a config and seed give the same
summary; events happen at virtual times the cost model fixes (no wall clock).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetps.frontend.cli import main as hetps_main
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ConfigError
from hetps.scheduler.runlog import read_metrics
from hetps.sim.engine import SimulationError, simulate
from hetps.sim.events import Link, ServiceQueue, transfer
from hetps.training.data import load_datasets

BASE = [
    "data.batch_size=16",
    "eval.every_s=0.25",
    "stop.target_accuracy=null",
    "cluster.heartbeat_s=0.1",
    "cluster.dead_after_s=0.5",
    "optimizer.lr=0.05",
]


@pytest.fixture(scope="module")
def digits():
    return load_datasets(load_config(None).data, 0)


def run(tmp_path, digits, name, *overrides):
    cfg = load_config(None, BASE + list(overrides))
    return simulate(cfg, tmp_path / name, data=digits), tmp_path / name


def comparable(summary: dict) -> dict:
    """The summary less what may differ between two runs of one config: the
    machine it ran on and the real seconds it took."""
    out = {k: v for k, v in summary.items() if k != "environment"}
    out["simulation"] = {k: v for k, v in summary["simulation"].items() if k != "real_wall_s"}
    return out


def test_same_config_and_seed_give_the_same_summary(tmp_path, digits):
    overrides = (
        "algorithm.name=grouping",
        "cluster.workers=[{slowdown: 1}, {slowdown: 1}, {slowdown: 3}]",
        "stop.max_seconds=0.5",
        "sim.sample_s=0.0005",
    )
    first, _ = run(tmp_path, digits, "a", *overrides)
    second, _ = run(tmp_path, digits, "b", *overrides)
    assert first["mode"] == "simulated"
    assert first["global_steps"] > 50 and first["final_accuracy"] > 0.3  # it trained (chance: 0.1)
    assert comparable(first) == comparable(second)
    other_seed, _ = run(tmp_path, digits, "c", *overrides, "seed=1")
    assert comparable(other_seed) != comparable(first)


def test_sync_rounds_take_the_slowest_worker_in_virtual_time(tmp_path, digits):
    # 2 workers of 16 samples at 1 ms/sample: 16 ms and 48 ms steps, no network cost: a round is 48 ms
    # (unaggregated: an aggregated round adds its collectives, test_simulate_aggregation.py)
    summary, run_dir = run(
        tmp_path,
        digits,
        "sync",
        "algorithm.name=sync",
        "comm.aggregate=off",
        "sim.sample_s=0.001",
        "cluster.workers=[{slowdown: 1}, {slowdown: 3}]",
        "stop.max_seconds=0.96",
        "sim.shard_bytes_per_s=1e15",
        "sim.shard_message_s=0",
        "sim.shard_apply_s=0",
        "sim.shard_apply_bytes_per_s=1e15",
    )
    rounds = summary["shard_versions"]["ps0"]
    assert summary["wall_s"] == pytest.approx(1.0)  # the first heartbeat after the 0.96 s limit
    assert rounds == 20  # floor(1.0 / 0.048)
    assert (
        summary["per_node"]["worker0"]["steps"] == summary["per_node"]["worker1"]["steps"] == rounds
    )
    steps = [
        r
        for r in read_metrics(run_dir / "metrics.jsonl")
        if r["kind"] == "step" and r["worker"] == 0
    ]
    assert [round(r["t"], 6) for r in steps[:3]] == [0.048, 0.096, 0.144]


def test_grouping_groups_update_at_their_own_pace(tmp_path, digits):
    summary, run_dir = run(
        tmp_path,
        digits,
        "grouping",
        "algorithm.name=grouping",
        "sim.sample_s=0.001",
        "cluster.workers={count: 4, speeds: {classes: [{slowdown: 1, fraction: 0.5}, "
        "{slowdown: 4, fraction: 0.5}]}}",
        "stop.max_seconds=0.96",
        "sim.shard_bytes_per_s=1e15",
        "sim.shard_message_s=0",
        "sim.shard_apply_s=0",
        "sim.shard_apply_bytes_per_s=1e15",
    )
    plan = json.loads((run_dir / "plan-1.json").read_text())
    assert len(plan["groups"]) == 2
    updates = summary["shard_stats"]["ps0"]["group_updates"]
    # 4x faster group, 4x the updates
    assert updates["0"] == pytest.approx(4 * updates["1"], abs=2)


def test_killed_worker_is_declared_dead_and_replanned_in_virtual_time(tmp_path, digits):
    summary, run_dir = run(
        tmp_path,
        digits,
        "kill",
        "algorithm.name=sync",
        "cluster.workers=3",
        "cluster.kill=[{node: worker2, at_s: 0.3}]",
        "stop.max_seconds=1.5",
        "sim.sample_s=0.001",
    )
    dead = [f for f in summary["failures"] if f["kind"] == "worker_dead"]
    assert [f["node"] for f in dead] == ["worker2"]
    # silent from 0.3 s, dead after 0.5 s, seen at a 0.1 s tick
    assert 0.8 <= dead[0]["t"] <= 0.9 + 1e-9
    plan2 = json.loads((run_dir / "plan-2.json").read_text())
    assert [w["rank"] for w in plan2["workers"]] == [0, 1]
    steps = {w: summary["per_node"][w]["steps"] for w in ("worker0", "worker2")}
    assert steps["worker0"] > steps["worker2"] + 10  # the others went on without it


def test_worker_count_shorthand_and_its_errors():
    cfg = load_config(
        None,
        [
            "cluster.workers={count: 6, speeds: {classes: [{slowdown: 1, fraction: 0.5}, "
            "{slowdown: 2, fraction: 0.5}]}, latency_ms: 2}"
        ],
    )
    assert [w.slowdown for w in cfg.cluster.workers] == [1, 1, 1, 2, 2, 2]
    assert all(w.latency_ms == 2 for w in cfg.cluster.workers)
    spread = load_config(
        None, ["cluster.workers={count: 50, speeds: {lognormal: {sigma: 0.5}}}"]
    ).cluster.workers
    assert min(w.slowdown for w in spread) == 1.0 and max(w.slowdown for w in spread) > 2
    for bad, key in (
        ("{count: 0}", "cluster.workers.count"),
        ("{count: 4, speeds: {normal: {}}}", "cluster.workers.speeds"),
        ("{count: 4, speeds: {lognormal: {sigma: -1}}}", "cluster.workers.speeds.lognormal.sigma"),
        ("{count: 4, colour: red}", "cluster.workers.colour"),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [f"cluster.workers={bad}"])


def test_what_is_not_simulated_is_refused_naming_the_key(tmp_path):
    with pytest.raises(SimulationError, match="cluster.kill.0"):
        simulate(load_config(None, ["cluster.kill=[{node: ps0, at_s: 1}]"]), tmp_path / "x")
    assert (
        hetps_main(
            [
                "simulate",
                str(Path(__file__).parents[2] / "configs" / "default.yaml"),
                "comm.overlap=true",
                "--out",
                str(tmp_path / "y"),
            ]
        )
        == 2
    )


def test_compare_simulated_writes_the_tables_in_virtual_time(tmp_path):
    config = str(Path(__file__).parents[2] / "configs" / "default.yaml")
    code = hetps_main(
        [
            "compare",
            config,
            "--algorithms",
            "sync,grouping",
            "--simulate",
            "--out",
            str(tmp_path),
            *BASE,
            "stop.max_seconds=0.3",
            "cluster.workers=[{slowdown: 1}, {slowdown: 3}]",
        ]
    )
    assert code == 0
    rows = json.loads((tmp_path / "compare.json").read_text())
    assert [r["algorithm"] for r in rows] == ["sync", "grouping"]
    assert all(r["global_steps"] > 0 for r in rows)
    assert "virtual seconds" in (tmp_path / "compare.md").read_text()
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert json.loads((tmp_path / "sync-0" / "summary.json").read_text())["mode"] == "simulated"


def test_links_and_shard_service_queue_messages_in_virtual_time():
    worker = Link(mbps=8.0, latency_s=0.001)  # 1e6 bytes/s
    shard = Link(mbps=0.0, latency_s=0.002)  # unlimited, 2 ms
    assert transfer(worker, shard, 1_000_000, now=0.0) == pytest.approx(1.003)
    # queued behind the first
    assert transfer(worker, shard, 1_000_000, now=0.5) == pytest.approx(2.003)
    service = ServiceQueue(bytes_per_s=1e6)
    assert service.finish(arrived=1.0, nbytes=500_000, slowdown=2.0) == pytest.approx(2.0)
    # waits its turn
    assert service.finish(arrived=1.5, nbytes=100_000, slowdown=1.0) == pytest.approx(2.1)
    assert service.busy_s == pytest.approx(1.1)


@pytest.mark.parametrize("algorithm", ["sync", "async", "cpsgd"])
def test_the_step_limit_stops_on_the_step_that_reaches_it(tmp_path, digits, algorithm):
    """Not up to a heartbeat period of steps later (4 workers at the default cost model step
    about 80 times each per 0.5 s heartbeat)."""
    summary, _ = run(
        tmp_path,
        digits,
        algorithm,
        f"algorithm.name={algorithm}",
        "cluster.heartbeat_s=0.5",
        "cluster.dead_after_s=2.5",
        "stop.max_steps=40",
    )
    assert summary["stop_reason"] == "step limit 40"
    # the step that reached it, and those other workers finished meanwhile
    assert 40 <= summary["global_steps"] < 40 + 4, summary["global_steps"]


def test_nan_pushes_end_the_simulated_run_diverged_as_a_real_one(tmp_path, digits):
    """Shards refuse NaN/Inf pushes (cluster.nonfinite: reject); each simulated worker then
    leaves on that error with a BYE, as a real worker's daemon does, and the last to leave
    ends the run diverged (was: a RuntimeError traceback and no summary)."""
    summary, run_dir = run(
        tmp_path,
        digits,
        "nan",
        "algorithm.name=async",
        "optimizer.lr=1e6",
        "cluster.workers=2",
        "stop.max_seconds=5",
        "sim.sample_s=0.0005",
    )
    assert summary["status"] == "diverged", summary.get("detail")
    failures = summary["failures"]
    assert len(failures) == 2 and all("NONFINITE" in f["error"] for f in failures), failures
    assert "optimizer.lr" in summary["detail"]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "diverged"
