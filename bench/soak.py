"""Soak benchmark: memory of every daemon over a long `hetps run`.

    .venv/bin/python bench/soak.py [--config configs/default.yaml] [--seconds 600] [--every 10]
                                   [--warmup 120] [--out DIR] [key=value ...]

Runs `hetps run CONFIG stop.target_accuracy=null stop.max_seconds=SECONDS`
(training never stops early) and every EVERY seconds reads VmRSS from
/proc/PID/status of each process the launcher started: scheduler, shards,
workers, evaluator. Prints a row a minute and, at the end, per process the
RSS just after warm-up (the baseline, measured in the same run), at the end
(means over a minute each), the growth in MiB and %, the ratio end/baseline
and a least-squares slope in MiB per minute; the verdict is on shards and
workers: stable when each grew by at most max(--tol-mib, --tol-pct % of its
baseline). Writes DIR/rss.csv (every sample) and DIR/soak.json (samples,
summary, machine, command); the run directory is DIR/run.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WINDOW_S = 60.0  # baseline and end are means over this long
STOP_GRACE_S = 30.0  # after SIGTERM, how long the launcher may take to stop its cluster


def machine() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError, StopIteration):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next(
            line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")
        )
    return (
        f"{model}, {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}"
    )


# ---------------------------------------------------------------- processes


def children_of(parent: int) -> dict[str, int]:
    """The launcher's daemons by hetps name (scheduler, ps0, worker1, evaluator) -> pid: its
    children, or (forked by `hetps run`, frontend/zygote.py) its fork server's children."""
    procs = {}  # pid -> (ppid, argv)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            argv = (
                (entry / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split()
            )
        except OSError:
            continue
        ppid = next(
            (int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:")), -1
        )
        procs[int(entry.name)] = (ppid, argv)
    parents = {parent} | {pid for pid, (ppid, _) in procs.items() if ppid == parent}
    found = {}
    for pid, (ppid, argv) in procs.items():
        name = process_name(argv) if ppid in parents else None
        if name:
            found[name] = pid
    return found


def process_name(argv: list[str]) -> str | None:
    """A child's hetps name from its command line (`python -m hetps.ROLE ... --rank N`)."""
    if "-m" not in argv:
        return None
    module = argv[argv.index("-m") + 1]
    rank = argv[argv.index("--rank") + 1] if "--rank" in argv else "0"
    if module == "hetps.scheduler":
        return "scheduler"
    if module == "hetps.worker":
        return "evaluator" if "--evaluator" in argv else f"worker{rank}"
    return f"ps{rank}" if module == "hetps.ps" else None


def rss_mib(pid: int) -> float | None:
    """VmRSS of `pid` in MiB, or None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def stop_launcher(proc: subprocess.Popen, pids: dict[str, int]) -> None:
    """SIGTERM the launcher (it stops its cluster cleanly), then kill whatever is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    for pid in pids.values():  # the children run in their own sessions
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- sampling


def sample_run(
    proc: subprocess.Popen,
    every_s: float,
    print_every_s: float,
    deadline: float,
    samples: list[dict],
    pids: dict[str, int],
) -> None:
    """Sample until the launcher exits (or the deadline passes: raises TimeoutError)."""
    started = time.monotonic()
    last_print = -print_every_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            raise TimeoutError("the run went past its deadline")
        pids.update(children_of(proc.pid))
        t = time.monotonic() - started
        row = {name: rss_mib(pid) for name, pid in sorted(pids.items())}
        samples.extend(
            {"t_s": round(t, 1), "process": n, "rss_mib": round(v, 2)}
            for n, v in row.items()
            if v is not None
        )
        if t - last_print >= print_every_s and row:
            print(
                f"{t:7.0f}s " + " ".join(f"{n}={v:.0f}" for n, v in row.items() if v is not None),
                flush=True,
            )
            last_print = t
        time.sleep(max(0.0, every_s - (time.monotonic() - started - t)))


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t_s, MiB) in MiB per minute."""
    if len(points) < 2:
        return 0.0
    mt, mv = mean([t for t, _ in points]), mean([v for _, v in points])
    den = sum((t - mt) ** 2 for t, _ in points)
    return 60 * sum((t - mt) * (v - mv) for t, v in points) / den if den else 0.0


def summarize(
    samples: list[dict], warmup_s: float, tol_mib: float, tol_pct: float
) -> dict[str, dict]:
    """Per process: baseline (the minute after warm-up), end (the last minute), growth, slope, verdict."""
    out = {}
    for name in sorted({s["process"] for s in samples}):
        points = [
            (s["t_s"], s["rss_mib"])
            for s in samples
            if s["process"] == name and s["t_s"] >= warmup_s
        ]
        if not points:
            continue
        last_t = points[-1][0]
        base = mean([v for t, v in points if t < warmup_s + WINDOW_S])
        end = mean([v for t, v in points if t > last_t - WINDOW_S])
        growth = end - base
        out[name] = {
            "baseline_mib": round(base, 1),
            "end_mib": round(end, 1),
            "growth_mib": round(growth, 1),
            "growth_pct": round(100 * growth / base, 1),
            "ratio": round(end / base, 3),
            "slope_mib_per_min": round(slope_per_min(points), 3),
            "stable": growth <= max(tol_mib, tol_pct / 100 * base),
        }
    return out


def report(summary: dict[str, dict]) -> bool:
    """Print the table; True when every shard and worker is stable."""
    print(
        f"\n{'process':>10} {'after warm-up':>14} {'end':>8} {'growth':>8} {'growth %':>9} {'end/base':>9} "
        f"{'MiB/min':>8}"
    )
    for name, r in summary.items():
        print(
            f"{name:>10} {r['baseline_mib']:14.1f} {r['end_mib']:8.1f} {r['growth_mib']:+8.1f} "
            f"{r['growth_pct']:+9.1f} {r['ratio']:9.3f} {r['slope_mib_per_min']:+8.3f}"
        )
    judged = {n: r for n, r in summary.items() if n.startswith(("ps", "worker"))}
    grown = [n for n, r in judged.items() if not r["stable"]]
    print(
        "verdict: "
        + (
            "stable: no shard or worker grew beyond the tolerance"
            if judged and not grown
            else f"GROWING: {', '.join(grown) or 'no shard or worker sampled'}"
        )
    )
    return bool(judged) and not grown


def write_outputs(out: Path, samples: list[dict], summary: dict, meta: dict) -> None:
    with open(out / "rss.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["t_s", "process", "rss_mib"])
        writer.writeheader()
        writer.writerows(samples)
    (out / "soak.json").write_text(
        json.dumps({**meta, "summary": summary, "samples": samples}, indent=1)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument(
        "--seconds", type=float, default=600.0, help="training time (stop.max_seconds)"
    )
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument(
        "--warmup", type=float, default=120.0, help="seconds after start not judged"
    )
    parser.add_argument("--tol-mib", type=float, default=8.0)
    parser.add_argument("--tol-pct", type=float, default=5.0)
    parser.add_argument("--out", default=None, help="default runs/soak-TIME")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    out = Path(args.out or REPO / "runs" / f"soak-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "hetps.frontend.cli",
        "run",
        args.config,
        "stop.target_accuracy=null",
        f"stop.max_seconds={args.seconds}",
        *args.overrides,
        "--out",
        str(out / "run"),
        "--quiet",
    ]
    print(f"machine: {machine()}\ncommand: {' '.join(command[1:])}\nRSS in MiB:", flush=True)
    samples: list[dict] = []
    pids: dict[str, int] = {}
    log = open(out / "launcher.log", "w")
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        sample_run(proc, args.every, 60.0, time.monotonic() + args.seconds + 300, samples, pids)
    finally:
        stop_launcher(proc, pids)
        log.close()
    summary = summarize(samples, args.warmup, args.tol_mib, args.tol_pct)
    stable = report(summary)
    run_summary = out / "run" / "summary.json"
    steps = (
        json.loads(run_summary.read_text()).get("global_steps") if run_summary.exists() else None
    )
    print(f"launcher exit {proc.returncode}; {steps} steps in total; outputs in {out}")
    write_outputs(
        out,
        samples,
        summary,
        {
            "machine": machine(),
            "command": command[1:],
            "args": vars(args),
            "launcher_exit": proc.returncode,
            "global_steps": steps,
            "stable": stable,
        },
    )
    return 0 if stable and proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
