"""The shared fork server itself (the client side and how to use it:
shared_forks.py): imports the daemons' modules once, then forks one daemon
per request from launchers of its own user, namespaces, interpreter, cgroup
and CPU set, and sends each launcher its daemon's exit status.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import struct
import sys
import time
import traceback
from pathlib import Path

from .shared_forks import confinement, namespaces, read_line
from .zygote import PRELOAD, run_daemon

log = logging.getLogger(__name__)
MAX_REQUEST_BYTES = 16 << 20
REAP_EVERY_S = 0.05  # how often exited daemons are collected and their statuses sent


def peer_problem(conn: socket.socket, request: dict) -> str | None:
    """Why this server must not fork for the peer (None: it may): another
    user, process namespace, interpreter, cgroup or CPU set than the server's
    (its daemon would run under the server's, not the launcher's)."""
    pid, uid, _ = struct.unpack(
        "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    )
    if uid != os.getuid():
        return f"peer uid {uid} is not this server's ({os.getuid()})"
    # its own pid differs from the one the kernel sees: another pid namespace
    if request.get("pid") != pid:
        return "the peer is in another pid namespace"
    try:
        if namespaces(pid) != namespaces():
            return "the peer is in another network, mount or pid namespace"
        if confinement(pid) != confinement():
            return "the peer runs in another cgroup or on other CPUs than this server"
    except OSError as exc:
        return f"cannot read the peer's namespaces: {exc}"
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
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
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


def hung_up(conn: socket.socket) -> bool:
    """Whether the launcher closed its end (gave up waiting): then nobody is forked for it."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def answer(conn: socket.socket, value: dict) -> None:
    with contextlib.suppress(OSError):  # the launcher went away: nobody to tell
        conn.sendall(json.dumps(value).encode() + b"\n")


class Server:
    """The serving loop: requests read without blocking (one slow client holds
    up nobody), one fork per request, exit statuses sent as daemons are reaped."""

    def __init__(self, path: str, parent: int):
        self.path, self.parent = path, parent
        self.selector = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.waiting: dict[int, socket.socket] = {}  # daemon pid -> its launcher's connection
        self.pending: dict[socket.socket, bytes] = {}  # connections whose request is still arriving

    def bind(self) -> None:
        """Listen at `path` (bound under a temporary name and renamed, so the path exists only once it
        accepts connections; a live server's socket at `path` is not taken over)."""
        if Path(self.path).exists():
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                with contextlib.suppress(OSError):
                    probe.connect(self.path)
                    raise SystemExit(f"a server already listens at {self.path}")
        tmp = f"{self.path}.{os.getpid()}"
        Path(tmp).unlink(missing_ok=True)
        self.listener.bind(tmp)
        self.listener.listen(64)
        os.replace(tmp, self.path)
        self.selector.register(self.listener, selectors.EVENT_READ)

    def run(self) -> None:
        """Serve while the parent lives; then reap the daemons still running, and exit."""
        while os.getppid() == self.parent:
            for key, _ in self.selector.select(REAP_EVERY_S):
                if key.fileobj is self.listener:
                    self.accept()
                else:
                    self.receive(key.fileobj)
            self.reap()
        self.selector.unregister(self.listener)
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            if Path(self.path).exists():
                Path(self.path).unlink()
        while self.waiting:
            time.sleep(REAP_EVERY_S)
            self.reap()

    def accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError as exc:  # e.g. out of file descriptors: this client retries or falls back
            log.warning("accept failed: %s", exc)
            return
        conn.setblocking(False)
        self.pending[conn] = b""
        self.selector.register(conn, selectors.EVENT_READ)

    def receive(self, conn: socket.socket) -> None:
        try:
            chunk = conn.recv(1 << 16)
            request, _ = read_line(self.pending[conn] + chunk) if chunk else (None, b"")
        except (OSError, ValueError) as exc:
            chunk, request = b"", None
            answer(conn, {"error": f"bad request: {exc}"})
        if request is None and chunk:
            self.pending[conn] += chunk
            if len(self.pending[conn]) > MAX_REQUEST_BYTES:
                answer(conn, {"error": "request too large"})
            else:
                return
        self.selector.unregister(conn)
        del self.pending[conn]
        if request is None:
            conn.close()
            return
        try:
            self.fork(conn, request)
        except Exception as exc:  # noqa: BLE001 - a bad request or a failed fork never ends the server
            answer(conn, {"error": f"{type(exc).__name__}: {exc}"})
            conn.close()

    def fork(self, conn: socket.socket, request: dict) -> None:
        problem = peer_problem(conn, request)
        if problem is None and hung_up(conn):
            problem = "the launcher hung up"
        if problem:
            answer(conn, {"error": problem})
            conn.close()
            return
        for key in ("module", "argv", "log_path", "title", "env", "cwd", "sys_path"):
            request[key]  # noqa: B018 - a missing key is refused here, not in the child
        pid = os.fork()
        if pid == 0:
            become_daemon(
                request, [self.selector, self.listener, conn, *self.waiting.values(), *self.pending]
            )
        conn.setblocking(True)
        self.waiting[pid] = conn
        answer(conn, {"pid": pid})

    def reap(self) -> None:
        """Collect every exited daemon and tell its launcher the status."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.waiting.pop(pid, None)
            if conn is not None:
                answer(conn, {"exit": exit_status(status)})
                conn.close()


def serve(path: str) -> None:
    """Import the daemons' modules, then fork a daemon per request until the parent exits."""
    import importlib

    parent = os.getppid()
    # statuses are collected by waitpid, not discarded
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # no BLAS/OpenMP pool in the server (fork safety, as zygote.py)
    os.environ["OMP_NUM_THREADS"] = "1"
    for name in PRELOAD:
        importlib.import_module(name)
    # a run's plots are drawn in a process forked from here (launcher.draw_plots): pyplot once
    from .plots import pyplot_agg

    pyplot_agg()
    from hetps.training.data import preload_bundled

    preload_bundled()
    with contextlib.suppress(ImportError):  # claims the argv/environ memory now, before a daemon
        import setproctitle  # clears os.environ (then it could not set the title)

        setproctitle.getproctitle()
    server = Server(path, parent)
    server.bind()
    print(f"hetps shared fork server at {path}", flush=True)
    server.run()


def main(argv: list[str] | None = None) -> int:
    """`python -m hetps.frontend.shared_fork_server SOCKET`: serve until SIGTERM."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hetps.frontend.shared_fork_server SOCKET", file=sys.stderr)
        return 2
    serve(args[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
