"""A measured cost model: the simulator's per-worker costs taken from a real
run's records, so a team can replay its own cluster in virtual time
(`hetps simulate CONFIG --replay RUN_DIR`, bench/sim_vs_real.py).

From the real run directory's `metrics.jsonl` step records:

- each worker's `step_s` is the median `compute_s` of its steps (measured
  compute, its `slowdown` and whatever CPU contention the run had included),
  so the simulated worker runs at slowdown 1;
- every worker's `latency_ms` is half the smallest per-worker median of
  `step_s - compute_s` (a step's time outside compute: push, reply and the
  worker's own overhead; the smallest belongs to the worker that waited
  least for others), since a step's push and its reply each pay it once.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from hetps.runconfig.schema import ConfigError
from hetps.scheduler.runlog import read_metrics, records_of


def step_records(run_dir: Path) -> list[dict]:
    """The measured `step` records of a run directory's metrics.jsonl: those with the worker's
    rank, `compute_s` and `step_s` (a client may send steps without them; none if none has)."""
    return records_of(
        read_metrics(Path(run_dir) / "metrics.jsonl"),
        "step",
        worker=int,
        compute_s=float,
        step_s=float,
    )


def measured_costs(run_dir: Path, n_workers: int | None = None) -> list[dict]:
    """Per worker of a real run, the simulator's `{step_s, latency_ms}` (see
    the module doc), for workers 0..n_workers-1 (default: every rank that
    recorded a step). Raises ConfigError naming the run directory when it
    has no step records or a worker recorded none."""
    steps = step_records(run_dir)
    if not steps:
        raise ConfigError(
            f"--replay {run_dir}: no step records with compute_s and step_s in its metrics.jsonl "
            "(is it a run directory of `hetps run` that trained?)"
        )
    n = n_workers if n_workers is not None else max(int(s["worker"]) for s in steps) + 1
    compute, outside = [], []
    for rank in range(n):
        mine = [s for s in steps if s["worker"] == rank]
        if not mine:
            raise ConfigError(f"--replay {run_dir}: worker{rank} recorded no step")
        compute.append(statistics.median(s["compute_s"] for s in mine))
        outside.append(statistics.median(max(0.0, s["step_s"] - s["compute_s"]) for s in mine))
    latency_ms = min(outside) / 2 * 1000
    return [{"step_s": round(c, 6), "latency_ms": round(latency_ms, 3)} for c in compute]


def workers_override(costs: list[dict]) -> str:
    """The `cluster.workers=...` override that puts `costs` in a config."""
    return "cluster.workers=" + json.dumps(costs)
