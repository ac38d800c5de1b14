"""`cluster.kill` entries fire by time (`at_s`) or by training progress
(`at_step`): exactly one of the two, each checked with a message naming the key."""

from __future__ import annotations

import pytest

from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ConfigError, KillFault


def test_a_kill_by_step_loads():
    cfg = load_config(None, ["cluster.kill=[{node: ps1, at_step: 160, restart_after_s: 1}]"])
    assert cfg.cluster.kill == [KillFault(node="ps1", at_step=160, restart_after_s=1.0)]
    assert cfg.cluster.kill[0].at_s is None
    cfg = load_config(None, ["cluster.kill=[{node: ps1, at_s: 1.5}]"])  # by time, as before
    assert cfg.cluster.kill[0].at_s == 1.5 and cfg.cluster.kill[0].at_step is None


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            "{node: ps0}",
            "cluster.kill.0: needs exactly one of at_s (seconds after training began) "
            "and at_step (workers' steps), got neither",
        ),
        (
            "{node: ps0, at_s: 1, at_step: 40}",
            "cluster.kill.0: needs exactly one of at_s "
            "(seconds after training began) and at_step (workers' steps), got both",
        ),
        ("{node: ps0, at_step: -1}", "cluster.kill.0.at_step: must be >= 0, got -1"),
    ],
)
def test_a_kill_needs_exactly_one_valid_trigger(entry, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"cluster.kill=[{entry}]"])
    assert len(info.value.errors) == 1 and info.value.errors[0].startswith(message), info.value
