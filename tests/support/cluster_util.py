"""Helpers for tests that run real hetps processes: run a command with a
deadline, find processes left behind, read a run directory."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hetps.frontend.cli import ROLE_MODULES
from hetps.frontend.shared_forks import ENV_VAR, RemoteDaemon, SharedForkServer

REPO = Path(__file__).resolve().parents[2]
CLI = "hetps.frontend.cli"  # `hetps`
HETPS = [sys.executable, "-m", CLI]


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


def run_hetps(
    args: list[str], timeout_s: float, cwd: Path = REPO, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `hetps ARGS` to completion (`env`: added to this environment); on
    timeout kill its whole session and fail."""
    proc = subprocess.Popen(
        [*HETPS, *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
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


# Runs stopped by a target stop on the second evaluation in a row that reaches it: on
# mnist-5k the first crossing often lands on the steep, swinging part of the curve
# (a loaded machine evaluates after fewer steps), and the final evaluation a few
# dozen updates later can fall points below it
HELD = "stop.target_patience=2"

CHARLM_TARGET = 12.0  # configs/charlm.yaml stop.target (perplexity)

# 1,000 test digits: one evaluation's accuracy moves by about ±0.8% (one standard error),
# and the final evaluation sees a few more steps than the one that reached the target
FINAL_SLACK = 0.03


def assert_reached_target(s: dict, target: float, slack: float = FINAL_SLACK) -> None:
    """The run reached `target` at an evaluation, and its final evaluation is still within `slack`."""
    assert s["time_to_target_s"] is not None and s["best_accuracy"] >= target, s
    assert s["final_accuracy"] >= target - slack, s


def log_tails(run_dir: Path, lines: int = 20) -> str:
    out = []
    for log in sorted((run_dir / "logs").glob("*.log")):
        out.append(
            f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        )
    return "\n".join(out)


def records(run_dir: Path, kind: str) -> list[dict]:
    """The records of one kind ("step", "eval", "plan", ...) in a run's metrics.jsonl."""
    # a last line lacking "\n" is being written
    lines = (run_dir / "metrics.jsonl").read_text().split("\n")[:-1]
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def trained_to_after_replan(run_dir: Path, accuracy: float, held: int = 1) -> bool:
    """A plan after the first (a re-plan or a failover), then steps and `held`
    evaluations in a row at `accuracy` or more after it: what a test waits for
    before it stops a run that had a fault."""
    replans = [r["t"] for r in records(run_dir, "plan") if r["plan_id"] > 1]
    if not replans or not any(r["t"] > replans[0] for r in records(run_dir, "step")):
        return False
    streak = 0
    for r in records(run_dir, "eval"):
        if r["t"] > replans[0]:
            streak = streak + 1 if r["accuracy"] >= accuracy else 0
            if streak >= held:
                return True
    return False


def worker_pid(run_dir: Path, rank: int) -> int:
    """The pid of `hetps run`'s worker `rank` (not the evaluator) in `run_dir`."""
    for pid in processes_mentioning(str(run_dir)):
        # a daemon forked by `hetps run` shows its command line as one string (frontend/zygote.py)
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").split()
        if (
            b"hetps.worker" in cmdline
            and b"--rank" in cmdline
            and cmdline[cmdline.index(b"--rank") + 1] == str(rank).encode()
            and b"--evaluator" not in cmdline
        ):
            return pid
    raise AssertionError(f"no worker {rank} process")


def shard_pid(run_dir, rank: int) -> int:
    """The pid of `hetps run`'s shard `rank` (not a spare) in `run_dir`."""
    for pid in processes_mentioning(str(run_dir)):
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").split()
        if (
            b"hetps.ps" in cmdline
            and b"--spare" not in cmdline
            and b"--rank" in cmdline
            and cmdline[cmdline.index(b"--rank") + 1] == str(rank).encode()
        ):
            return pid
    raise AssertionError(f"no shard {rank} process")


class Daemons:
    """Daemons started one by one with `hetps ROLE ...` (the multi-host path),
    each logging to DIR/N.log, in DIR, in a session of its own; `close()` kills
    and reaps any still running.

    Where the test has the suite's shared fork server ($HETPS_FORK_SERVER, set
    by tests/conftest.py for cluster tests) each daemon is forked from it, as
    `hetps run` forks its own: a real process all the same, spared torch's
    import (~4 s of CPU each). `fork=False` execs every one, as a user on
    another host starts it; `start(..., fork=False)` execs that one only."""

    def __init__(self, log_dir: Path, overrides: list[str], fork: bool = True):
        self.log_dir = log_dir
        self.overrides = overrides
        self.forks = os.environ.get(ENV_VAR) if fork else None
        self.procs: list[subprocess.Popen | RemoteDaemon] = []
        self.logs: list = []

    def start(self, args: list[str], env: dict | None = None, fork: bool = True) -> None:
        path = self.log_dir / f"{len(self.procs)}.log"
        if self.forks and fork:
            # `hetps ps|worker` execs `python -m hetps.ps|worker` (frontend/cli.py): forked, the
            # daemon is that module itself, or the exec would import torch again (~4 s of CPU)
            module, rest = (
                (ROLE_MODULES[args[0]], args[1:]) if args[0] in ROLE_MODULES else (CLI, args)
            )
            with contextlib.chdir(self.log_dir):  # the daemon starts where the request is made
                daemon = SharedForkServer(self.forks).start(
                    module, [*rest, *self.overrides], path, env or {}
                )
            self.procs.append(daemon)
            return
        log = open(path, "w")
        self.logs.append(log)
        self.procs.append(
            subprocess.Popen(
                [*HETPS, *args, *self.overrides],
                cwd=self.log_dir,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        )

    def scheduler(self, config: str, run_dir: Path) -> str:
        """Start the scheduler on a random port; returns its address."""
        self.start(
            [
                "scheduler",
                "--config",
                config,
                "--bind",
                "tcp://127.0.0.1:0",
                "--run-dir",
                str(run_dir),
            ]
        )
        addr_file = run_dir / "scheduler.addr"
        return wait_for(
            lambda: addr_file.exists() and addr_file.read_text(), 60, "the scheduler address"
        )

    def wait(self, timeout_s: float) -> list[int]:
        return [p.wait(timeout=timeout_s) for p in self.procs]

    def tails(self) -> str:
        return "\n".join(
            (self.log_dir / f"{i}.log").read_text()[-1500:] for i in range(len(self.procs))
        )

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        for log in self.logs:
            log.close()


@contextlib.contextmanager
def background_run(args: list[str], env: dict | None = None):
    """`hetps run ARGS` in its own session, for tests that act on it while it
    trains (signals, kills); its whole session is killed and reaped on exit."""
    proc = subprocess.Popen(
        [*HETPS, "run", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
