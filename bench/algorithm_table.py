"""The same config under every algorithm, task by task: median time to target
over seeds, how many seeds reached it, diverged or never did, and each
entry's ratio to sync, as one markdown table and one JSON file.

    .venv/bin/python bench/algorithm_table.py                        # every task and entry: hours
    .venv/bin/python bench/algorithm_table.py --tasks regression-4-sim,sines-4-sim --seeds 1
    .venv/bin/python bench/algorithm_table.py --tasks mnist-64-sim,mnist-64-sim-free \\
        --only-entries sync,grouping --entry grouping-pg:grouping:algorithm.optimizer_state=per_group
    .venv/bin/python bench/algorithm_table.py --dry-run               # the hetps compare lines only

Every run is `hetps compare` (a subprocess; nothing here runs training):

    hetps compare CONFIG --algorithms LABEL:ALGO --repeats 1 [--with LABEL KEY=VALUE ...]
        [--simulate] --out OUT/TASK/LABEL-seedS TASK_OVERRIDES... [--set ...] seed=S

one compare per task, entry and seed (seeds 0 .. N-1, as compare's repeats
of a seed-0 config), because a run whose push holds NaN ends a compare
with a traceback (a simulated shard refuses it: RuntimeError, no
summary.json) and would take the other seeds and entries with it; such a
run is counted as diverged ("nonfinite" in the JSON). As `hetps compare`
does, an entry keeps the config's `algorithm` block only if it names the
entry's algorithm (so async runs at the config's lr, diloco with its
defaults on every config but one that names diloco). A piece whose
OUT/TASK/LABEL-seedS/result.json holds the same command line is not run
again (delete the folder to rerun it); a changed command reruns it. Each
entry is checked against each task's config before anything runs; a config error is that cell's "n/a" (exit status 2 at the
end), and so is a combination the simulator refuses (diloco with ctr's
sparse tables; not an error); a failed run is counted as "failed" (exit 1).

Writes OUT/algorithm_table.md (printed too) and OUT/algorithm_table.json.
Simulated rows are in virtual seconds (`hetps simulate`, docs/simulation.md),
real rows in wall-clock seconds from the first plan. A median counts a seed
that never reached the target (time limit, diverged) as infinitely late, so
it is defined while more than half the seeds reached it; "(2/3)" says how
many did.

`sim.sample_s` is pinned per task so simulated rows repeat to the step:
0.0002 for LeNet-5 (the figure of the docs' simulated tables), and for the
other models the figure `hetps simulate` measured on the 2-core development
machine on 2026-12-02 (LeNet-5 measured 0.000134 there): charlm 0.0012,
ctr 1.1e-05, regression 1.7e-05, sines 5.2e-05. The small tasks' configs
ship with two equal workers; here they run on four at slowdown [1, 1, 3, 3],
as charlm's and the default experiment's, so there is a speed spread to
handle. `mnist-64-sim-free` sets only `sim.shard_message_s=0` (the issue's
criterion; docs/simulation.md's "free shard" zeroes all four shard costs).
Groups of 8 or more reduce before the shards (`comm.aggregate: auto`, the
default); `--set comm.aggregate=off` compares with the tables made before
2026-12-02.

Cost, measured 2026-12-02 on the 2-core development machine (x86_64, torch
2.14.1), real minutes per row, every entry x 3 seeds (one compare
subprocess a piece, start-up included). The real rows ran alone; the
simulated ones two or three at a time at `nice 19`, so alone they take
about half as long:

| task | a row, 9 entries x 3 seeds | the slowest pieces |
|---|---|---|
| mnist-4-real, mnist-6-real | about 5 min each | async (40 s limit a run) |
| regression-4-sim, sines-4-sim, ctr-4-sim | 5 to 8 min each | async (time limit) |
| charlm-4-sim | about 8 min | async (12.75 virtual s) |
| mnist-64-sim-free, mnist-64-sim | 17 and 24 min | grouping-mc, async-share, diloco |
| mnist-256-sim | about 60 min | sync (7 virtual s), grouping-shared and async-share (never: 10 virtual s) |

The whole table, 3 seeds: about 2.5 hours. A simulated piece costs 14
(sync) to 55 (diloco) real s per virtual s at 64 workers, about 20 (sync)
at 256, and an entry that never reaches its target runs to
`stop.max_seconds`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path


@dataclass(frozen=True)
class Entry:
    """A column: `algorithm` with its own overrides, named `label` (compare's LABEL:ALGO)."""

    label: str
    algorithm: str
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class Task:
    """A row: a config, simulated or real, and the overrides every entry runs it with."""

    name: str  # what --tasks names
    label: str  # the table's row
    config: str
    simulate: bool
    overrides: tuple[str, ...] = ()


# The columns: each algorithm at its defaults, and each option of the
# asynchrony-aware updates (docs/algorithms.md, "Updates across groups") on
# its own. More without editing this file:
#   --entry grouping-dc1:grouping:algorithm.delay_compensation=1.0
ENTRIES = [
    Entry("sync", "sync"),
    Entry("async", "async"),
    Entry("async-share", "async", ("algorithm.lr_share=true",)),
    Entry("grouping", "grouping"),
    Entry("grouping-shared", "grouping", ("algorithm.optimizer_state=shared",)),
    Entry("grouping-mc", "grouping", ("algorithm.momentum_correction=true",)),
    Entry("grouping-dc", "grouping", ("algorithm.delay_compensation=0.5",)),
    Entry("grouping-share", "grouping", ("algorithm.lr_share=true",)),
    Entry("diloco", "diloco"),
]

REFERENCE = "sync"  # ratios are each entry's median over this entry's

LENET = "configs/default.yaml"  # LeNet-5 on mnist-5k, lr 0.025, grouping's block
LENET_SAMPLE_S = "sim.sample_s=0.0002"


def _classes(count: int) -> str:
    return (
        f"cluster.workers={{count: {count}, speeds: {{classes: [{{slowdown: 1, fraction: 0.3334}}, "
        "{slowdown: 2, fraction: 0.3333}, {slowdown: 4, fraction: 0.3333}]}}"
    )


def _workers(slowdowns: list[int]) -> str:
    return "cluster.workers=[" + ", ".join(f"{{slowdown: {s}}}" for s in slowdowns) + "]"


# a real row's runs share two cores with ten processes: keep them short
REAL = ("eval.every_s=0.5", "stop.max_seconds=40", "stop.diverge_warmup_s=5")
SIM64 = (
    _classes(64),
    "data.batch_size=8",
    "eval.every_s=0.05",
    "stop.max_seconds=8",
    # at 64 and 256 workers accuracy can fall to chance early and recover
    # (docs/simulation.md, "Scale"): diverged only after 1 s at chance
    "stop.diverge_warmup_s=1",
    "stop.diverged_after=20",
    LENET_SAMPLE_S,
)
FOUR = _workers([1, 1, 3, 3])

TASKS = [
    Task("mnist-4-real", "mnist-5k, 4 real", LENET, False, REAL),
    Task("mnist-6-real", "mnist-5k, 6 real", LENET, False, (_workers([1, 1, 2, 2, 4, 4]), *REAL)),
    Task("mnist-64-sim", "mnist-5k, 64 sim", LENET, True, SIM64),
    Task(
        "mnist-64-sim-free",
        "mnist-5k, 64 sim, free shard",
        LENET,
        True,
        (*SIM64, "sim.shard_message_s=0"),
    ),
    Task(
        "mnist-256-sim",
        "mnist-5k, 256 sim",
        LENET,
        True,
        (
            _classes(256),
            "data.batch_size=8",
            "eval.every_s=0.1",
            "stop.max_seconds=10",
            # sync seed 0 fell from 0.78 to chance near 2 s and reached 95% at 7.0 s; with
            # diverge_warmup_s=2 and 5 evaluations at chance it was stopped as diverged
            "stop.diverge_warmup_s=4",
            "stop.diverged_after=20",
            LENET_SAMPLE_S,
        ),
    ),
    Task(
        "charlm-4-sim",
        "charlm, 4 sim",
        "configs/charlm.yaml",
        True,
        (
            "sim.sample_s=0.0012",
            "eval.every_s=0.25",
            "stop.max_seconds=30",
            "stop.diverge_warmup_s=5",
        ),
    ),
    Task(
        "ctr-4-sim",
        "ctr, 4 sim",
        "configs/ctr.yaml",
        True,
        (
            FOUR,
            "sim.sample_s=1.1e-05",
            "eval.every_s=0.1",
            "stop.max_seconds=8",
            "stop.diverge_warmup_s=2",
        ),
    ),
    Task(
        "regression-4-sim",
        "regression, 4 sim",
        "configs/regression.yaml",
        True,
        (
            FOUR,
            "sim.sample_s=1.7e-05",
            "eval.every_s=0.005",
            "stop.max_seconds=2",
            "stop.diverge_warmup_s=0.5",
        ),
    ),
    Task(
        "sines-4-sim",
        "sines, 4 sim",
        "configs/sines.yaml",
        True,
        (
            FOUR,
            "sim.sample_s=5.2e-05",
            "eval.every_s=0.02",
            "stop.max_seconds=4",
            "stop.diverge_warmup_s=1",
            "stop.diverged_after=10",
        ),
    ),
]

# the criterion: grouping at least this much sooner than sync on these rows
SPEEDUP_ROWS = {"mnist-64-sim-free": 1.5}

LABEL = re.compile(r"[A-Za-z0-9_.-]+")
DIVERGED, NONFINITE, COMPLETED, FAILED = "diverged", "nonfinite", "completed", "failed"
CONFIG_ERROR = "config error"  # the entry's overrides do not fit the config: exit status 2
UNSUPPORTED = "unsupported"  # the simulator refuses the combination (SimulationError), e.g.
# diloco with ctr's sparse tables: the cell is n/a, not an error


def parse_entry(text: str) -> Entry:
    """`LABEL:ALGO[:KEY=VALUE[;KEY=VALUE...]]` as an Entry. Raises ValueError naming
    what is wrong (a LABEL of letters, digits, `_.-`; an ALGO; each override KEY=VALUE)."""
    parts = text.split(":", 2)
    if len(parts) < 2 or not parts[1]:
        raise ValueError(f"--entry {text!r}: expected LABEL:ALGO[:KEY=VALUE[;KEY=VALUE...]]")
    label, algorithm = parts[0], parts[1]
    if not LABEL.fullmatch(label):
        raise ValueError(f"--entry {text!r}: the label {label!r} must be letters, digits, _ . -")
    overrides = (
        tuple(kv.strip() for kv in parts[2].split(";") if kv.strip()) if len(parts) > 2 else ()
    )
    bad = [kv for kv in overrides if "=" not in kv]
    if bad:
        raise ValueError(f"--entry {text!r}: {bad[0]!r} is not KEY=VALUE")
    return Entry(label, algorithm, overrides)


def select(items: list, names: str | None, what: str) -> list:
    """The items whose `name` (--tasks) or `label` is in the comma list `names`, in the
    order named (all of them for None). Raises ValueError for a name that is none of them."""
    key = (lambda i: i.name) if what == "--tasks" else (lambda i: i.label)
    if names is None:
        return list(items)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {key(i): i for i in items}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"{what}: {unknown[0]!r} is not one of {', '.join(known)}")
    return [known[n] for n in wanted]


def compare_argv(task: Task, entry: Entry, seed: int, out: Path, common: list[str]) -> list[str]:
    """The `hetps compare` command line of one task, entry and seed, run into `out`."""
    hetps = str(Path(sys.executable).with_name("hetps"))
    argv = [hetps, "compare", task.config, "--algorithms", f"{entry.label}:{entry.algorithm}"]
    argv += ["--repeats", "1"]
    for kv in entry.overrides:
        argv += ["--with", entry.label, kv]
    argv += ["--simulate"] if task.simulate else []
    return [*argv, "--out", str(out), *task.overrides, *common, f"seed={seed}"]


def config_error(task: Task, entry: Entry, common: list[str]) -> str | None:
    """What `hetps compare` would refuse in this task's config under this entry (its
    config error's text), or None; built as compare builds it (frontend/compare.py
    `algorithm_config`), without running anything."""
    from hetps.frontend.compare import algorithm_config
    from hetps.runconfig.load import load_config, load_raw
    from hetps.runconfig.schema import ConfigError
    from hetps.runtime.import_path import import_beside

    import_beside(task.config)
    try:
        load_config(task.config, [*task.overrides, *common])
        algorithm_config(
            load_raw(task.config),
            entry.algorithm,
            [*task.overrides, *common],
            list(entry.overrides),
            0,
        )
    except ConfigError as exc:
        return str(exc)
    return None


def read_piece(piece: Path, rc: int, log: str) -> dict:
    """One run's outcome from its compare's folder: status (completed, diverged,
    nonfinite: a push held NaN or Inf and the run ended with an error, failed, config
    error), time to target (None: never) and the watched metric's best value."""
    result = {"status": FAILED, "time_to_target_s": None, "metric": None, "best": None}
    if rc == 2:
        return {**result, "status": CONFIG_ERROR, "error": _tail(log)}
    if rc != 0 and "SimulationError:" in log:
        return {**result, "status": UNSUPPORTED, "error": _tail(log)}
    compare_json = piece / "compare.json"
    if rc != 0 or not compare_json.exists():
        status = NONFINITE if "NaN or Inf" in log else FAILED
        return {**result, "status": status, "error": _tail(log)}
    row = json.loads(compare_json.read_text())[0]
    run_dir = Path(row["runs"][0])
    if not run_dir.is_absolute() or not run_dir.exists():
        run_dir = piece / run_dir.name
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        **result,
        "status": summary.get("status", COMPLETED),
        "time_to_target_s": row["time_to_target_s"],
        "metric": row.get("metric"),
        "best": row.get("best_metric"),
        "run_dir": str(run_dir),
    }


def _tail(log: str) -> str:
    lines = [line for line in log.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _command(argv: list[str]) -> list[str]:
    """A compare line as a piece's result remembers it: without the hetps path and the
    --out folder, so a moved OUT or another checkout keeps its results."""
    out = argv.index("--out")
    return argv[1:out] + argv[out + 2 :]


def run_piece(argv: list[str], piece: Path) -> dict:
    """Runs one compare into `piece` (blocking; its output in piece/compare.log) unless
    piece/result.json holds the result of the same command line; returns the result with
    `real_s`, the subprocess's wall-clock seconds. A folder left by another command is
    removed first."""
    done, command = piece / "result.json", _command(argv)
    if done.exists() and (kept := json.loads(done.read_text())).get("command") == command:
        return kept
    if piece.exists():  # another command's, or one cut short: none of its files may be read
        shutil.rmtree(piece)
    piece.mkdir(parents=True)
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=4 * 3600)
    real_s = time.monotonic() - start
    log = proc.stdout + proc.stderr
    (piece / "compare.log").write_text(shlex.join(argv) + "\n" + log)
    result = {**read_piece(piece, proc.returncode, log), "real_s": round(real_s, 1)}
    result["command"] = command
    done.write_text(json.dumps(result, indent=2))
    return result


def cell(runs: list[dict]) -> dict:
    """An entry's outcome on a task over its seeds: the median time to target with a
    never-reached seed as infinitely late (None while half or more never reached it, or
    no run finished), reached/diverged/never-reached/failed counts and the real seconds
    they cost."""
    refused = [r for r in runs if r["status"] in (CONFIG_ERROR, UNSUPPORTED)]
    if refused:
        return {"not_applicable": refused[0]["error"], "status": refused[0]["status"]}
    finished = [r for r in runs if r["status"] != FAILED]
    times = [r["time_to_target_s"] for r in finished]
    median = statistics.median(math.inf if t is None else t for t in times) if times else None
    diverged = sum(r["status"] in (DIVERGED, NONFINITE) for r in finished)
    reached = sum(t is not None for t in times)
    return {
        "median_s": None if median is None or math.isinf(median) else median,
        "seeds": len(runs),
        "finished": len(finished),
        "reached": reached,
        "diverged": diverged,
        "never_reached": len(finished) - reached - diverged,
        "failed": len(runs) - len(finished),
        "times_s": [r["time_to_target_s"] for r in runs],
        "statuses": [r["status"] for r in runs],
        "real_s": round(sum(r.get("real_s", 0.0) for r in runs), 1),
    }


def build_rows(tasks: list[Task], entries: list[Entry], results: dict) -> list[dict]:
    """One row per task: each entry's `cell` over `results[(task.name, label)]` (a list of
    read_piece results, one per seed) and its median's ratio to the reference's."""
    rows = []
    for task in tasks:
        cells = {e.label: cell(results[(task.name, e.label)]) for e in entries}
        ref = (cells.get(REFERENCE) or {}).get("median_s")
        for c in cells.values():
            m = c.get("median_s")
            c["ratio_to_reference"] = m / ref if m is not None and ref else None
        rows.append(
            {
                "task": task.name,
                "label": task.label,
                "simulated": task.simulate,
                "config": task.config,
                "overrides": list(task.overrides),
                "cells": cells,
            }
        )
    return rows


def _time(c: dict) -> str:
    if "not_applicable" in c:
        return "n/a"
    if not c["finished"]:
        return "failed"
    m = c["median_s"]
    m = "-" if m is None else f"{m:.3g}" if m < 1 else f"{m:.2f}"
    return m if c["reached"] == c["seeds"] else f"{m} ({c['reached']}/{c['seeds']})"


def _outcomes(c: dict) -> str:
    if "not_applicable" in c:
        return "n/a"
    text = f"{c['diverged']} / {c['never_reached']}"
    return text + (f" ({c['failed']} failed)" if c["failed"] else "")


def _ratio(c: dict) -> str:
    r = c.get("ratio_to_reference")
    return "-" if r is None else f"{r:.2f}"


def criterion(rows: list[dict]) -> list[str]:
    """The issue's test, per row: grouping's median at or below sync's, and on the rows of
    SPEEDUP_ROWS that many times sooner."""
    lines = []
    for row in rows:
        g, s = row["cells"].get("grouping"), row["cells"].get(REFERENCE)
        if not g or not s or "not_applicable" in g or "not_applicable" in s:
            continue
        gm, sm = g["median_s"], s["median_s"]
        need = SPEEDUP_ROWS.get(row["task"], 1.0)
        if gm is None or sm is None:
            verdict = (
                "no: grouping's median is undefined" if gm is None else "yes: sync's is undefined"
            )
        else:
            verdict = f"{'yes' if sm / gm >= need else 'no'}: {sm / gm:.2f}x sooner"
        lines.append(f"- {row['label']}: grouping at least {need:g}x sooner than sync? {verdict}")
    return lines


def markdown(rows: list[dict], entries: list[Entry], header: dict) -> str:
    """algorithm_table.md: the times, the outcomes, the ratios to sync and the real
    seconds each cell cost, under the command, date and machine that made them."""
    labels = [e.label for e in entries]
    cols = " | ".join(labels)
    rule = "|---|" + "---|" * len(labels)

    def table(fmt, units: bool = False) -> list[str]:
        lines = [f"| task | {cols} |", rule]
        for row in rows:
            unit = (" (virtual s)" if row["simulated"] else " (wall s)") if units else ""
            cells = " | ".join(fmt(row["cells"][label]) for label in labels)
            lines.append(f"| {row['label']}{unit} | {cells} |")
        return lines

    entry_lines = [
        f"- {e.label}: `algorithm.name={e.algorithm}`" + "".join(f" `{kv}`" for kv in e.overrides)
        for e in entries
    ]
    lines = [
        "# Time to target: the same config under every algorithm",
        "",
        f"Run {header['date']} on {header['machine']}, commit {header['commit']}:",
        "",
        "```sh",
        header["command"],
        "```",
        "",
        f"Seeds {', '.join(map(str, header['seeds']))}; one `hetps compare` per task, entry "
        "and seed (the JSON lists each command's overrides). Entries:",
        "",
        *entry_lines,
        "",
        "Median time to target (s; simulated rows in virtual seconds, real rows in "
        "wall-clock seconds from the first plan; a seed that never reached the target counts "
        "as infinitely late, `-`: half or more never did; (n/N): seeds that reached it):",
        "",
        *table(_time, units=True),
        "",
        "Diverged / never reached (stopped at its time limit below the target) per entry "
        "(diverged includes a run ended by NaN or Inf in a push):",
        "",
        *table(_outcomes),
        "",
        f"Median over {REFERENCE}'s median (below 1: sooner than {REFERENCE}):",
        "",
        *table(_ratio),
        "",
        "Real seconds each cell cost (all its seeds, start-up included):",
        "",
        *table(lambda c: "-" if "not_applicable" in c else f"{c['real_s']:.0f}"),
        "",
        "The criterion (grouping's median at most sync's; 1.5x sooner on the "
        "64-worker free-shard row):",
        "",
        *(criterion(rows) or ["- (no row has both grouping and sync)"]),
    ]
    refused = [
        f"- {row['label']}, {label} ({c['status']}): {c['not_applicable']}"
        for row in rows
        for label, c in row["cells"].items()
        if "not_applicable" in c
    ]
    if refused:
        lines += ["", "Not run (n/a):", "", *refused]
    return "\n".join(lines) + "\n"


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "?"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{os.cpu_count()} cores ({cpu}, {platform.machine()}), Python "
        f"{platform.python_version()}, torch {torch}, load average {load:.1f} at the start"
    )


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/algorithm_table.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--tasks", help=f"comma list of {', '.join(t.name for t in TASKS)}")
    parser.add_argument(
        "--entry",
        action="append",
        default=[],
        metavar="LABEL:ALGO[:KEY=VALUE[;KEY=VALUE...]]",
        help="one more column (repeatable), e.g. grouping-pg:grouping:algorithm.optimizer_state=per_group",
    )
    parser.add_argument("--only-entries", help="comma list of entry labels (built-in and --entry)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 (default 3)")
    parser.add_argument(
        "--set",
        dest="common",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for every task and entry, e.g. comm.aggregate=off",
    )
    parser.add_argument("--out", default="runs/algorithm-table")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the compare command lines, run nothing"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        every = ENTRIES + [parse_entry(e) for e in args.entry]
        labels = [e.label for e in every]
        if twice := sorted({label for label in labels if labels.count(label) > 1}):
            raise ValueError(f"--entry: the label {twice[0]!r} names two entries")
        entries = select(every, args.only_entries, "--only-entries")
        tasks = select(TASKS, args.tasks, "--tasks")
        if args.seeds < 1:
            raise ValueError(f"--seeds: must be >= 1, got {args.seeds}")
    except ValueError as exc:
        print(f"algorithm_table: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    seeds = list(range(args.seeds))
    plan = [
        (task, entry, seed, out / task.name / f"{entry.label}-seed{seed}")
        for task in tasks
        for entry in entries
        for seed in seeds
    ]
    if args.dry_run:
        for task, entry, seed, piece in plan:
            print(shlex.join(compare_argv(task, entry, seed, piece, args.common)))
        return 0
    errors = {(t.name, e.label): config_error(t, e, args.common) for t in tasks for e in entries}
    for (task_name, label), error in errors.items():
        if error:
            print(f"algorithm_table: {task_name}, {label}: config error: {error}", file=sys.stderr)
    results: dict = {(t.name, e.label): [] for t in tasks for e in entries}
    for i, (task, entry, seed, piece) in enumerate(plan, 1):
        if error := errors[(task.name, entry.label)]:
            result = {"status": CONFIG_ERROR, "error": error, "time_to_target_s": None}
        else:
            result = run_piece(compare_argv(task, entry, seed, piece, args.common), piece)
            print(
                f"algorithm_table: [{i}/{len(plan)}] {task.name} {entry.label} seed {seed}: "
                f"{result['status']}, time to target {result['time_to_target_s']}, "
                f"{result.get('real_s', 0):.0f} s real",
                file=sys.stderr,
            )
        results[(task.name, entry.label)].append({**result, "seed": seed})
    rows = build_rows(tasks, entries, results)
    header = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "command": ".venv/bin/python bench/algorithm_table.py " + shlex.join(argv),
        "machine": _machine(),
        "commit": _commit(),
        "seeds": seeds,
    }
    text = markdown(rows, entries, header)
    out.mkdir(parents=True, exist_ok=True)
    (out / "algorithm_table.md").write_text(text)
    data = {
        **header,
        "reference": REFERENCE,
        "entries": [asdict(e) for e in entries],
        "tasks": [asdict(t) for t in tasks],
        "common_overrides": args.common,
        "rows": rows,
        "runs": {f"{t}/{label}": runs for (t, label), runs in results.items()},
    }
    (out / "algorithm_table.json").write_text(json.dumps(data, indent=2))
    print(text)
    statuses = [r["status"] for runs in results.values() for r in runs]
    return 2 if CONFIG_ERROR in statuses else 1 if FAILED in statuses else 0


if __name__ == "__main__":
    sys.exit(main())
