"""One warm fork server shared by many `hetps run`s on one machine.

`hetps run` forks its daemons from a fork server that imports torch once per
run (zygote.py): ~3 s of CPU each time. A sweep or a test suite that starts
dozens of runs pays it dozens of times. This server imports the same modules
once and forks daemons for any run that asks:

    python -m hetps.frontend.shared_fork_server SOCKET &     # in a private directory
    HETPS_FORK_SERVER=SOCKET hetps run ...              # each run forks from it

A request carries what the launcher would give an exec'd daemon: its whole
environment, working directory and `sys.path` (so PYTHONPATH and user
packages resolve the same), its log file and command line. The server
answers with the daemon's pid, reaps the daemon when it exits and sends its
exit status on the same connection (as `subprocess.Popen` reports it:
negative signal number when killed). Modules the server imported (torch,
hetps) are the server's: restart it after upgrading either. It serves only
launchers of its own user, namespaces (network, mount, pid), interpreter,
cgroup and CPU set, since a daemon inherits those from the server; anything
else is refused and that launcher falls back to its own fork server (so a
run inside `ip netns exec` or under `taskset` still gets its daemons there).
When the process that started it exits, it stops taking requests and exits
once its daemons have.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from .zygote import ForkServer, SignalsByPid, forking_enabled

log = logging.getLogger(__name__)
ENV_VAR = "HETPS_FORK_SERVER"
# a launcher's wait for the pid (the server answers at once unless overloaded)
ANSWER_WAIT_S = 60.0


class SharedForkRefused(RuntimeError):
    """The shared server did not fork the daemon (unreachable, or refused this launcher)."""


class SharedForkLost(RuntimeError):
    """The shared server took a request and did not answer it: the daemon may be running."""


def namespaces(pid: int | str = "self") -> tuple:
    """The network, mount and pid namespaces of a process (device and inode each)."""
    out = []
    for kind in ("net", "mnt", "pid"):
        st = os.stat(f"/proc/{pid}/ns/{kind}")
        out.append((st.st_dev, st.st_ino))
    return tuple(out)


def confinement(pid: int | str = "self") -> tuple:
    """What a forked daemon would inherit from its server rather than its launcher: cgroup and CPUs."""
    return (
        Path(f"/proc/{pid}/cgroup").read_text(),
        sorted(os.sched_getaffinity(0 if pid == "self" else int(pid))),
    )


def read_line(buffer: bytes) -> tuple[dict | None, bytes]:
    """(the first JSON line in `buffer`, the rest), or (None, buffer) while it is incomplete."""
    if b"\n" not in buffer:
        return None, buffer
    line, rest = buffer.split(b"\n", 1)
    value = json.loads(line)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value, rest


class RemoteDaemon(SignalsByPid):
    """A daemon forked by the shared server, with the parts of
    `subprocess.Popen` the launcher uses (pid, poll, wait, signals). Safe to
    call again from a signal handler while a `wait` is blocked."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str], buffer: bytes = b""):
        self.conn = conn
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        # what came after the pid line (the exit status, for a daemon that exits at once)
        self._buffer = buffer
        self._server_gone = False

    def _read_status(self, timeout: float | None) -> None:
        """Take the exit status if it arrives within `timeout` (None: wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if self._server_gone:  # no status will come: watch the process itself
                if not pid_alive(self.pid):
                    self.returncode = 1  # its status went with the server; it is gone
                elif deadline is not None and time.monotonic() >= deadline:
                    return
                else:
                    time.sleep(0.05)
                continue
            try:
                status, self._buffer = read_line(self._buffer)
                if status is not None:
                    self.returncode = int(status["exit"])
                    break
                self.conn.settimeout(
                    None if deadline is None else max(0.0, deadline - time.monotonic())
                )
                chunk = self.conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                return
            except OSError:  # closed by a nested call from a signal handler, which took the status
                if self.returncode is not None:
                    break
                chunk = b""
            if not chunk:
                self._server_gone = True
            self._buffer += chunk
        self.conn.close()

    def poll(self) -> int | None:
        self._read_status(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until it exits (raises subprocess.TimeoutExpired after `timeout` s)."""
        self._read_status(None if timeout is None else max(0.0, timeout))
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie nobody reaped yet is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie nobody reaps yet is gone for us
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


class SharedForkServer:
    """The client side: `start` asks the server at `path` for one daemon."""

    def __init__(self, path: str | Path):
        self.path = str(path)

    def start(
        self, module: str, argv: list[str], log_path: Path, env: dict[str, str]
    ) -> RemoteDaemon:
        """Fork `python -m module *argv` there. Raises SharedForkRefused when it
        could not ask or was refused (nothing started), SharedForkLost when it
        asked and got no answer."""
        args = [sys.executable, "-m", module, *argv]
        request = {
            "module": module,
            "argv": argv,
            "log_path": str(log_path),
            "title": " ".join(args),
            "env": {**os.environ, **env},
            "cwd": os.getcwd(),
            "sys_path": sys.path,
            "executable": sys.executable,
            "pid": os.getpid(),
        }
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(10.0)
            conn.connect(self.path)
        except OSError as exc:
            conn.close()
            raise SharedForkRefused(f"the shared fork server at {self.path}: {exc}") from None
        try:
            conn.sendall(json.dumps(request).encode() + b"\n")
            conn.settimeout(ANSWER_WAIT_S)
            answer, buffer = None, b""
            while answer is None:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                answer, buffer = read_line(buffer + chunk)
        except (OSError, ValueError) as exc:
            conn.close()
            raise SharedForkLost(
                f"the shared fork server at {self.path} did not answer: {exc}"
            ) from None
        if answer is None or "pid" not in answer:
            conn.close()
            why = answer.get("error") if answer else "it closed the connection"
            raise SharedForkRefused(f"the shared fork server at {self.path} refused: {why}")
        return RemoteDaemon(conn, int(answer["pid"]), args, buffer)


class PreferShared:
    """Fork from the shared server; once it refuses (another namespace, user or
    interpreter, or gone), from this run's own fork server for the rest of the run."""

    def __init__(self, path: str):
        self.shared = SharedForkServer(path)
        self.own: ForkServer | None = None

    def start(self, module: str, argv: list[str], log_path: Path, env: dict[str, str]):
        if self.own is None:
            try:
                return self.shared.start(module, argv, log_path, env)
            except SharedForkRefused as exc:
                log.info("%s; forking from this run's own fork server", exc)
                self.own = ForkServer()
        return self.own.start(module, argv, log_path, env)


def fork_server() -> ForkServer | PreferShared | None:
    """How a launcher starts its daemons: from the shared server named by
    $HETPS_FORK_SERVER, from its own fork server, or (HETPS_SPAWN=exec) by exec: None."""
    if not forking_enabled():
        return None
    path = os.environ.get(ENV_VAR)
    return PreferShared(path) if path else ForkServer()
