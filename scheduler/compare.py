"""`hetps compare`: one experiment under several algorithms, N repeats each,
run one after another on the same machine, with the same seeds.

    hetps compare configs/default.yaml --algorithms sync,async,ssp,grouping --repeats 3 \
        --with async optimizer.lr=0.0125 --with ssp algorithm.staleness=3 [key=value ...]
    hetps compare configs/sync.yaml --algorithms sync,solo:eager,majority:eager --with solo algorithm.quorum=solo

Each run keeps the config's `algorithm` block if it names ALGO and replaces
it with `{name: ALGO}` otherwise, then applies the common overrides, then
that entry's `--with` overrides.
Writes OUT/compare.json, OUT/compare.md (median time to target, speedup over
the first algorithm, final accuracy, bytes, communication rounds) and
OUT/compare.png (per algorithm, the median test accuracy over all repeats with
the min-max band, against time, global steps or bytes moved: `--x`;
`hetps plot OUT --x steps` draws it again).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

from hetps.proto.config import ConfigError, apply_override, config_from_dict, load_raw

from .launcher import run_local
from .plots import X_AXES, plot_compare


def algorithm_config(raw: dict, algorithm: str, common: list[str], extra: list[str], seed: int):
    raw = copy.deepcopy(raw)
    if (raw.get("algorithm") or {}).get("name") != algorithm:
        raw["algorithm"] = {"name": algorithm}  # the config's parameters belong to another algorithm
    for assignment in [*common, *extra, f"seed={seed}"]:
        apply_override(raw, assignment)
    return config_from_dict(raw, import_targets=True)


def median_or_none(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present and len(present) == len(values) else None


def aggregate(algorithm: str, summaries: list[dict]) -> dict:
    """One table row; time to target is a median only if every repeat reached it."""
    return {
        "algorithm": algorithm, "repeats": len(summaries),
        "time_to_target_s": median_or_none([s["time_to_target_s"] for s in summaries]),
        "reached": sum(s["time_to_target_s"] is not None for s in summaries),
        "final_accuracy": statistics.median(s["final_accuracy"] or 0.0 for s in summaries),
        "bytes": statistics.median(s["bytes_sent"] + s["bytes_received"] for s in summaries),
        "rounds": statistics.median(s.get("communication_rounds") or max(
            s["shard_versions"].values(), default=0) for s in summaries),
        "global_steps": statistics.median(s["global_steps"] for s in summaries),
        "runs": [s["run_dir"] for s in summaries],
    }


def markdown(rows: list[dict], title: str) -> str:
    base = rows[0]
    lines = [f"# {title}", "",
             f"| algorithm | time to target (s, median) | speedup over {base['algorithm']} | "
             "final accuracy (median) | MB moved | rounds | steps | reached |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ttt = r["time_to_target_s"]
        speedup = (f"{base['time_to_target_s'] / ttt:.2f}x"
                   if ttt and base["time_to_target_s"] else "-")
        lines.append(f"| {r['algorithm']} | {'-' if ttt is None else f'{ttt:.1f}'} | {speedup} | "
                     f"{r['final_accuracy']:.4f} | {r['bytes'] / 1e6:.0f} | {r['rounds']:.0f} | "
                     f"{r['global_steps']:.0f} | {r['reached']}/{r['repeats']} |")
    return "\n".join(lines) + "\n"


def compare_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hetps compare", description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every run")
    parser.add_argument("--algorithms", required=True,
                        help="comma-separated ALGO or LABEL:ALGO, e.g. sync,async,solo:eager")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--with", dest="extra", nargs=2, action="append", default=[],
                        metavar=("LABEL", "KEY=VALUE"), help="an override for one entry only")
    parser.add_argument("--out", default=None)
    parser.add_argument("--x", choices=list(X_AXES), default="time",
                        help="compare.png's x axis: wall-clock time, global steps or bytes moved (default time)")
    args = parser.parse_intermixed_args(argv)
    raw = load_raw(args.config)
    # each entry is ALGO or LABEL:ALGO (the same algorithm twice with different --with)
    entries = [e.strip() for e in args.algorithms.split(",") if e.strip()]
    labels = {e.split(":")[0]: e.split(":")[-1] for e in entries}
    algorithms = list(labels)
    extra = {a: [kv for name, kv in args.extra if name == a] for a in algorithms}
    try:
        configs = {a: [algorithm_config(raw, labels[a], args.overrides, extra[a], raw.get("seed", 0) + r)
                       for r in range(args.repeats)] for a in algorithms}
    except ConfigError as exc:
        print(f"hetps: config error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for a in algorithms:
        summaries = []
        for r, cfg in enumerate(configs[a]):
            run_dir = out / f"{a}-{r}"
            print(f"hetps compare: {a} run {r + 1}/{args.repeats} -> {run_dir}", file=sys.stderr)
            if run_local(cfg, run_dir, quiet=True) not in (0, 3):  # a diverged run is a result (status diverged)
                print(f"hetps compare: {a} run {r + 1} failed; see {run_dir}/logs", file=sys.stderr)
                return 1
            summaries.append({**json.loads((run_dir / "summary.json").read_text()), "run_dir": str(run_dir)})
        rows.append(aggregate(a, summaries))
    (out / "compare.json").write_text(json.dumps(rows, indent=2))
    (out / "compare.md").write_text(markdown(rows, f"{args.config} {' '.join(args.overrides)}".strip()))
    plot_compare(rows, out, args.x)
    print((out / "compare.md").read_text())
    return 0
