"""Regenerate issue 4's comparison table: each variant run N times (seeds
0..N-1) with `hetps run CONFIG ... --out DIR --quiet`, medians read from
each run's summary.json, ratios against the baseline measured in the same
invocation, on the machine named in the header.

    .venv/bin/python bench/compare_algorithms.py                       # all three comparisons, 3 runs each
    .venv/bin/python bench/compare_algorithms.py --only eager --runs 5
    .venv/bin/python bench/compare_algorithms.py --only averaging --link cluster.SOME_LINK_CAP=VALUE

Comparisons (configs/ holds one config per comparison):
- eager:     sync vs eager majority vs eager solo on configs/eager.yaml (every step one
             random worker computes 3x extra); time to 95% and final accuracy.
- averaging: sync vs cpsgd vs adpsgd (configs/cpsgd.yaml, configs/adpsgd.yaml); time to
             95%, final accuracy, bytes per worker, communication rounds. `--link` adds
             overrides to every run of this comparison (an emulated slow link, once the
             transport has one).
- weighted:  simuparallel vs wpsgd (workers at slowdown [1, 1, 2, 4]) for the same
             wall-clock budget (`--budget-s`, no target); final accuracy.

The sync baselines reuse the comparison's config with `algorithm: {name: sync}`
(written next to the runs, since overrides cannot remove algorithm keys).
Writes OUT/table.md and prints it. Each run is bounded by --timeout-s.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def variants(budget_s: float) -> dict[str, list[tuple[str, str, bool, list[str]]]]:
    """comparison -> [(label, config, as_sync, overrides)], the baseline first."""
    wall = ["stop.target_accuracy=null", f"stop.max_seconds={budget_s}"]
    return {
        "eager": [("sync", "configs/eager.yaml", True, []),
                  ("eager majority", "configs/eager.yaml", False, ["algorithm.quorum=majority"]),
                  ("eager solo", "configs/eager.yaml", False, ["algorithm.quorum=solo"])],
        "averaging": [("sync", "configs/cpsgd.yaml", True, []),
                      ("cpsgd", "configs/cpsgd.yaml", False, []),
                      ("adpsgd", "configs/adpsgd.yaml", False, [])],
        "weighted": [("simuparallel", "configs/simuparallel.yaml", False, wall),
                     ("wpsgd", "configs/wpsgd.yaml", False, wall)],
    }


def sync_config(config: str, out: Path) -> str:
    raw = yaml.safe_load((REPO / config).read_text())
    raw["algorithm"] = {"name": "sync"}
    raw["name"] = f"{raw.get('name', 'run')}-sync"
    path = out / f"{Path(config).stem}-sync.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def run_once(config: str, overrides: list[str], run_dir: Path, timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "hetps.scheduler.cli", "run", config, *overrides,
           "--out", str(run_dir), "--quiet"]
    print("  $ hetps " + " ".join(cmd[3:]), file=sys.stderr, flush=True)
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"run failed ({result.returncode}): {result.stderr[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def metrics(summary: dict) -> dict:
    workers = [v for k, v in summary["per_node"].items() if k.startswith("worker")]
    ttt = summary["time_to_target_s"]
    return {"time_s": math.inf if ttt is None else float(ttt),
            "accuracy": float(summary["final_accuracy"] or 0.0),
            "mb_per_worker": sum(w["sent"] + w["received"] for w in workers) / max(1, len(workers)) / 1e6,
            "rounds": float(summary.get("communication_rounds", 0)),
            "wall_s": float(summary["wall_s"])}


def median_metrics(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def fmt_time(t: float) -> str:
    return "not reached" if math.isinf(t) else f"{t:.1f}"


def table(name: str, rows: list[tuple[str, dict]]) -> str:
    base = rows[0][1]
    lines = [f"### {name} (baseline: {rows[0][0]})", "",
             "| variant | time to target (s) | speedup | final acc | Δ acc (points) | MB/worker | bytes ratio"
             " | rounds |", "|---|---|---|---|---|---|---|---|"]
    for label, m in rows:
        speedup = (base["time_s"] / m["time_s"] if math.isfinite(base["time_s"]) and math.isfinite(m["time_s"])
                   else float("nan"))
        ratio = m["mb_per_worker"] / base["mb_per_worker"] if base["mb_per_worker"] else float("nan")
        lines.append(f"| {label} | {fmt_time(m['time_s'])} | {speedup:.2f}x | {m['accuracy']:.4f} | "
                     f"{100 * (m['accuracy'] - base['accuracy']):+.2f} | {m['mb_per_worker']:.1f} | "
                     f"{ratio:.2f} | {m['rounds']:.0f} |")
    return "\n".join(lines)


def machine() -> str:
    import torch

    return (f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, Python "
            f"{platform.python_version()}, torch {torch.__version__}), {time.strftime('%Y-%m-%d %H:%M')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", default="eager,averaging,weighted", help="comma-separated comparisons")
    parser.add_argument("--out", default="runs/compare-algorithms")
    parser.add_argument("--budget-s", type=float, default=60.0, help="wall-clock budget of `weighted`")
    parser.add_argument("--link", nargs="*", default=[], metavar="key=value",
                        help="extra overrides for `averaging` (an emulated slow link)")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sections = [f"Machine: {machine()}; median of {args.runs} runs (seeds 0..{args.runs - 1})."]
    for name in args.only.split(","):
        rows = []
        for label, config, as_sync, overrides in variants(args.budget_s)[name]:
            cfg = sync_config(config, out) if as_sync else config
            extra = args.link if name == "averaging" else []
            runs = []
            for seed in range(args.runs):
                run_dir = out / name / label.replace(" ", "-") / f"seed{seed}"
                runs.append(metrics(run_once(cfg, [*overrides, *extra, f"seed={seed}"], run_dir,
                                             args.timeout_s)))
            rows.append((label, median_metrics(runs)))
        sections.append(table(name, rows))
    text = "\n\n".join(sections) + "\n"
    (out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
