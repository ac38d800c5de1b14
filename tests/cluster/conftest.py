"""The `cluster` tier: real processes on loopback, random ports, a timeout on every wait. Every test collected under this folder is marked `cluster`."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.cluster)
