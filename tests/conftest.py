"""Fixtures shared by the test modules."""
from __future__ import annotations

import pytest

from cluster_util import kill_leftovers


@pytest.fixture
def run_dir(tmp_path):
    """A run directory for a real cluster; every process still mentioning it
    afterwards is killed, and the test fails for it."""
    path = tmp_path / "run"
    yield path
    leftovers = kill_leftovers(str(path))
    assert not leftovers, f"processes left behind: {leftovers}"
