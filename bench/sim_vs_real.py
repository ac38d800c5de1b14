"""Calibration: the same heterogeneous experiment run really and simulated.

    .venv/bin/python bench/sim_vs_real.py [--config configs/default.yaml] [--repeats N] \
        [--algorithms sync,async,grouping] [--shards 2,4] [--out runs/sim-vs-real] [--reuse] \
        [key=value ...]

For each algorithm, each repeat runs the experiment really (`hetps run`:
one process per node, ZeroMQ), then simulates it (`hetps simulate`) with a
cost model measured from that real run (sim/costs.py: each worker's median
compute per step, and half the smallest per-worker median of a step's time
outside compute as every worker's one-way latency; `hetps simulate --replay`
does the same for one run). Blocking; each real run lasts until the target
or `stop.max_seconds`.

Prints, per algorithm, the median real and simulated time to target
(seconds; virtual for the simulation), their ratio, and each worker's step
rate (steps per second up to the end of its run) real and simulated.
Writes OUT/sim_vs_real.json. A `cluster.workers=...` override sets the real
cluster; the simulation replaces it with the measured cost model. `--reuse`
keeps the real runs already in OUT (re-simulates them only). `--shards`:
the experiment at each of these shard counts (`cluster.shards={count: N}`,
equal shards; the default placement cuts large tensors into parts,
`cluster.chunk_bytes: auto`), real and simulated alike; a row per algorithm
and count (none given: the config's shards).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

from hetps.frontend.compare import algorithm_config, median_or_none
from hetps.frontend.launcher import run_local
from hetps.runconfig.load import load_raw
from hetps.sim.costs import measured_costs, step_records
from hetps.sim.engine import simulate

# the learning rates docs/results.md uses for these on configs/default.yaml (4 workers)
DEFAULT_WITH = {
    "sync": ["optimizer.lr=0.05"],
    "async": ["optimizer.lr=0.0125"],
    "ssp": ["optimizer.lr=0.0125"],
}


def step_rates(run_dir: Path, n_workers: int) -> list[float]:
    """Steps per second of each worker, from time 0 to its last step record."""
    steps = step_records(run_dir)
    rates = []
    for rank in range(n_workers):
        ts = [s["t"] for s in steps if s["worker"] == rank]
        rates.append(len(ts) / max(ts) if ts and max(ts) > 0 else 0.0)
    return rates


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def one_pair(
    raw: dict, algorithm: str, common: list[str], seed: int, out: Path, r: int, reuse: bool = False
) -> dict:
    """One real run (or, with `reuse`, the one already in `out`), then its
    simulation with the measured cost model; blocking."""
    extra = DEFAULT_WITH.get(algorithm, [])
    cfg = algorithm_config(raw, algorithm, common, extra, seed)
    real_dir = out / f"{algorithm}-real-{r}"
    if not (reuse and (real_dir / "summary.json").exists()):
        print(f"sim_vs_real: {algorithm} real run {r + 1} -> {real_dir}", file=sys.stderr)
        if run_local(cfg, real_dir, quiet=True) not in (0, 3):
            raise RuntimeError(f"{real_dir}: the real run failed; see its logs")
    n = len(cfg.cluster.workers)
    costs = measured_costs(real_dir, n)
    sim_raw = copy.deepcopy(raw)
    sim_raw.setdefault("cluster", {})["workers"] = costs  # slowdown 1: step_s already includes it
    # the real cluster's `cluster.workers=` override would replace the measured costs
    sim_common = [o for o in common if not o.replace(" ", "").startswith("cluster.workers=")]
    sim_cfg = algorithm_config(sim_raw, algorithm, sim_common, extra, seed)
    sim_dir = out / f"{algorithm}-sim-{r}"
    print(f"sim_vs_real: {algorithm} simulation {r + 1} -> {sim_dir}", file=sys.stderr)
    simulate(sim_cfg, sim_dir)
    real, sim = summary_of(real_dir), summary_of(sim_dir)
    return {
        "costs": costs,
        "real": {
            "time_to_target_s": real["time_to_target_s"],
            "rates": step_rates(real_dir, n),
            "final_accuracy": real["final_accuracy"],
        },
        "sim": {
            "time_to_target_s": sim["time_to_target_s"],
            "rates": step_rates(sim_dir, n),
            "final_accuracy": sim["final_accuracy"],
        },
    }


def row(algorithm: str, pairs: list[dict]) -> dict:
    real_t = median_or_none([p["real"]["time_to_target_s"] for p in pairs])
    sim_t = median_or_none([p["sim"]["time_to_target_s"] for p in pairs])
    n = len(pairs[0]["real"]["rates"])
    rates = {
        side: [statistics.median(p[side]["rates"][i] for p in pairs) for i in range(n)]
        for side in ("real", "sim")
    }
    return {
        "algorithm": algorithm,
        "real_s": real_t,
        "sim_s": sim_t,
        "ratio": sim_t / real_t if real_t and sim_t else None,
        "rates": rates,
        "costs": pairs[0]["costs"],
        "pairs": pairs,
    }


def markdown(rows: list[dict]) -> str:
    def t(v):
        return "-" if v is None else f"{v:.2f}"

    lines = [
        "| algorithm | real time to target (s) | simulated (virtual s) | sim / real "
        "| worker steps/s real | worker steps/s simulated |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        real = ", ".join(f"{x:.0f}" for x in r["rates"]["real"])
        sim = ", ".join(f"{x:.0f}" for x in r["rates"]["sim"])
        lines.append(
            f"| {r['algorithm']} | {t(r['real_s'])} | {t(r['sim_s'])} | {t(r['ratio'])} "
            f"| {real} | {sim} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every run")
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--algorithms", default="sync,async,grouping")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default="runs/sim-vs-real")
    parser.add_argument("--reuse", action="store_true", help="keep the real runs already in --out")
    parser.add_argument(
        "--shards", default="", help="shard counts, e.g. 1,4 (default: the config's shards)"
    )
    args = parser.parse_args(argv)
    raw = load_raw(args.config)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    counts = [int(n) for n in args.shards.split(",") if n.strip()] or [None]
    for count in counts:
        common = list(args.overrides)
        where = out
        if count is not None:
            common.append(f"cluster.shards={{count: {count}}}")
            where = out / f"shards-{count}"
            where.mkdir(parents=True, exist_ok=True)
        for algorithm in [a.strip() for a in args.algorithms.split(",") if a.strip()]:
            pairs = [
                one_pair(raw, algorithm, common, raw.get("seed", 0) + r, where, r, args.reuse)
                for r in range(args.repeats)
            ]
            name = algorithm if count is None else f"{algorithm}, {count} shards"
            rows.append(row(name, pairs))
    (out / "sim_vs_real.json").write_text(json.dumps(rows, indent=2))
    print(markdown(rows))
    for r in rows:
        print(f"{r['algorithm']}: simulated cost model {r['costs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
