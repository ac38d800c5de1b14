"""CurveZMQ test helpers shared by tests/inproc/test_security.py (keys, the
bytes in transit) and tests/cluster/test_security_cluster.py (live daemons):
a keys directory, the config overrides that turn curve on, and the waits."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from cluster_util import REPO

from hetps.proto import security

CONFIG = str(REPO / "configs/default.yaml")
REPLY_S = 5.0  # any reply that must come
SILENCE_S = 1.5  # how long a reply that must NOT come is waited for
HANDSHAKE_S = 10.0  # a handshake's outcome


def curve_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """For a fixture (`yield from`): a keys directory with client pairs
    client-0 and ps0, $HETPS_KEYS_DIR and $HETPS_CLIENT_KEY unset; curve is
    off for this process again afterwards, whatever the test configured."""
    monkeypatch.delenv("HETPS_KEYS_DIR", raising=False)
    monkeypatch.delenv("HETPS_CLIENT_KEY", raising=False)
    path = tmp_path / "keys"
    security.write_keys(path, ["client-0", "ps0"])
    yield path
    security.reset()


def curve_overrides(keys: Path) -> list[str]:
    """Config overrides: curve on with the keys in `keys`."""
    return ["security.curve=true", f"security.keys_dir={keys}"]
