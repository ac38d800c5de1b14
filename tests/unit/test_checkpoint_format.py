"""Shard checkpoints hold plain data only: they load with
torch.load(weights_only=True), and a policy's state survives the trip."""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from hetps.ps.averaging_rules import VariancePeriod
from hetps.ps.policies import Round
from hetps.ps.policy_state import from_plain, to_plain
from hetps.runtime import checkpoint


def test_policy_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    rng = random.Random(7)
    rng.random()
    rule = VariancePeriod(warmup_rounds=2)
    rule.peak, rule.last = 0.25, 3
    rnd = Round()
    rnd.add(4, {"w": torch.ones(2)}, {"bn": torch.full((1,), 2.0)})
    state = {"rounds": {(0, 5): rnd}, "rule": rule, "rng": rng, "members": {1, 2}, "clock": [3, 4]}
    path = tmp_path / "v000000000001.pt"
    checkpoint.write_atomic(path, {"format": checkpoint.FORMAT, "policy": to_plain(state)})
    loaded = from_plain(checkpoint.load(path)["policy"])  # weights_only=True inside
    back = loaded["rounds"][(0, 5)]
    assert (
        isinstance(back, Round)
        and back.members == rnd.members
        and torch.equal(back.grads["w"], rnd.grads["w"])
    )
    assert isinstance(loaded["rule"], VariancePeriod) and (
        loaded["rule"].peak,
        loaded["rule"].last,
    ) == (0.25, 3)
    assert loaded["rng"].random() == rng.random()  # the same draw sequence goes on
    assert loaded["members"] == {1, 2} and loaded["clock"] == [3, 4]


def test_a_pickled_object_is_refused(tmp_path):
    path = tmp_path / "v000000000002.pt"
    # a whole file (its checksum holds): the refusal is torch.load's weights_only
    checkpoint.write_atomic(path, {"format": checkpoint.FORMAT, "policy": random.Random(1)})
    with pytest.raises(pickle.UnpicklingError, match="Random"):  # not on torch's allow-list
        checkpoint.load(path)
