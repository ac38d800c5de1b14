"""CPU and wall time of whole `hetps run`s: daemons forked from the warm
fork server (the default) against one exec per daemon (HETPS_SPAWN=exec).

    .venv/bin/python bench/spawn.py [--repeats 3] [--config configs/sync.yaml] [key=value ...]

Each repeat runs the same short experiment (default: 60 steps) once per mode,
alternating, inside its own cgroup so that the CPU time of every process of
the run is counted (the launcher, the fork server and every daemon; a daemon
forked by the server is not the launcher's child, so rusage cannot see it).
Needs root and a cgroup v1 `cpuacct` or a cgroup v2 hierarchy. Prints one
row per run and the median ratios fork/exec of CPU and wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
V1 = Path("/sys/fs/cgroup/cpuacct")
V2 = Path("/sys/fs/cgroup")


def make_cgroup(name: str) -> tuple[Path, callable]:
    """A fresh cgroup and a function returning its CPU seconds so far."""
    if (V1 / "cpuacct.usage").exists():
        path = V1 / name
        path.mkdir(exist_ok=True)
        return path, lambda: int((path / "cpuacct.usage").read_text()) / 1e9
    path = V2 / name
    path.mkdir(exist_ok=True)

    def usage() -> float:
        stat = dict(line.split() for line in (path / "cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) / 1e6

    return path, usage


def one_run(mode: str, config: str, overrides: list[str], index: int) -> dict:
    cgroup, usage = make_cgroup(f"hetps-bench-spawn-{os.getpid()}-{index}-{mode}")
    out = Path(tempfile.mkdtemp(prefix=f"spawn-{mode}-"))
    # each run's own fork server, never a shared one (HETPS_FORK_SERVER): its CPU is what is measured
    env = {**{k: v for k, v in os.environ.items() if k != "HETPS_FORK_SERVER"}, "HETPS_SPAWN": mode}
    cmd = [
        sys.executable,
        "-m",
        "hetps.frontend.cli",
        "run",
        config,
        "--quiet",
        "--out",
        str(out),
        *overrides,
    ]
    start = time.monotonic()
    # the child joins the cgroup before it execs, so everything it starts is counted
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid())),
    )
    _, err = proc.communicate(timeout=900)
    wall = time.monotonic() - start
    cpu = usage()
    try:
        cgroup.rmdir()
    except OSError:  # a process of the run is still leaving; the directory stays behind
        pass
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed ({proc.returncode}):\n{err[-2000:]}")
    return {"mode": mode, "cpu_s": round(cpu, 2), "wall_s": round(wall, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--config", default="configs/sync.yaml")
    parser.add_argument(
        "overrides", nargs="*", default=["stop.max_steps=60", "stop.target_accuracy=1.0"]
    )
    args = parser.parse_args()
    print(
        f"machine: {os.cpu_count()} cpus; {args.repeats} x {args.config} {' '.join(args.overrides)}"
    )
    rows = []
    for i in range(args.repeats):
        for mode in ("exec", "fork"):
            row = one_run(mode, args.config, args.overrides, i)
            rows.append(row)
            print(json.dumps(row), flush=True)
    for key in ("cpu_s", "wall_s"):
        fork = statistics.median(r[key] for r in rows if r["mode"] == "fork")
        exec_ = statistics.median(r[key] for r in rows if r["mode"] == "exec")
        print(f"{key:24s} exec {exec_:7.2f}  fork {fork:7.2f}  ratio fork/exec {fork / exec_:.2f}")


if __name__ == "__main__":
    main()
