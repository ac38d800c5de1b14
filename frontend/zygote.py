"""Start a local run's daemons by forking one warm process, not by exec.

Every hetps daemon imports torch, which costs seconds of CPU per process; a
local run starts seven or more of them on the same machine at once. The
launcher instead starts one fork server (multiprocessing's `forkserver`)
that imports torch and the daemons' modules once; each daemon is then a
fork of it (copy-on-write: the imported modules are shared, not loaded
again), running `python -m MODULE ARGS` semantics: its own session, its
output appended to its log, its command line set to what an exec would have
shown (so `ps` and tools that look for a run's processes find it).

Fork safety: the fork server has only imported modules; it has run no
tensor operation (no OpenMP pool, no CUDA context exists before the fork),
and each child initialises those itself, as a freshly exec'd daemon would.

`HETPS_SPAWN=exec` in the environment turns this off (one exec per daemon,
the way a multi-host deployment starts them).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import runpy
import subprocess
import sys
import threading
import types
from pathlib import Path

# What every daemon imports before its first step; loaded once, in the fork server
# (torch._dynamo: torch.optim imports it when a shard builds its optimizer, ~1.3 s of CPU).
# (The scheduler is exec'd, not forked from a run's own server: it imports no torch. The daemons'
# `__main__` modules parse flags only; their bodies are ps/serving.py and worker/lifecycle.py.)
PRELOAD = [
    "torch",
    "torch._dynamo",
    "hetps.ps.serving",
    "hetps.worker.lifecycle",
    "hetps.training.preflight",
]


def forking_enabled() -> bool:
    """Whether daemons are forked from the warm server (`HETPS_SPAWN` is not `exec`)."""
    return os.environ.get("HETPS_SPAWN", "fork") != "exec"


class SignalsByPid:
    """`subprocess.Popen`'s signal methods for a process known by `pid` and `poll()`."""

    pid: int

    def poll(self) -> int | None:
        raise NotImplementedError

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # exited between the check and the signal
                pass

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)


class ForkedDaemon(SignalsByPid):
    """A daemon forked from the fork server, with the parts of
    `subprocess.Popen` the launcher uses (pid, poll, wait, signals)."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: list[str]):
        self.process = process
        self.args = args
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        """Exit status as Popen gives it: negative signal number when killed."""
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Block until it exits (raises subprocess.TimeoutExpired after `timeout` s)."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.process.exitcode


class ForkServer:
    """One warm fork server per launcher; `start` returns a ForkedDaemon."""

    def __init__(self):
        self.context = multiprocessing.get_context("forkserver")
        # the server inherits this environment when it starts (on the first fork): one thread,
        # so no BLAS/OpenMP pool exists in it when it forks (daemons get OMP_NUM_THREADS=1 too)
        os.environ["OMP_NUM_THREADS"] = "1"
        self.context.set_forkserver_preload(PRELOAD)

    def start(
        self, module: str, argv: list[str], log_path: Path, env: dict[str, str]
    ) -> ForkedDaemon:
        """Fork `python -m module *argv` (non-blocking once the server is warm;
        the first call waits for the server's imports)."""
        args = [sys.executable, "-m", module, *argv]
        process = self.context.Process(
            target=run_daemon,
            args=(module, argv, str(log_path), env, " ".join(args)),
            name=module,
            daemon=False,
        )
        with main_not_shipped():
            process.start()
        return ForkedDaemon(process, args)


_MAIN_SWAP = threading.Lock()


@contextlib.contextmanager
def main_not_shipped():
    """While a daemon is handed to the fork server: `__main__` is a bare module.

    multiprocessing tells each child to run the parent's `__main__` script again (as
    `__mp_main__`, so that objects defined there unpickle). A daemon needs nothing from it
    (its target and arguments are importable and plain), and a script or notebook that drives
    a run without an `if __name__ == "__main__":` guard would start the whole run again in
    every daemon, which multiprocessing refuses with a traceback. Without a file or a module
    name, `__main__` gives the child nothing to run."""
    with _MAIN_SWAP:
        main = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            if main is None:
                del sys.modules["__main__"]
            else:
                sys.modules["__main__"] = main


def run_daemon(
    module: str, argv: list[str], log_path: str, env: dict[str, str], title: str
) -> None:
    """In the forked child: become `python -m module *argv` in a session of its own."""
    os.setsid()  # a terminal's Ctrl-C reaches only the launcher, as with start_new_session
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    os.environ.update(env)
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    # optional: the daemon runs the same, `ps` shows the fork server's command line
    except ImportError:
        pass
    sys.argv = [module, *argv]
    loaded = sys.modules.get(module)
    if (
        loaded is not None
        and not hasattr(loaded, "__path__")
        and callable(main := getattr(loaded, "main", None))
    ):
        # a module the server imported (hetps.training.preflight: worker.lifecycle imports it)
        # runs by its own main(): run again as `__main__` it would be a second copy of itself,
        # whose classes (PreflightError) are not the ones the rest of the process raises, and
        # runpy warns that it "found it in sys.modules"
        raise SystemExit(main(argv))
    # multiprocessing's atexit handling must not treat the daemon as one of its workers
    runpy.run_module(module, run_name="__main__", alter_sys=True)
