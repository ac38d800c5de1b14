"""The `unit` tier: pure functions: no sockets, no processes. Every test collected under this folder is marked `unit`."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.unit)
