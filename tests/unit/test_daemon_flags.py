"""A daemon's bad flag is one line naming the flag and what it takes, exit
status 2, before anything starts (`--check` included): addresses, ports,
log levels, ranks; and environment variables standing for flags alike. In
one process: the daemons' main() with `--check`."""

from __future__ import annotations

import pytest
from cluster_util import REPO

from hetps.ps.__main__ import main as ps_main
from hetps.scheduler.__main__ import main as scheduler_main
from hetps.worker.__main__ import main as worker_main

CONFIG = str(REPO / "configs" / "sync.yaml")
SCHED = "tcp://scheduler:7000"  # never contacted: --check stops before connecting
MAINS = {"ps": ps_main, "worker": worker_main, "scheduler": scheduler_main}


# main() in this process: its SIGUSR1 stack dump undone after each test (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("no_stack_dump_handler_left")


def check(capfd, role: str, *flags: str) -> tuple[int, str]:
    """`hetps ROLE --check FLAGS` in this process: (exit status, stderr)."""
    scheduler = [] if role == "scheduler" else ["--scheduler", SCHED]
    with pytest.raises(SystemExit) as ended:
        MAINS[role](["--config", CONFIG, *scheduler, "--check", *flags])
    return ended.value.code, capfd.readouterr().err


@pytest.mark.parametrize(
    "role, flags, named",
    [
        ("ps", ["--bind", "nonsense"], "argument --bind: want tcp://HOST:PORT"),
        ("ps", ["--bind", "tcp://127.0.0.1:99999"], "port 0-65535"),
        ("ps", ["--advertise", "ps0:7100"], "argument --advertise"),
        ("ps", ["--replica-advertise", "tcp://ps0"], "argument --replica-advertise"),
        ("worker", ["--scheduler", "10.0.0.1:7000"], "argument --scheduler"),
        ("scheduler", ["--bind", "tcp://:7000"], "argument --bind"),
        (
            "ps",
            ["--log-level", "loud"],
            "argument --log-level: want one of DEBUG, INFO, WARNING, ERROR, CRITICAL",
        ),
        ("scheduler", ["--log-level", "loud"], "argument --log-level"),
        ("worker", ["--metrics-port", "70000"], "argument --metrics-port: want a port 1-65535"),
        ("ps", ["--rank", "-5"], "argument --rank: want a rank >= 0"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(capfd, role, flags, named):
    code, err = check(capfd, role, *flags)
    assert code == 2 and named in err, err
    # not the usage block
    assert err.count("\n") == 1 and err.startswith(f"hetps {role}: error: "), err


def test_environment_variables_are_checked_as_their_flags(capfd, monkeypatch):
    monkeypatch.setenv("HETPS_METRICS_PORT", "abc")
    code, err = check(capfd, "ps")
    assert code == 2 and "argument --metrics-port" in err and "'abc'" in err, err
    monkeypatch.delenv("HETPS_METRICS_PORT")
    monkeypatch.setenv("HETPS_LOG_LEVEL", "bogus")
    code, err = check(capfd, "scheduler")
    assert code == 2 and "argument --log-level" in err, err


@pytest.mark.parametrize(
    "role, flags",
    [
        ("ps", ["--bind", "tcp://0.0.0.0:7100", "--advertise", "tcp://ps0.example.org:7100"]),
        ("ps", ["--bind", "tcp://[::1]:0", "--log-level", "debug"]),
        ("ps", ["--ranks", "0,1", "--bind", "ipc:///tmp/hetps-ps{rank}"]),
        ("scheduler", ["--bind", "tcp://*:7000", "--metrics-port", "0"]),
        ("worker", ["--scheduler", "ipc:///run/hetps/scheduler"]),
    ],
)
def test_good_flags_pass(capfd, role, flags):
    code, err = check(capfd, role, *flags)
    assert code == 0, err
