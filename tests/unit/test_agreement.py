"""The settings every host must agree on (runconfig/agreement.py) and REGISTER's checks of them
and of the rank (scheduler/registration.py), as pure functions. With real processes:
tests/cluster/test_cluster_config_drift.py."""

from __future__ import annotations

import pytest

from hetps.proto.errors import ProtocolError
from hetps.proto.messages import Register, Status
from hetps.runconfig.agreement import AGREED_KEYS, agreed_values, describe, differences
from hetps.runconfig.load import load_config
from hetps.scheduler.registration import check_agreement, check_rank

MINE = agreed_values(load_config(None, ["cluster.workers=2", "cluster.shards=1"]))


def theirs(*overrides: str) -> dict:
    return agreed_values(load_config(None, ["cluster.workers=2", "cluster.shards=1", *overrides]))


def test_the_agreed_values_are_plain_and_count_the_node_lists():
    assert MINE["cluster.workers"] == 2 and MINE["cluster.shards"] == 1
    assert MINE["model.name"] == "lenet5" and MINE["task"]["name"] == "classification"
    assert isinstance(MINE["optimizer"], dict) and MINE["optimizer"]["betas"] == [0.9, 0.999]
    assert list(MINE) == [k for k in AGREED_KEYS if k in MINE]
    # what may differ from host to host is not among them
    assert differences(MINE, theirs("cluster.workers.1.slowdown=3", "data.root=/elsewhere")) == []


@pytest.mark.parametrize(
    "overrides, keys",
    [
        (["cluster.workers=3"], ["cluster.workers"]),
        (["cluster.shards=2"], ["cluster.shards"]),
        (["model.name=mlp", "model.kwargs={hidden: [64]}"], ["model.name", "model.kwargs"]),
        (["data.dataset=synthetic"], ["data.dataset"]),
        (["seed=3"], ["seed"]),
        (["optimizer.momentum=0.5"], ["optimizer"]),
        (["algorithm.name=ssp"], ["algorithm.name", "algorithm.params"]),
        # a task without accuracy also drops the default target_accuracy
        (["task.name=regression"], ["task", "stop.target_accuracy"]),
    ],
)
def test_each_drift_is_named_with_both_values(overrides, keys):
    diffs = differences(MINE, theirs(*overrides))
    assert [k for k, _, _ in diffs] == keys
    with pytest.raises(ProtocolError) as exc:
        check_agreement(MINE, Register(role="worker", rank=1, agreed=theirs(*overrides)))
    assert exc.value.status == Status.CONFIG_MISMATCH
    for key, mine, their in diffs:
        assert f"{key}: " in exc.value.message
    assert exc.value.message.startswith("worker 1's configuration differs from the scheduler's: ")


def test_describe_shows_both_values_and_a_key_the_node_does_not_send():
    diffs = differences({"seed": 0, "task": {"name": "x"}}, {"seed": 7})
    assert describe(diffs, "scheduler", "worker 1") == (
        'seed: 7 (worker 1) vs 0 (scheduler); task: (not set) (worker 1) vs {"name": "x"} (scheduler)'
    )


def test_a_node_that_sends_no_settings_is_not_compared():
    check_agreement(MINE, Register(role="worker", rank=0))


@pytest.mark.parametrize(
    "role, rank, forming, refused",
    [
        ("worker", 1, True, False),
        ("worker", 2, True, True),  # it would stand in for worker 1
        ("worker", 2, False, False),  # a worker joining a running cluster
        ("worker", -1, True, False),  # --rank auto claims its rank
        ("ps", 1, True, True),
        ("ps", 1, False, True),
        ("evaluator", 5, True, False),
    ],
)
def test_a_rank_outside_the_configuration(role, rank, forming, refused):
    msg = Register(role=role, rank=rank)
    if not refused:
        check_rank(msg, 1 if role == "ps" else 2, forming)
        return
    with pytest.raises(ProtocolError) as exc:
        check_rank(msg, 1 if role == "ps" else 2, forming)
    assert exc.value.status == Status.CONFIG_MISMATCH
    assert f"{role} rank {rank} is not one of the configured ranks" in exc.value.message
