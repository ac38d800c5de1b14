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
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from hetps.runconfig.schema import ConfigError
from hetps.scheduler.runlog import read_metrics, records_of

from .events import Link


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


# The collective of a group that reduces before the shards (issue 40): a ring all-reduce, the
# algorithm gloo runs for a CPU all-reduce. Each of its 2(k-1) steps sends 1/k of the bytes to the
# next member (k-1 steps of reduce-scatter, k-1 of all-gather) and waits for the previous one.
# Fitted by `.venv/bin/python bench/collective.py` (its "ring fit" line, 2026-12-02;
# docs/results.md, Collectives) over its k = 2 rows, 4 KB-64 MB: on this 2-core machine larger
# groups share CPUs and wait for the scheduler at every step, which the simulator, one host per
# member, does not have. So the rate is what gloo's copies and sums reach over loopback on these
# CPUs and the hop a loopback message; neither is a network's (a member's link_mbps and
# latency_ms add that: group_allreduce_s).
GLOO_BYTES_PER_S = 1.46e9  # bytes/s through one member of gloo's ring, loopback
GLOO_HOP_S = 6.3e-5  # seconds per ring step beyond its bytes


def allreduce_s(
    nbytes: int, k: int, link_bytes_per_s: float = GLOO_BYTES_PER_S, hop_s: float = GLOO_HOP_S
) -> float:
    """Seconds a ring all-reduce of `nbytes` among `k` members takes: each
    member sends and receives 2(k-1)/k x nbytes over `link_bytes_per_s` (the
    slowest member's rate: every step waits for it) and each of the 2(k-1)
    steps pays `hop_s`. 0 for k <= 1 (nothing to reduce). Pure."""
    if k <= 1:
        return 0.0
    return 2 * (k - 1) / k * nbytes / link_bytes_per_s + 2 * (k - 1) * hop_s


def group_allreduce_s(nbytes: int, links: Sequence[Link]) -> float:
    """`allreduce_s` over the members' virtual links (one Link per member,
    sim/events.py): the rate is the slowest member's `mbps` (0: uncapped)
    capped by gloo's own GLOO_BYTES_PER_S, and a step's hop is GLOO_HOP_S plus
    the two largest one-way latencies among the members (a step crosses the
    sender's link and the receiver's, and waits for the slowest pair). Pure:
    the links' queues are not moved."""
    rates = [link.mbps * 1e6 / 8 for link in links if link.mbps > 0]
    rate = min([GLOO_BYTES_PER_S, *rates])
    latencies = sorted((link.latency_s for link in links), reverse=True)
    return allreduce_s(nbytes, len(links), rate, GLOO_HOP_S + sum(latencies[:2]))


def group_broadcast_s(nbytes: int, links: Sequence[Link]) -> float:
    """Seconds a broadcast of `nbytes` from one member to the others takes over their virtual
    links: a binomial tree (gloo's broadcast; MPICH's cost lg(p)·(latency + bytes/rate)), so
    ceil(log2 k) rounds, each the whole message at the slowest member's rate plus one hop (as
    `group_allreduce_s`). 0 for one member. Pure."""
    k = len(links)
    if k <= 1:
        return 0.0
    rates = [link.mbps * 1e6 / 8 for link in links if link.mbps > 0]
    rate = min([GLOO_BYTES_PER_S, *rates])
    latencies = sorted((link.latency_s for link in links), reverse=True)
    return math.ceil(math.log2(k)) * (nbytes / rate + GLOO_HOP_S + sum(latencies[:2]))
