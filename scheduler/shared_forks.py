"""One warm fork server shared by many `hetps run`s on one machine.

`hetps run` forks its daemons from a fork server that imports torch once per
run (zygote.py): ~3 s of CPU each time. A sweep or a test suite that starts
dozens of runs pays it dozens of times. This server imports the same modules
once and forks daemons for any run that asks:

    python -m hetps.scheduler.shared_forks SOCKET &     # in a private directory
    HETPS_FORK_SERVER=SOCKET hetps run ...              # each run forks from it

A request carries what an exec would have given the daemon: the launcher's
whole environment, working directory and `sys.path` (so PYTHONPATH and
user packages resolve the same), its log file and command line. The server
answers with the daemon's pid, reaps the daemon when it exits and sends its
exit status on the same connection (as `subprocess.Popen` reports it:
negative signal number when killed). It serves only clients of its own user
in its own network namespace and on its own interpreter; anything else is
refused and that launcher falls back to its own fork server (so a run inside
`ip netns exec` still gets daemons inside the namespace). It exits when the
process that started it does.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import socket
import struct
import subprocess
import sys
import traceback
from pathlib import Path

from .zygote import PRELOAD, ForkServer, forking_enabled, run_daemon

log = logging.getLogger(__name__)
ENV_VAR = "HETPS_FORK_SERVER"
REAP_EVERY_S = 0.05


class SharedForkRefused(RuntimeError):
    """The shared server did not fork the daemon (unreachable, or another user, namespace or interpreter)."""


def netns() -> int:
    """This process's network namespace (its inode)."""
    return os.stat("/proc/self/ns/net").st_ino


class RemoteDaemon:
    """A daemon forked by the shared server, with the parts of
    `subprocess.Popen` the launcher uses (pid, poll, wait, signals)."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str]):
        self.conn = conn
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._buffer = b""

    def _read_status(self, timeout: float | None) -> None:
        """Take the exit status if it arrives within `timeout` (None: wait)."""
        if self.returncode is not None:
            return
        self.conn.settimeout(timeout)
        try:
            while b"\n" not in self._buffer:
                chunk = self.conn.recv(4096)
                if not chunk:  # the server went away without a status: the daemon's fate is unknown
                    self.returncode = -9
                    self.conn.close()
                    return
                self._buffer += chunk
        except (TimeoutError, BlockingIOError):
            return
        self.returncode = int(json.loads(self._buffer.split(b"\n", 1)[0])["exit"])
        self.conn.close()

    def poll(self) -> int | None:
        self._read_status(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until it exits (raises subprocess.TimeoutExpired after `timeout` s)."""
        self._read_status(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

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


class SharedForkServer:
    """The client side: `start` asks the server at `path` for one daemon."""

    def __init__(self, path: str | Path):
        self.path = str(path)

    def start(self, module: str, argv: list[str], log_path: Path, env: dict[str, str]) -> RemoteDaemon:
        """Fork `python -m module *argv` there; raises SharedForkRefused."""
        args = [sys.executable, "-m", module, *argv]
        request = {"module": module, "argv": argv, "log_path": str(log_path), "title": " ".join(args),
                   "env": {**os.environ, **env}, "cwd": os.getcwd(), "sys_path": sys.path,
                   "executable": sys.executable}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(10.0)
            conn.connect(self.path)
            conn.sendall(json.dumps(request).encode() + b"\n")
            reply = b""
            while b"\n" not in reply:
                chunk = conn.recv(4096)
                if not chunk:
                    raise SharedForkRefused(f"the shared fork server at {self.path} closed the connection")
                reply += chunk
        except OSError as exc:
            conn.close()
            raise SharedForkRefused(f"the shared fork server at {self.path}: {exc}") from None
        answer = json.loads(reply.split(b"\n", 1)[0])
        if "pid" not in answer:
            conn.close()
            raise SharedForkRefused(f"the shared fork server at {self.path} refused: {answer.get('error')}")
        return RemoteDaemon(conn, int(answer["pid"]), args)


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


# ------------------------------------------------------------ the server

def peer_problem(conn: socket.socket, request: dict) -> str | None:
    """Why this server must not fork for the peer (None: it may)."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != os.getuid():
        return f"peer uid {uid} is not this server's ({os.getuid()})"
    try:
        peer_ns = os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError as exc:
        return f"cannot read the peer's network namespace: {exc}"
    if peer_ns != netns():
        return "the peer is in another network namespace"
    if request.get("executable") != sys.executable:
        return f"the peer runs {request.get('executable')}, this server {sys.executable}"
    return None


def exit_status(status: int) -> int:
    """A waitpid status as Popen reports it."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def become_daemon(request: dict, inherited: list) -> None:
    """In the forked child: the launcher's environment, directory and path, then
    `python -m module` (zygote.run_daemon). Never returns."""
    code = 1
    try:
        for s in inherited:
            s.close()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:] = request["sys_path"]
        run_daemon(request["module"], request["argv"], request["log_path"], {}, request["title"])
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - whatever the daemon raised ends it, printed like Python would
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def read_request(conn: socket.socket) -> dict:
    data = b""
    conn.settimeout(10.0)
    while b"\n" not in data:
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise ConnectionError("closed before a request")
        data += chunk
    return json.loads(data.split(b"\n", 1)[0])


def serve(path: str) -> None:
    """Import the daemons' modules, then fork a daemon per request until the parent exits."""
    import importlib

    os.environ["OMP_NUM_THREADS"] = "1"  # no BLAS/OpenMP pool in the server (fork safety, as zygote.py)
    for name in PRELOAD:
        importlib.import_module(name)
    with contextlib.suppress(ImportError):  # claims the argv/environ memory now, before a daemon
        import setproctitle                 # clears os.environ (then it could not set the title)
        setproctitle.getproctitle()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    Path(path).unlink(missing_ok=True)
    listener.bind(path)
    listener.listen(64)
    print(f"hetps shared fork server at {path}", flush=True)
    waiting: dict[int, socket.socket] = {}  # daemon pid -> its launcher's connection
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    while os.getppid() == parent:
        for _ in selector.select(REAP_EVERY_S):
            conn, _ = listener.accept()
            try:
                request = read_request(conn)
                problem = peer_problem(conn, request)
            except (OSError, ValueError, KeyError) as exc:
                problem = f"bad request: {exc}"
            if problem:
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"error": problem}).encode() + b"\n")
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                become_daemon(request, [selector, listener, conn, *waiting.values()])
            waiting[pid] = conn
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        reap(waiting)
    listener.close()
    Path(path).unlink(missing_ok=True)


def reap(waiting: dict[int, socket.socket]) -> None:
    """Collect every exited daemon and tell its launcher the status."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"exit": exit_status(status)}).encode() + b"\n")
            conn.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hetps.scheduler.shared_forks SOCKET", file=sys.stderr)
        return 2
    serve(args[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
