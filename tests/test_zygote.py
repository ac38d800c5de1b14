"""Daemons forked from the warm fork server (scheduler/zygote.py) behave like
`python -m MODULE ARGS` started by exec: exit status, signals, own session,
output in the log, environment, and the command line `ps` shows."""
import signal
import subprocess
from pathlib import Path

import pytest

from cluster_util import wait_for
from hetps.scheduler.zygote import ForkServer, forking_enabled

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


def test_a_forked_daemon_shows_its_command_line_and_dies_by_signal(forks, tmp_path: Path):
    log = tmp_path / "d.log"
    daemon = forks.start("zygote_target", ["wait", str(tmp_path)], log, {})
    try:
        wait_for(lambda: log.exists() and "ready" in log.read_text(), 120, "the forked daemon to start")
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
