"""`hetps simulate --replay RUN_DIR`: the cost model measured in a run's
records (sim/costs.py). A simulated run writes the same step records a real
one does, so replaying one recovers the cost model it was given."""

from __future__ import annotations

import pytest
import yaml

from hetps.frontend.cli import main as hetps_main
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ConfigError
from hetps.sim.costs import measured_costs
from hetps.sim.engine import simulate

BASE = [
    "data.batch_size=16",
    "eval.every_s=0.25",
    "stop.target_accuracy=null",
    "cluster.heartbeat_s=0.1",
    "algorithm.name=async",
    "optimizer.lr=0.02",
    "stop.max_seconds=0.5",
    "sim.shard_bytes_per_s=1e15",
    "sim.shard_message_s=0",
    "sim.shard_apply_s=0",
    "sim.shard_apply_bytes_per_s=1e15",
]
GIVEN = "cluster.workers=[{step_s: 0.004, latency_ms: 3}, {step_s: 0.012, latency_ms: 3}]"


@pytest.fixture(scope="module")
def measured_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("replay") / "given"
    simulate(load_config(None, BASE + [GIVEN]), run_dir)
    return run_dir


def test_the_measured_cost_model_is_the_one_the_run_had(measured_run):
    costs = measured_costs(measured_run)
    assert [c["step_s"] for c in costs] == pytest.approx([0.004, 0.012], rel=0.01)
    # async: a step's time outside compute is its push and its reply, 3 ms each way
    assert [c["latency_ms"] for c in costs] == pytest.approx([3.0, 3.0], abs=0.1)


def test_hetps_simulate_replay_runs_the_measured_cluster(measured_run, tmp_path, capsys):
    out = tmp_path / "replayed"
    assert (
        hetps_main(
            [
                "simulate",
                "configs/default.yaml",
                "--replay",
                str(measured_run),
                "--out",
                str(out),
                *BASE,
            ]
        )
        == 0
    )
    workers = yaml.safe_load((out / "config.yaml").read_text())["cluster"]["workers"]
    assert [w["step_s"] for w in workers] == pytest.approx([0.004, 0.012], rel=0.01)
    assert "2 workers measured in" in capsys.readouterr().err
    # the replay has the same costs again
    assert measured_costs(out) == measured_costs(measured_run)


def test_a_directory_without_steps_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(ConfigError, match="no step records"):
        measured_costs(tmp_path)
    assert hetps_main(["simulate", "configs/default.yaml", "--replay", str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err
