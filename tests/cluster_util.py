"""Helpers for tests that run real hetps processes: run a command with a
deadline, find processes left behind, read a run directory."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HETPS = [sys.executable, "-m", "hetps.scheduler.cli"]


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains `text`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


def kill_leftovers(text: str) -> list[int]:
    """Kill (and report) every process still mentioning `text`."""
    pids = processes_mentioning(text)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def run_hetps(args: list[str], timeout_s: float, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run `hetps ARGS` to completion; on timeout kill its whole session and fail."""
    proc = subprocess.Popen([*HETPS, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
        raise AssertionError(f"hetps {' '.join(args)} ran past {timeout_s}s\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def log_tails(run_dir: Path, lines: int = 20) -> str:
    out = []
    for log in sorted((run_dir / "logs").glob("*.log")):
        out.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
    return "\n".join(out)
