"""The plots of a run directory and of a comparison, and the data behind them.

    accuracy_vs_time.png   test accuracy (a marker at every evaluation) with the target line and
                           (METRIC_vs_time.png for a task watching another metric, e.g.
                           perplexity_vs_time.png; `run_plot_name`)
                           the time-to-target marker, beside test and train loss; a resumed
                           run is one curve, a dotted line where each later segment began
    groups.png             each group's updates per second over time and, while they can be
                           told apart (at most TICKS_UP_TO a lane), one lane per group with a
                           tick where its update was applied (runs with more than one group,
                           e.g. Grouping-SGD)
    compare.png            per algorithm, the median test accuracy over all repeats and the
                           min-max band, against time, steps or bytes moved

The functions that compute what is drawn (eval_curve, median_band, group_lanes,
group_rates) are pure and tested on their own; the plot_* functions only draw them.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from pathlib import Path

import numpy as np

from hetps.runconfig.targets import reached
from hetps.scheduler.nodes import LOWER_IS_BETTER
from hetps.scheduler.runlog import fits, plan_fits, read_metrics, read_summary, records_of

from .watch import ACCURACY, label, number, run_metric, summary_metric, watched_rows

# groups.png: a lane of ticks is drawn while it has at most this many (more, at 1100 px, run
# into one bar); the update rates over at most RATE_BINS spans of time, ~RATE_PER_BIN updates a
# span in the busiest lane
TICKS_UP_TO = 300
RATE_BINS = 60
RATE_PER_BIN = 10

X_AXES = {
    "time": ("t", "wall-clock time (s)"),
    "steps": ("global_steps", "global steps (all workers)"),
    "bytes": ("bytes", "bytes moved by the workers (sent + received)"),
}


def pyplot_agg():
    """matplotlib.pyplot on the Agg backend (files, no display); imported on first use (~0.6 s
    of CPU: a shared fork server imports it once for every run it serves)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def eval_curve(records: list[dict], x: str = "time") -> tuple[list[float], list[float]]:
    """(x values, test accuracies) of a run's evaluations, in order. `x`: time (seconds of
    training), steps (global steps) or bytes (workers' bytes sent + received, as the scheduler
    last heard them). Raises ValueError for another axis, or when the records lack that value
    (runs recorded before evaluations carried bytes)."""
    if x not in X_AXES:
        raise ValueError(f"x axis must be one of {', '.join(X_AXES)}, got {x!r}")
    evals = _evals(records, x)
    key = X_AXES[x][0]
    metric = run_metric(records)
    return [float(r[key]) for r in evals], [float(r[metric]) for r in evals]


def _evals(records: list[dict], x: str) -> list[dict]:
    """The evaluations that hold the watched metric (`run_metric`) and their value on axis
    `x`, in order (an evaluation without them, of another version or edited by hand, is
    skipped). Raises ValueError when no evaluation records the axis' key (runs recorded
    before it existed)."""
    key = X_AXES[x][0]
    evals = watched_rows(records, run_metric(records))
    if evals and not any(key in r for r in evals):
        raise ValueError(
            f"these evaluations do not record {key!r}, so they cannot be plotted against {x}"
        )
    return [r for r in evals if fits(r, **{key: float})]


def segment_starts(records: list[dict]) -> list[tuple[int, float]]:
    """(segment, the run's time it began at) of each segment after the first: where a resumed
    run went on (its records' times go on from the earlier segments', segments.py)."""
    return [
        (r["segment"], float(r["t"]))
        for r in records_of(records, "segment", segment=int, t=float)
        if r["segment"] > 1
    ]


def first_reach(
    xs: list[float], ys: list[float], target: float | None, higher_is_better: bool = True
) -> tuple[float, float] | None:
    """(x, value) of the first evaluation at `target` (at or above it, or at or below it for a
    lower-is-better metric); None if none or no target."""
    if target is None:
        return None
    return next(((x, y) for x, y in zip(xs, ys) if reached(y, target, higher_is_better)), None)


def median_band(curves: list[tuple[list[float], list[float]]]) -> dict[str, np.ndarray]:
    """The median and min-max band of several repeats' curves, on the union of their x values.

    Each curve is a step function: at x its value is that of its last evaluation at or before x
    (the model does not change between evaluations as far as anyone measured), and after its
    last evaluation it keeps its final value (the run stopped with that model). Before a
    curve's first evaluation it has no value and does not count. Returns arrays `x`, `median`,
    `low`, `high` and `n` (how many repeats have a value there)."""
    curves = [(np.asarray(xs, float), np.asarray(ys, float)) for xs, ys in curves if len(xs)]
    if not curves:
        return {k: np.array([]) for k in ("x", "median", "low", "high", "n")}
    grid = np.unique(np.concatenate([xs for xs, _ in curves]))
    values = np.full((len(curves), len(grid)), np.nan)
    for row, (xs, ys) in enumerate(curves):
        order = np.argsort(xs, kind="stable")
        xs, ys = xs[order], ys[order]
        index = np.searchsorted(xs, grid, side="right") - 1
        values[row, index >= 0] = ys[index[index >= 0]]
    return {
        "x": grid,
        "median": np.nanmedian(values, axis=0),
        "low": np.nanmin(values, axis=0),
        "high": np.nanmax(values, axis=0),
        "n": np.sum(~np.isnan(values), axis=0),
    }


def _plan_finder(records: list[dict]):
    """A function: step record -> id of the plan it was taken under, the latest plan at or
    before its time that has its group (a worker finishes a step or two under the old plan
    after a new one went out; plan 1 when the records hold no plan)."""
    plans = sorted(
        (float(r["t"]), r["plan_id"], len(r["groups"])) for r in filter(plan_fits, records)
    )
    starts = [t for t, _, _ in plans]

    def plan_of(record: dict) -> int:
        at = bisect.bisect_right(starts, float(record["t"])) - 1
        while at > 0 and record["group"] >= plans[at][2]:
            at -= 1
        return plans[at][1] if at >= 0 else 1

    return plan_of


def group_lanes(records: list[dict]) -> dict[tuple[int, int], list[float]]:
    """For each (plan id, group), the times (seconds of training) its updates were applied.

    A group's update of round r is applied once every member pushed step r; the members'
    step records of r arrive after it, so the earliest of them bounds when it happened.
    Group numbers are those of the plan in force (the latest plan record at or before the
    step's time that has that group): a re-plan may regroup the workers under the same
    numbers. Records without a group (e.g. a client that sends none) are skipped."""
    rounds: dict[tuple[int, int, int], float] = {}
    plan_of = _plan_finder(records)
    for r in _grouped_steps(records):
        key = (plan_of(r), r["group"], r["step"])
        rounds[key] = min(rounds.get(key, float("inf")), float(r["t"]))
    lanes: dict[tuple[int, int], list[float]] = {}
    for (plan, group, _), t in rounds.items():
        lanes.setdefault((plan, group), []).append(t)
    return {key: sorted(ts) for key, ts in sorted(lanes.items())}


def group_rates(
    lanes: dict[tuple[int, int], list[float]], bins: int | None = None
) -> tuple[np.ndarray, dict[tuple[int, int], np.ndarray]]:
    """Each lane's updates per second (`group_lanes`' times) in `bins` equal spans from the
    run's first update to its last: (the spans' edges, seconds; {lane: rate in each span}).
    `bins` defaults to about RATE_PER_BIN updates a span in the busiest lane, at most
    RATE_BINS. A lane's rates times the spans' widths add up to its count of updates."""
    times = [t for ts in lanes.values() for t in ts]
    if not times:
        return np.array([0.0, 1.0]), {key: np.zeros(1) for key in lanes}
    busiest = max(len(ts) for ts in lanes.values())
    bins = bins or min(RATE_BINS, max(1, busiest // RATE_PER_BIN))
    low, high = min(times), max(times)
    edges = np.linspace(low, high if high > low else low + 1.0, bins + 1)
    widths = np.diff(edges)
    return edges, {key: np.histogram(ts, edges)[0] / widths for key, ts in lanes.items()}


def lane_members(records: list[dict], lanes: dict) -> dict[tuple[int, int], list[int]]:
    """The worker ranks whose step records fell into each lane of `group_lanes`."""
    members: dict[tuple[int, int], set] = {key: set() for key in lanes}
    plan_of = _plan_finder(records)
    for r in _grouped_steps(records):
        members.setdefault((plan_of(r), r["group"]), set()).add(r["worker"])
    return {key: sorted(ws) for key, ws in members.items()}


def _grouped_steps(records: list[dict]) -> list[dict]:
    return records_of(records, "step", t=float, worker=int, step=int, group=int)


def run_title(summary: dict, fallback: str = "") -> str:
    """E.g. `default: grouping, 4 workers: 95% reached at 3.6 s (final 0.9630)`, or for
    another metric `lm: sync, 4 workers: perplexity 3 reached at 41.2 s (final perplexity 2.9120)`."""
    name = f"{summary.get('name', '')}: {summary.get('algorithm', '')}".strip(": ") or fallback
    workers = sum(1 for n in summary.get("per_node", {}) if n.startswith("worker"))
    head = f"{name}, {workers} workers" if workers else name
    watched = summary_metric(summary)
    target, ttt, final = watched["target"], summary.get("time_to_target_s"), watched["final"]
    accuracy = watched["name"] == ACCURACY
    parts = []
    if target is not None:
        goal = f"{target:.0%}" if accuracy else f"{watched['name']} {target:g}"
        parts.append(f"{goal} reached at {ttt:.1f} s" if ttt is not None else f"{goal} not reached")
    if final is not None:
        parts.append(
            f"final {final:.4f}" if accuracy else f"final {watched['name']} {number(final)}"
        )
    return head + (": " + ", ".join(parts) if parts else "")


RUN_PLOT_MARGINS = dict(left=0.065, right=0.935, bottom=0.12, top=0.87, wspace=0.3)


def plot_run(run_dir: Path, title: str = "") -> Path:
    """Write RUN_DIR/accuracy_vs_time.png, or METRIC_vs_time.png for a run watching another
    metric (`run_plot_name`), and groups.png when the run had several groups, from
    metrics.jsonl and summary.json; returns the metric plot's path. The x axis is virtual
    time for a run of `hetps simulate` (its summary has `simulation`)."""
    plt = pyplot_agg()
    records = read_metrics(run_dir / "metrics.jsonl")
    summary = read_summary(run_dir) or {}
    metric = run_metric(records)
    watched = summary_metric(summary)
    same = watched["name"] == metric  # the summary's target is a value of the plotted metric
    target = watched["target"] if same else None
    higher = watched["higher_is_better"] if same else metric not in LOWER_IS_BETTER
    clock = time_axis(summary)
    evals = _evals(records, "time")
    xs, ys = [float(r["t"]) for r in evals], [float(r[metric]) for r in evals]
    # an evaluation without a loss leaves a gap in the loss curve
    losses = [float(r["loss"]) if fits(r, loss=float) else math.nan for r in evals]
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_acc.plot(
        xs, ys, marker="o", markersize=3.5, label=f"{label(metric)} (each marker: one evaluation)"
    )
    if target is not None:
        ax_acc.axhline(
            target, color="tab:red", linestyle="--", linewidth=1, label=f"target {target}"
        )
    reached = first_reach(xs, ys, target, higher)
    if reached is not None:
        ax_acc.axvline(reached[0], color="tab:green", linestyle=":", linewidth=1)
        ax_acc.plot(
            [reached[0]],
            [reached[1]],
            marker="*",
            markersize=13,
            color="tab:green",
            linestyle="none",
            label=f"target reached at {reached[0]:.1f} s",
        )
    ax_acc.set(
        xlabel=f"{clock} since the first plan (s)", ylabel=label(metric), title=label(metric)
    )
    _mark_segments((ax_acc, ax_loss), segment_starts(records))
    ax_acc.grid(alpha=0.3)
    ax_acc.legend(loc="lower right" if higher else "upper right", fontsize=8)
    _plot_loss(
        ax_loss, records, xs, losses, clock, "cross-entropy" if metric == ACCURACY else "loss"
    )
    _plot_lr(ax_loss, evals)
    fig.suptitle(run_title(summary, title))
    # fixed margins for this fixed layout: tight_layout measured every tick label, half the
    # plot's CPU (~0.4 s per run)
    fig.subplots_adjust(**RUN_PLOT_MARGINS)
    out = run_dir / run_plot_name(metric)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    if len({group for _, group in group_lanes(records)}) > 1:
        plot_groups(run_dir, records, clock)
    return out


def run_plot_name(metric: str) -> str:
    """The run plot's file name: accuracy_vs_time.png, or e.g. perplexity_vs_time.png (a name
    a task gave its metric is kept to letters, digits, `_`, `-` and `.`)."""
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', metric)}_vs_time.png"


def time_axis(summary: dict) -> str:
    """`virtual time` for a run of `hetps simulate` (docs/simulation.md), else `wall-clock time`."""
    return "virtual time" if summary.get("simulation") else "wall-clock time"


def _mark_segments(axes, starts: list[tuple[int, float]]) -> None:
    """A dotted line on each of `axes` where a resumed run's segment began (labelled once)."""
    for i, (segment, t) in enumerate(starts):
        for ax in axes:
            ax.axvline(
                t,
                color="tab:gray",
                linestyle=":",
                linewidth=1.2,
                label="resumed (a new segment)" if i == 0 and ax is axes[0] else None,
            )
            ax.annotate(
                f"segment {segment}",
                (t, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(2, -10),
                textcoords="offset points",
                fontsize=7,
                color="tab:gray",
            )


def plot_simulated(cfg, run_dir: Path) -> Path:
    """`plot_run` for a run of `hetps simulate` (its times are virtual seconds)."""
    return plot_run(run_dir, f"{cfg.name}: {cfg.algorithm.name} (simulated, virtual seconds)")


def _plot_loss(
    ax,
    records: list[dict],
    xs: list[float],
    losses: list[float],
    clock: str = "wall-clock time",
    ylabel: str = "cross-entropy",
) -> None:
    ax.plot(xs, losses, marker="o", markersize=3.5, label="test loss")
    # a client's steps may carry no loss
    steps = sorted(records_of(records, "step", t=float, loss=float), key=lambda r: r["t"])
    if steps:
        window = max(1, len(steps) // 50)
        chunks = [steps[i : i + window] for i in range(0, len(steps), window)]
        ax.plot(
            [c[0]["t"] for c in chunks],
            [sum(r["loss"] for r in c) / len(c) for c in chunks],
            alpha=0.7,
            label=f"train loss (mean of {window} steps)",
        )
    ax.set(xlabel=f"{clock} since the first plan (s)", ylabel=ylabel, title="loss")
    if any(v > 0 for v in losses):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _plot_lr(ax, evals: list[dict]) -> None:
    """The shards' lr at each evaluation (the rows' `lr`), on a second axis of the loss plot;
    nothing when no row carries one (model averaging, diloco)."""
    rows = [r for r in evals if fits(r, lr=float)]
    if not rows:
        return
    twin = ax.twinx()
    twin.step(
        [float(r["t"]) for r in rows],
        [float(r["lr"]) for r in rows],
        where="post",
        color="tab:gray",
        linestyle="--",
        linewidth=1,
        label="lr (the shards')",
    )
    twin.set_ylabel("learning rate")
    twin.set_ylim(bottom=0)
    twin.legend(loc="lower left", fontsize=8)


def workers_label(members: list) -> str:
    """A group's workers for a legend: their ranks while few, else how many (a legend of 84
    ranks leaves no room for the plot)."""
    if len(members) <= 8:
        return "workers " + ", ".join(map(str, members))
    return f"{len(members)} workers: {members[0]}, {members[1]}, ... {members[-1]}"


def plot_groups(
    run_dir: Path, records: list[dict] | None = None, clock: str = "wall-clock time"
) -> Path:
    """Write RUN_DIR/groups.png: each group's updates per second over time (group_rates) and,
    while every lane has at most TICKS_UP_TO updates, one lane per group of each plan with a
    tick at each of its updates; a dashed line where the plan changed. Returns its path."""
    plt = pyplot_agg()
    records = records if records is not None else read_metrics(run_dir / "metrics.jsonl")
    lanes = group_lanes(records)
    members = lane_members(records, lanes)
    several_plans = len({plan for plan, _ in lanes}) > 1
    names = {
        (plan, group): (f"plan {plan}, " if several_plans else "")
        + f"group {group} ({workers_label(members[(plan, group)])}): {len(ts)}"
        for (plan, group), ts in lanes.items()
    }
    ticks = bool(lanes) and max(map(len, lanes.values())) <= TICKS_UP_TO
    height = 3.2 + (0.8 + 0.5 * len(lanes) if ticks else 0.0)
    fig, axes = plt.subplots(
        2 if ticks else 1,
        1,
        figsize=(11, height),
        sharex=True,
        squeeze=False,
        height_ratios=[3.2, 0.8 + 0.5 * len(lanes)] if ticks else None,
    )
    ax = axes[0][0]
    edges, rates = group_rates(lanes)
    for key, rate in rates.items():
        ax.stairs(rate, edges, label=names[key], linewidth=1.2)
    ax.set(
        ylabel="updates per second",
        title=f"each group's update rate (mean over spans of {edges[1] - edges[0]:.2g} s; "
        "count of updates after the colon; dashed: a new plan)",
    )
    ax.legend(fontsize=8, loc="best")
    if ticks:
        keys = list(lanes)[::-1]  # the first plan's groups on top
        lane_ax = axes[1][0]
        lane_ax.eventplot(
            [lanes[k] for k in keys], lineoffsets=range(len(keys)), linelengths=0.7, linewidths=0.8
        )
        lane_ax.set_yticks(range(len(keys)), [names[k] for k in keys])
        lane_ax.set(title="when each group's update was applied")
    for each in axes[:, 0]:
        for r in filter(plan_fits, records):
            if r["plan_id"] > 1:
                each.axvline(r["t"], color="grey", linestyle="--", linewidth=0.8)
        each.grid(alpha=0.3, axis="x")
    axes[-1][0].set(xlabel=f"{clock} since the first plan (s)")
    fig.tight_layout()
    out = run_dir / "groups.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def compare_bands(rows: list[dict], x: str = "time") -> dict[str, dict[str, np.ndarray]]:
    """Per algorithm (compare.json rows), the median_band of all its repeats' accuracy curves."""
    return {
        r["algorithm"]: median_band(
            [eval_curve(read_metrics(Path(run) / "metrics.jsonl"), x) for run in r["runs"]]
        )
        for r in rows
    }


def plot_compare(rows: list[dict], out: Path, x: str = "time") -> Path:
    """Write OUT/compare.png: per algorithm the median accuracy of its repeats and the min-max
    band, against `x` (time, steps or bytes), with the runs' target; returns its path. Raises
    ValueError for an axis the runs did not record."""
    plt = pyplot_agg()
    bands = compare_bands(rows, x)
    first = (read_summary(Path(rows[0]["runs"][0])) or {}) if rows and rows[0]["runs"] else {}
    watched = summary_metric(first)
    target, metric = watched["target"], watched["name"]
    # the same axes for a run of hetps simulate, but its seconds are virtual
    xlabel = "virtual time (s)" if x == "time" and first.get("simulation") else X_AXES[x][1]
    fig, ax = plt.subplots(figsize=(8, 5))
    for algorithm, band in bands.items():
        repeats = int(band["n"].max()) if len(band["n"]) else 0
        (line,) = ax.step(
            band["x"], band["median"], where="post", label=f"{algorithm} (median of {repeats})"
        )
        ax.fill_between(
            band["x"], band["low"], band["high"], step="post", alpha=0.2, color=line.get_color()
        )
    if target is not None:
        ax.axhline(target, color="tab:red", linestyle="--", linewidth=1, label=f"target {target}")
    ax.set(
        xlabel=xlabel,
        ylabel=label(metric),
        title=f"{label(metric)}: median over repeats, band from min to max",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "compare.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_command(argv: list[str]) -> int:
    """`hetps plot DIR [--x time|steps|bytes]`: draw a run directory's plots again, or a
    comparison's (a directory with compare.json) against the chosen axis."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="hetps plot", description=plot_command.__doc__.splitlines()[0]
    )
    parser.add_argument("dir", help="a run directory, or the output directory of hetps compare")
    parser.add_argument(
        "--x", choices=list(X_AXES), default="time", help="compare.png's x axis (default time)"
    )
    args = parser.parse_args(argv)
    folder = Path(args.dir)
    try:
        if (folder / "compare.json").exists():
            written = [
                plot_compare(json.loads((folder / "compare.json").read_text()), folder, args.x)
            ]
        elif (folder / "metrics.jsonl").exists():
            written = [plot_run(folder)] + (
                [folder / "groups.png"] if (folder / "groups.png").exists() else []
            )
        else:
            print(
                f"hetps plot: {folder} has neither compare.json nor metrics.jsonl", file=sys.stderr
            )
            return 2
    except ValueError as exc:
        print(f"hetps plot: {exc}", file=sys.stderr)
        return 2
    print("\n".join(map(str, written)))
    return 0
