"""Shards against workers in simulation: time to a target and the busiest
shard's load, for each worker count, shard count, algorithm and seed
(docs/simulation.md, "Many workers over 1 to 16 shards").

    .venv/bin/python bench/shard_scaling.py [--workers 64,256] [--shards 1,2,4,8,16]
        [--algorithms sync,grouping] [--seeds 0] [--max-seconds 6] [--jobs 1]
        [--out runs/shard-scaling] [key=value ...]

Each run is `hetps simulate CONFIG` (configs/default.yaml unless `--config`)
with W workers in three speed classes (slowdowns 1, 2 and 4, a third each),
N equal shards (`cluster.shards={count: N}`, the default placement and shard
cost) and the extra overrides. A finished run's summary.json is kept and
reused (`--out` holds them). Prints one row per run: time to the target
(virtual s; `-` when not reached), worker steps per virtual second, the
busiest shard's busy fraction (its `busy_s` over the virtual seconds) and
the real seconds of the simulation; then per worker and shard count the
median over seeds and grouping's speed-up over sync, in time to the target
and in worker steps per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CLASSES = (
    "{classes: [{slowdown: 1, fraction: 0.33}, {slowdown: 2, fraction: 0.33}, "
    "{slowdown: 4, fraction: 0.34}]}"
)


def run_one(
    config: str,
    out: Path,
    workers: int,
    shards: int,
    algorithm: str,
    seed: int,
    max_s: float,
    extra: list[str],
) -> dict:
    where = out / f"w{workers}-s{shards}-{algorithm}-seed{seed}"
    summary = where / "summary.json"
    if not summary.exists():
        cmd = [
            str(Path(sys.executable).with_name("hetps")),
            "simulate",
            config,
            f"cluster.workers={{count: {workers}, speeds: {CLASSES}}}",
            f"cluster.shards={{count: {shards}}}",
            f"algorithm.name={algorithm}",
            f"seed={seed}",
            f"stop.max_seconds={max_s}",
            "eval.every_s=0.25",
            *extra,
            "--out",
            str(where),
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=7200)
    d = json.loads(summary.read_text())
    virtual = d["simulation"]["virtual_s"]
    busy = max(s.get("busy_s", 0.0) for s in d["shard_stats"].values()) / max(virtual, 1e-9)
    return {
        "workers": workers,
        "shards": shards,
        "algorithm": algorithm,
        "seed": seed,
        "to_target": d["time_to_target_s"],
        "steps_per_s": d["global_steps"] / max(virtual, 1e-9),
        "busiest": busy,
        "real_s": d["simulation"]["real_wall_s"],
        "best": d["best_accuracy"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--workers", default="64,256")
    parser.add_argument("--shards", default="1,2,4,8,16")
    parser.add_argument("--algorithms", default="sync,grouping")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--max-seconds", type=float, default=6.0)
    parser.add_argument("--jobs", type=int, default=1, help="simulations at a time")
    parser.add_argument("--out", default="runs/shard-scaling")
    parser.add_argument("overrides", nargs="*", help="key=value for every run")
    args = parser.parse_args()
    ints = lambda text: [int(x) for x in text.split(",") if x.strip()]  # noqa: E731
    grid = [
        (w, n, a, s)
        for w in ints(args.workers)
        for n in ints(args.shards)
        for s in ints(args.seeds)
        for a in args.algorithms.split(",")
    ]
    out = Path(args.out)
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        rows = list(
            pool.map(
                lambda g: run_one(args.config, out, *g, args.max_seconds, args.overrides), grid
            )
        )
    print(
        f"{'workers':>7} {'shards':>6} {'algorithm':>9} {'seed':>4} {'to target':>9} "
        f"{'steps/s':>8} {'busiest':>7} {'real s':>7}"
    )
    for r in rows:
        t = "-" if r["to_target"] is None else f"{r['to_target']:.2f}"
        print(
            f"{r['workers']:>7} {r['shards']:>6} {r['algorithm']:>9} {r['seed']:>4} {t:>9} "
            f"{r['steps_per_s']:>8.0f} {r['busiest']:>7.2f} {r['real_s']:>7.0f}"
        )
    print("medians over seeds (a run that missed the target counts as the time limit):")
    for w in ints(args.workers):
        for n in ints(args.shards):
            med = {}
            for a in args.algorithms.split(","):
                mine = [r for r in rows if (r["workers"], r["shards"], r["algorithm"]) == (w, n, a)]
                med[a] = (
                    statistics.median(
                        r["to_target"] if r["to_target"] is not None else args.max_seconds
                        for r in mine
                    ),
                    statistics.median(r["busiest"] for r in mine),
                    statistics.median(r["steps_per_s"] for r in mine),
                )
            line = "  ".join(f"{a}: {t:.2f} s, busiest {b:.2f}" for a, (t, b, _) in med.items())
            if "sync" in med and "grouping" in med:
                # time to target moves with the training's course; steps/s with the shards' pace
                line += (
                    f"  grouping speed-up {med['sync'][0] / med['grouping'][0]:.2f}x"
                    f" (steps/s {med['grouping'][2] / med['sync'][2]:.2f}x)"
                )
            print(f"  {w} workers, {n} shards: {line}")


if __name__ == "__main__":
    main()
