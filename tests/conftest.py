"""Fixtures shared by the test modules, and the tiers.

Every test is in one tier, by the folder it sits in (each folder's conftest.py marks it, so `-m`
selects a tier): `unit/` (pure functions: no sockets, no processes), `inproc/` (roles over the
in-process transport or real sockets inside the test process), `cluster/` (real processes on
loopback). `support/` holds the harnesses the tiers share. `make test` runs unit and inproc on 2
xdist processes, then the cluster tier on 2, then the cluster tests marked `exclusive` (they compare
timings) alone (docs/testing.md); `make test-unit`, `test-inproc`, `test-cluster` run one.
"""

from __future__ import annotations

import faulthandler
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "support"))  # cluster_util, shard_harness, ...

import pytest
import torch
from cluster_util import kill_leftovers, wait_for
from shard_harness import ShardHarness, closing_factory

# One intra-op thread in the test process: `make test` runs the unit and inproc tiers on two
# pytest-xdist processes on a 2-core machine, and torch's default (one thread per core) would
# make them fight over the cores. Daemons set their own (`node.threads`).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def shared_fork_server(tmp_path_factory):
    """One warm fork server per test process, shared by every `hetps run` of the cluster tests
    (frontend/shared_forks.py): torch is imported once, not once per run (~3 s of CPU each)."""
    folder = tmp_path_factory.mktemp("forks")
    folder.chmod(0o700)
    sock, log = folder / "sock", folder / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "hetps.frontend.shared_fork_server", str(sock)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        wait_for(lambda: sock.exists() or server.poll() is not None, 120, "the shared fork server")
        assert server.poll() is None, log.read_text()
        yield str(sock)
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(autouse=True)
def _fork_from_the_shared_server(request, monkeypatch):
    """Cluster tests' runs fork their daemons from the shared server, except those marked
    `own_fork_server` (they keep the per-run fork server a user's `hetps run` starts)."""
    node = request.node
    if node.get_closest_marker("cluster") and not node.get_closest_marker("own_fork_server"):
        monkeypatch.setenv("HETPS_FORK_SERVER", request.getfixturevalue("shared_fork_server"))


@pytest.fixture
def run_dir(tmp_path):
    """A run directory for a real cluster; every process still mentioning it
    afterwards is killed, and the test fails for it."""
    path = tmp_path / "run"
    yield path
    leftovers = kill_leftovers(str(path))
    assert not leftovers, f"processes left behind: {leftovers}"


@pytest.fixture
def no_stack_dump_handler_left():
    """A daemon's main() run in the test process points `kill -USR1` stack dumps at the test's
    captured stderr (runtime/daemon.py), a file closed after the test: undone after it."""
    yield
    faulthandler.unregister(signal.SIGUSR1)


@pytest.fixture
def harnesses():
    """`harnesses(model_or_specs, overrides, workers, n_shards, algorithm, ...)`: a
    ShardHarness (support/shard_harness.py); each one made is closed after the test."""
    yield from closing_factory(ShardHarness)
