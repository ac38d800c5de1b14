"""The cost model from a real run's step records (sim/costs.py, used by
bench/sim_vs_real.py and `hetps simulate --replay`): each
worker's step_s is its median compute, the latency half the smallest
per-worker median time outside compute."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from hetps.runconfig.schema import ConfigError
from hetps.sim.costs import measured_costs

BENCH = Path(__file__).resolve().parents[2] / "bench" / "sim_vs_real.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("sim_vs_real", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_steps(run_dir: Path, steps: list[tuple[int, float, float, float]]) -> None:
    """(worker, t, compute_s, step_s) records, as a real run's metrics.jsonl has them."""
    run_dir.mkdir()
    lines = [{"kind": "plan", "t": 0.0}]
    lines += [
        {"kind": "step", "worker": w, "t": t, "compute_s": c, "step_s": s} for w, t, c, s in steps
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_cost_model_and_step_rates_from_step_records(tmp_path, bench):
    # worker 0: compute 4 ms, 30 ms steps (it waits); worker 1: compute 12 ms, 20 ms steps (8 ms outside)
    write_steps(
        tmp_path / "run",
        [
            (0, 0.03, 0.004, 0.03),
            (0, 0.06, 0.005, 0.03),
            (0, 0.09, 0.003, 0.03),
            (1, 0.02, 0.012, 0.02),
            (1, 0.04, 0.012, 0.02),
        ],
    )
    costs = measured_costs(tmp_path / "run", 2)
    assert costs == [{"step_s": 0.004, "latency_ms": 4.0}, {"step_s": 0.012, "latency_ms": 4.0}]
    assert bench.step_rates(tmp_path / "run", 2) == pytest.approx([3 / 0.09, 2 / 0.04])


def test_a_worker_without_steps_is_an_error_naming_it(tmp_path):
    write_steps(tmp_path / "run", [(0, 0.03, 0.004, 0.03)])
    with pytest.raises(ConfigError, match="worker1 recorded no step"):
        measured_costs(tmp_path / "run", 2)
