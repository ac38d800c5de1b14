"""Fixtures shared by the test modules."""
from __future__ import annotations

import pytest
import torch

from cluster_util import kill_leftovers

# One intra-op thread in the test process: `make test` runs the unit and inproc tiers on two
# pytest-xdist processes on a 2-core machine, and torch's default (one thread per core) would
# make them fight over the cores. Daemons set their own (`node.threads`).
torch.set_num_threads(1)


@pytest.fixture
def run_dir(tmp_path):
    """A run directory for a real cluster; every process still mentioning it
    afterwards is killed, and the test fails for it."""
    path = tmp_path / "run"
    yield path
    leftovers = kill_leftovers(str(path))
    assert not leftovers, f"processes left behind: {leftovers}"


# ------------------------------------------------------------ tiers
# Every test is in one tier, selectable with -m: `cluster` (real processes on loopback; marked in
# its module), `inproc` (roles over the in-process transport or real sockets inside this process),
# `unit` (pure functions). `make test` runs all three: unit and inproc on 2 xdist processes, then the
# cluster tier on 2, then the cluster tests marked `exclusive` (they compare timings) alone
# (docs/testing.md); `make test-unit`, `test-inproc`, `test-cluster` run one.
IN_PROCESS = ("MemServer", "shard_harness", "mem://", "make_server(", "bind_to_random_port", "hetps.sim")


def pytest_configure(config):
    config.addinivalue_line("markers", "inproc: roles over the in-process transport or sockets in this process")
    config.addinivalue_line("markers", "unit: pure functions, no sockets, no processes")


def _module_is_inproc(module, cache: dict) -> bool:
    path = str(module.__file__)
    if path not in cache:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        cache[path] = any(needle in source for needle in IN_PROCESS)
    return cache[path]


def pytest_collection_modifyitems(config, items):
    cache: dict = {}
    for item in items:
        if item.get_closest_marker("cluster"):
            continue
        item.add_marker(pytest.mark.inproc if _module_is_inproc(item.module, cache) else pytest.mark.unit)
