"""CPU per training step: the CPU seconds every process of a `hetps run`
(scheduler, shards, workers, fork server) spends per global step, and the
steps per second, over a steady window in the middle of the run.

    .venv/bin/python bench/step_cpu.py [--workers 1,4] [--shards 2] [--window 8] [--repeats 1] [OVERRIDE ...]

On a shared machine the wall-clock step time moves by tens of percent from
run to run while CPU per step moves less: it says what a change to the step
path costs or saves where bench/step.py's ratios cannot. Each run is
configs/sync.yaml with LeNet-5 on synthetic data (bench/step.py's settings,
no evaluator), stopped after the window; CPU is read from /proc for every
process whose command line names the run directory, and the workers' step
records written so far, at the window's start and end.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from step import COMMON, CONFIG, MODELS, REPO  # bench/ is the script's directory

SETTLE_S = 8.0  # start-up and the first steps, before the window


def run_cpu_s(run_dir: Path) -> float:
    """CPU seconds (user + system) of the live processes whose command line names `run_dir`."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if str(run_dir).encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


def steps_so_far(run_dir: Path) -> int:
    """Worker step records the scheduler has written so far."""
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return 0
    return text.count('"kind": "step"')


def measure(
    workers: int, shards: int, window_s: float, overrides: list[str], tmp: Path
) -> tuple[float, float]:
    """(global steps/s, CPU ms per global step) over the window."""
    run_dir = tmp / f"run-{len(list(tmp.iterdir()))}"
    cmd = [
        sys.executable,
        "-m",
        "hetps.frontend.cli",
        "run",
        CONFIG,
        *COMMON,
        *MODELS["lenet5"],
        f"cluster.workers={workers}",
        f"cluster.shards={shards}",
        "eval.enabled=false",
        "stop.target_accuracy=null",
        f"stop.max_seconds={SETTLE_S + window_s + 30}",
        *overrides,
        "--out",
        str(run_dir),
        "--quiet",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        time.sleep(SETTLE_S)
        cpu0, steps0, t0 = run_cpu_s(run_dir), steps_so_far(run_dir), time.monotonic()
        time.sleep(window_s)
        cpu1, steps1, t1 = run_cpu_s(run_dir), steps_so_far(run_dir), time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    # the scheduler writes step records a heartbeat after the steps: both ends of the count lag alike
    steps = steps1 - steps0
    if not steps:
        raise RuntimeError(f"{run_dir}: no steps in the window")
    return steps / (t1 - t0), 1e3 * (cpu1 - cpu0) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,4")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--window", type=float, default=8.0, help="seconds measured")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()
    print(
        f"{os.cpu_count()} cores; hetps sync, LeNet-5, {args.shards} shard(s), {args.window:.0f} s window"
    )
    print("| P | steps/s | CPU ms / step | CPU cores busy |")
    print("|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory(prefix="hetps-step-cpu-") as tmp:
        for workers in map(int, args.workers.split(",")):
            for _ in range(args.repeats):
                rate, cpu_ms = measure(workers, args.shards, args.window, args.overrides, Path(tmp))
                print(
                    f"| {workers} | {rate:.0f} | {cpu_ms:.2f} | {rate * cpu_ms / 1e3:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
