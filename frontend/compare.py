"""`hetps compare`: one experiment under several algorithms, N repeats each,
run one after another on the same machine, with the same seeds.

    hetps compare configs/default.yaml --algorithms sync,async,ssp,grouping --repeats 3 \
        --with async optimizer.lr=0.0125 --with ssp algorithm.staleness=3 [key=value ...]
    hetps compare configs/sync.yaml --algorithms sync,solo:eager,majority:eager --with solo algorithm.quorum=solo
    hetps compare configs/default.yaml --algorithms sync,grouping --simulate 'cluster.workers={count: 64, ...}'

With `--simulate` every run is `hetps simulate`'s (virtual time, one
process; docs/simulation.md): times are virtual seconds and the tables say so.

Each run keeps the config's `algorithm` block if it names ALGO and replaces
it with `{name: ALGO}` otherwise, then applies the common overrides, then
that entry's `--with` overrides.
Writes OUT/compare.json, OUT/compare.md (median time to target, speedup over
the first algorithm, the final and the best value of the watched metric (the
models in each run's model.safetensors and best.safetensors), bytes, communication rounds,
heterogeneity efficiency and, against the `--reference` entry (default:
sync, when it is one of the entries), useful efficiency; see
scheduler/efficiency.py) and OUT/compare.png (per algorithm, the median test
accuracy over all repeats with the min-max band, against time, global steps or
bytes moved: `--x`; `hetps plot OUT --x steps` draws it again).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

from hetps.runconfig.load import apply_override, config_from_dict, load_config, load_raw
from hetps.runconfig.schema import ConfigError
from hetps.runconfig.targets import reached
from hetps.runtime.import_path import import_beside
from hetps.scheduler.efficiency import useful_efficiency
from hetps.scheduler.runlog import fits, read_metrics

from .launcher import run_local
from .plots import X_AXES, plot_compare
from .report import format_summary
from .watch import ACCURACY, number, run_metric, summary_metric, watched_rows


def algorithm_config(raw: dict, algorithm: str, common: list[str], extra: list[str], seed: int):
    raw = copy.deepcopy(raw)
    if (raw.get("algorithm") or {}).get("name") != algorithm:
        # the config's parameters belong to another algorithm
        raw["algorithm"] = {"name": algorithm}
    for assignment in [*common, *extra, f"seed={seed}"]:
        apply_override(raw, assignment)
    return config_from_dict(raw, import_targets=True)


def spread(values: list) -> list | None:
    """[min, max] of the values present (None when none is)."""
    present = [v for v in values if v is not None]
    return [min(present), max(present)] if present else None


def median_or_none(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present and len(present) == len(values) else None


def aggregate(algorithm: str, summaries: list[dict]) -> dict:
    """One table row; time to target is a median only if every repeat reached it. `metric`,
    `final_metric` and `best_metric`: the watched metric (accuracy for classification) and
    the medians of its final values (each run's model.safetensors) and of its best ones
    (best.safetensors, what hetps.load_model loads); `final_accuracy` as ever (0.0 for a task
    without accuracy)."""
    watched = [summary_metric(s) for s in summaries]
    finals = [w["final"] for w in watched if w["final"] is not None]
    bests = [w["best"] for w in watched if w["best"] is not None]
    return {
        "algorithm": algorithm,
        "metric": watched[0]["name"],
        "final_metric": statistics.median(finals) if finals else None,
        "best_metric": statistics.median(bests) if bests else None,
        "repeats": len(summaries),
        "time_to_target_s": median_or_none([s["time_to_target_s"] for s in summaries]),
        "reached": sum(s["time_to_target_s"] is not None for s in summaries),
        "final_accuracy": statistics.median(s["final_accuracy"] or 0.0 for s in summaries),
        "bytes": statistics.median(s["bytes_sent"] + s["bytes_received"] for s in summaries),
        "rounds": statistics.median(
            s.get("communication_rounds") or max(s["shard_versions"].values(), default=0)
            for s in summaries
        ),
        "global_steps": statistics.median(s["global_steps"] for s in summaries),
        "efficiency": median_or_none(
            [(s.get("efficiency") or {}).get("heterogeneity_efficiency") for s in summaries]
        ),
        "samples_to_target": median_or_none(
            [(s.get("efficiency") or {}).get("samples_to_target") for s in summaries]
        ),
        "milestones": {
            m: median_or_none([s.get("milestones", {}).get(m) for s in summaries])
            for m in summaries[0].get("milestones", {})
        },
        "milestone_spread": {
            m: spread([s.get("milestones", {}).get(m) for s in summaries])
            for m in summaries[0].get("milestones", {})
        },
        "runs": [s["run_dir"] for s in summaries],
    }


def milestone_times(run_dir: Path, values: list[float]) -> dict[str, float | None]:
    """Seconds to the first evaluation at each value of the watched metric (at or above it, at
    or below it for a lower-is-better metric; None: never), keyed "0.97"."""
    records = read_metrics(run_dir / "metrics.jsonl")
    metric = run_metric(records)
    evals = watched_rows(records, metric, t=float)
    higher = next((r["higher_is_better"] for r in evals if fits(r, higher_is_better=bool)), True)
    return {
        f"{v:g}": next((m["t"] for m in evals if reached(m[metric], v, higher)), None)
        for v in values
    }


def add_useful(rows: list[dict], reference: str | None) -> list[dict]:
    """Each row's useful efficiency against the row labelled `reference`
    (medians: efficiency x reference samples-to-target / this row's); None
    without a reference or where a median is missing."""
    ref = next((r for r in rows if r["algorithm"] == reference), None)
    for r in rows:
        r["useful_efficiency"] = useful_efficiency(
            r.get("efficiency"), ref and ref.get("samples_to_target"), r.get("samples_to_target")
        )
        r["reference"] = reference if ref else None
    return rows


def markdown(rows: list[dict], title: str) -> str:
    """compare.md: the table (final and best values of the watched metric, by its name, and
    the file that holds each model) and, under it, what the times can resolve: a target is
    seen at an evaluation, so they are quantized to the evaluation interval (rows'
    `eval_every_s`)."""
    base = rows[0]
    metric = base.get("metric", ACCURACY)
    reference = base.get("reference")
    useful = f"useful efficiency (vs {reference})" if reference else "useful efficiency"
    marks = list(base.get("milestones", {}))
    lines = [
        f"# {title}",
        "",
        f"| algorithm | time to target (s, median) | speedup over {base['algorithm']} | "
        + "".join(f"time to {m} (s) | " for m in marks)
        + f"final {metric} (median, model.safetensors) | best {metric} (median, best.safetensors) | "
        f"MB moved | rounds | steps | reached | efficiency | {useful} |",
        "|---|---|---|" + "---|" * len(marks) + "---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ttt = r["time_to_target_s"]
        speedup = (
            f"{base['time_to_target_s'] / ttt:.2f}x" if ttt and base["time_to_target_s"] else "-"
        )
        times = "".join(
            f"{_time(t, r.get('milestone_spread', {}).get(m))} | "
            for m, t in r.get("milestones", {}).items()
        )
        lines.append(
            f"| {r['algorithm']} | {'-' if ttt is None else f'{ttt:.1f}'} | {speedup} | {times}"
            f"{number(r.get('final_metric', r['final_accuracy']))} | "
            f"{number(r.get('best_metric'))} | {r['bytes'] / 1e6:.0f} | "
            f"{r['rounds']:.0f} | "
            f"{r['global_steps']:.0f} | {r['reached']}/{r['repeats']} | {_ratio(r.get('efficiency'))} | "
            f"{_ratio(r.get('useful_efficiency'))} |"
        )
    lines += [
        "",
        f"Each run's model.safetensors holds the model of its final evaluation (final {metric}), "
        f"best.safetensors that of its best one (best {metric}, with eval.keep_best): "
        "hetps.load_model(RUN_DIR) loads the best one, best=False the final one.",
    ]
    intervals = sorted({r["eval_every_s"] for r in rows if r.get("eval_every_s")})
    if intervals:
        every = " or ".join(f"{i:g} s" for i in intervals)
        lines += [
            "",
            f"Times to a target are quantized to the evaluation interval (eval.every_s: {every}): "
            "a run is seen at its target at the first evaluation that reaches it, up to one "
            "interval (plus an evaluation's duration) after it did, so rows closer than that "
            "are not told apart; a smaller eval.every_s resolves them.",
        ]
    return "\n".join(lines) + "\n"


def _time(median: float | None, span: list | None) -> str:
    """A median time, with the repeats' range when they differ: "7.5 (6.1–9.0)"."""
    if median is None:
        return "-"
    return f"{median:.1f}" + (
        f" ({span[0]:.1f}–{span[1]:.1f})" if span and span[0] != span[1] else ""
    )


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def simulated_runner():
    """A run function for `--simulate`: each run simulated in this process,
    the datasets loaded once for all of them; returns 0 (or 3 when diverged)."""
    from hetps.sim.engine import simulate
    from hetps.training.data import load_datasets

    from .plots import plot_simulated

    loaded: dict = {}

    def run(cfg, run_dir: Path) -> int:
        key = (repr(cfg.data), cfg.seed)
        if key not in loaded:
            loaded[key] = load_datasets(cfg.data, cfg.seed)
        summary = simulate(cfg, run_dir, data=loaded[key])
        plot_simulated(cfg, run_dir)
        return 3 if summary["status"] == "diverged" else 0

    return run


def simulated_sample_s(configs: dict, args: argparse.Namespace, extra: dict) -> int:
    """In place: each entry's config with the `sim.sample_s` it simulates with, measured
    on the model once for all entries unless the config or an entry sets it; says which on
    one line per figure (sample_cost.py). Returns 0, or 2 when the model cannot be
    measured (the check before training's line)."""
    from hetps.training.preflight import ConfigValueError, PreflightError

    from .sample_cost import SampleCosts, sample_s_given

    costs, said = SampleCosts(), set()
    try:
        for a, entry in configs.items():
            given = sample_s_given(args.config, [*args.overrides, *extra[a]])
            for r, cfg in enumerate(entry):
                entry[r], cost = costs(cfg, given)
                if (line := cost.line(entry[r])) not in said:
                    said.add(line)
                    print(f"hetps compare: {line}", file=sys.stderr)
    except PreflightError as exc:
        kind = "config error" if isinstance(exc, ConfigValueError) else "check failed"
        print(f"hetps: {kind}: {exc}", file=sys.stderr)
        return 2
    return 0


def compare_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hetps compare",
        description=__doc__.split("\n\n")[0].replace("\n", " "),  # its first sentence, whole
    )
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every run")
    parser.add_argument(
        "--algorithms",
        required=True,
        help="comma-separated ALGO or LABEL:ALGO, e.g. sync,async,solo:eager",
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--with",
        dest="extra",
        nargs=2,
        action="append",
        default=[],
        metavar=("LABEL", "KEY=VALUE"),
        help="an override for one entry only",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--x",
        choices=list(X_AXES),
        default="time",
        help="compare.png's x axis: wall-clock time, global steps or bytes moved (default time)",
    )
    parser.add_argument(
        "--milestones",
        default="",
        help="comma-separated values of the watched metric, e.g. 0.95,0.97 (accuracy) or 3,2.5 "
        "(perplexity): median seconds to each as columns",
    )
    parser.add_argument(
        "--reference",
        default="sync",
        help="the entry whose samples-to-target useful efficiency is measured against",
    )
    parser.add_argument(
        "--simulate", action="store_true", help="simulated runs in virtual time (hetps simulate)"
    )
    args = parser.parse_intermixed_args(argv)
    import_beside(args.config)
    try:
        # the file and the common overrides, checked once
        base = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"hetps: config error: {exc}", file=sys.stderr)
        return 2
    raw = load_raw(args.config)
    # each entry is ALGO or LABEL:ALGO (the same algorithm twice with different --with)
    entries = [e.strip() for e in args.algorithms.split(",") if e.strip()]
    labels = {e.split(":")[0]: e.split(":")[-1] for e in entries}
    algorithms = list(labels)
    unknown = sorted({name for name, _ in args.extra} - set(algorithms))
    problem = (
        "--algorithms: name at least one algorithm"
        if not algorithms
        else f"--algorithms: {args.algorithms!r} names an entry twice"
        if len(algorithms) != len(entries)
        else f"--repeats: must be >= 1, got {args.repeats}"
        if args.repeats < 1
        else f"--with {unknown[0]}: not an entry of --algorithms ({', '.join(algorithms)})"
        if unknown
        else None
    )
    if problem:
        print(f"hetps compare: {problem}", file=sys.stderr)
        return 2
    try:
        milestones = [float(m) for m in args.milestones.split(",") if m.strip()]
    except ValueError:
        print(
            f"hetps: --milestones: expected comma-separated numbers, got {args.milestones!r}",
            file=sys.stderr,
        )
        return 2
    extra = {a: [kv for name, kv in args.extra if name == a] for a in algorithms}
    try:
        configs = {
            a: [
                algorithm_config(raw, labels[a], args.overrides, extra[a], base.seed + r)
                for r in range(args.repeats)
            ]
            for a in algorithms
        }
    except ConfigError as exc:
        print(f"hetps: config error: {exc}", file=sys.stderr)
        return 2
    if args.simulate and (code := simulated_sample_s(configs, args, extra)):
        return code
    out = Path(args.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    run_one = (
        simulated_runner()
        if args.simulate
        else lambda cfg, run_dir: run_local(cfg, run_dir, quiet=True)
    )
    rows = []
    for a in algorithms:
        summaries = []
        for r, cfg in enumerate(configs[a]):
            run_dir = out / f"{a}-{r}"
            print(f"hetps compare: {a} run {r + 1}/{args.repeats} -> {run_dir}", file=sys.stderr)
            if run_one(cfg, run_dir) not in (0, 3):  # a diverged run is a result (status diverged)
                print(f"hetps compare: {a} run {r + 1} failed; see {run_dir}/logs", file=sys.stderr)
                return 1
            summary = json.loads((run_dir / "summary.json").read_text())
            # which file holds which value (report.py: hetps run's closing line)
            print(
                f"hetps compare: {a} run {r + 1}: {format_summary(summary, run_dir).splitlines()[0]}",
                file=sys.stderr,
            )
            summaries.append(
                {
                    **summary,
                    "run_dir": str(run_dir),
                    "milestones": milestone_times(run_dir, milestones),
                }
            )
        rows.append({**aggregate(a, summaries), "eval_every_s": configs[a][0].eval.every_s})
    add_useful(rows, args.reference)
    (out / "compare.json").write_text(json.dumps(rows, indent=2))
    title = f"{args.config} {' '.join(args.overrides)}".strip()
    title += " (simulated, virtual seconds)" if args.simulate else ""
    (out / "compare.md").write_text(markdown(rows, title))
    plot_compare(rows, out, args.x)
    print((out / "compare.md").read_text())
    return 0
