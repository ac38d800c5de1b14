"""Daemons forked from the warm fork server (frontend/zygote.py), or from
the one shared by many runs (frontend/shared_forks.py), behave like
`python -m MODULE ARGS` started by exec: exit status, signals, own session,
output in the log, environment, and the command line `ps` shows."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_util import wait_for

from hetps.frontend.shared_forks import PreferShared, RemoteDaemon, SharedForkServer, fork_server
from hetps.frontend.zygote import ForkServer, forking_enabled

pytestmark = pytest.mark.cluster  # real processes


@pytest.fixture(scope="module")
def forks():
    return ForkServer()


def test_a_forked_daemon_runs_the_module_with_its_arguments_and_exit_status(forks, tmp_path: Path):
    log = tmp_path / "d.log"
    daemon = forks.start("zygote_target", ["7", "--rank", "3"], log, {"ZYGOTE_MARKER": "m1"})
    assert daemon.wait(timeout=120) == 7
    assert daemon.returncode == 7 and daemon.poll() == 7
    assert "argv 7 --rank 3 marker m1 sid True" in log.read_text()


@pytest.mark.parametrize("server", ["per-run", "shared"])
def test_a_forked_daemon_shows_its_command_line_and_dies_by_signal(server, request, tmp_path: Path):
    forks = (
        request.getfixturevalue("forks")
        if server == "per-run"
        else SharedForkServer(request.getfixturevalue("shared_fork_server"))
    )
    log = tmp_path / "d.log"
    daemon = forks.start("zygote_target", ["wait", str(tmp_path)], log, {})
    try:
        wait_for(
            lambda: log.exists() and "ready" in log.read_text(), 120, "the forked daemon to start"
        )
        cmdline = Path(f"/proc/{daemon.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert f"-m zygote_target wait {tmp_path}" in cmdline
        with pytest.raises(subprocess.TimeoutExpired):
            daemon.wait(timeout=0.2)
        assert daemon.poll() is None
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == -signal.SIGTERM
    finally:
        daemon.kill()
    daemon.kill()  # after it exited: no error


def test_hetps_spawn_exec_turns_forking_off(monkeypatch):
    monkeypatch.setenv("HETPS_SPAWN", "exec")
    assert not forking_enabled()
    monkeypatch.delenv("HETPS_SPAWN")
    assert forking_enabled()


# ------------------------------------------------------------ the shared server (frontend/shared_forks.py)


def test_the_shared_server_forks_with_the_launchers_environment_path_and_directory(
    shared_fork_server, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # the daemon starts where the launcher is, as an exec'd one would
    # the launcher's whole environment travels
    monkeypatch.setenv("ZYGOTE_MARKER", "from-the-launcher")
    log = tmp_path / "d.log"
    # zygote_target is importable only through this process's sys.path (tests/), which travels too
    daemon = SharedForkServer(shared_fork_server).start(
        "zygote_target", ["5", "--rank", "1"], log, {}
    )
    assert daemon.wait(timeout=120) == 5 and daemon.poll() == 5
    assert "argv 5 --rank 1 marker from-the-launcher sid True" in log.read_text()
    assert Path(f"/proc/{daemon.pid}").exists() is False  # reaped by the server


def test_the_shared_server_refuses_another_interpreter_and_the_launcher_forks_its_own(
    shared_fork_server, tmp_path
):
    request = {
        "module": "zygote_target",
        "argv": ["3"],
        "log_path": str(tmp_path / "x.log"),
        "title": "x",
        "env": {},
        "cwd": str(tmp_path),
        "sys_path": [],
        "executable": "/elsewhere/python3",
        "pid": os.getpid(),
    }
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(30)
        conn.connect(shared_fork_server)
        conn.sendall(json.dumps(request).encode() + b"\n")
        answer = json.loads(conn.makefile().readline())
    assert "pid" not in answer and "/elsewhere/python3" in answer["error"], answer
    # a launcher whose own pid is not the one the kernel sees is in another pid namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(30)
        conn.connect(shared_fork_server)
        conn.sendall(
            json.dumps({**request, "executable": sys.executable, "pid": 1}).encode() + b"\n"
        )
        answer = json.loads(conn.makefile().readline())
    assert answer == {"error": "the peer is in another pid namespace"}, answer
    assert not (tmp_path / "x.log").exists()
    # a launcher whose shared server is gone forks from a fork server of its own
    forks = PreferShared(str(tmp_path / "no-such-socket"))
    log = tmp_path / "d.log"
    daemon = forks.start("zygote_target", ["4"], log, {"ZYGOTE_MARKER": "own"})
    assert daemon.wait(timeout=120) == 4 and forks.own is not None
    assert "marker own" in log.read_text()


def test_hetps_fork_server_names_the_shared_server(monkeypatch):
    monkeypatch.setenv("HETPS_FORK_SERVER", "/run/hetps/forks.sock")
    assert isinstance(fork_server(), PreferShared)
    monkeypatch.setenv("HETPS_SPAWN", "exec")  # exec wins over both
    assert fork_server() is None


def test_a_remote_daemons_status_is_read_from_what_came_with_its_pid_and_survives_a_lost_server():
    # the exit status arrived in the same read as the pid, then the server closed the connection
    ours, server_end = socket.socketpair()
    server_end.close()
    assert RemoteDaemon(ours, 12345, ["x"], b'{"exit": 5}\n').wait(timeout=5) == 5
    # the server went away without a status: the daemon is watched itself, not declared dead
    sleeper = subprocess.Popen(["sleep", "60"])
    ours, server_end = socket.socketpair()
    server_end.close()
    daemon = RemoteDaemon(ours, sleeper.pid, ["sleep"])
    try:
        assert daemon.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            daemon.wait(timeout=0.2)
    finally:
        sleeper.kill()
        sleeper.wait(timeout=30)
    assert daemon.wait(timeout=5) == 1  # gone; its status went with the server


def test_forked_processes_draw_their_own_request_ids():
    """Daemons forked from one warm server must not start their request ids
    where their siblings (or their own earlier incarnation) did."""
    from hetps.proto.rpc import RpcClient

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next id
        os.write(write, str(next(RpcClient._ids)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = int(os.read(read, 64))
    os.close(read)
    ours = next(RpcClient._ids)
    assert abs(child - ours) > 1000, (child, ours)
