"""Spare shards (`cluster.spare_shards`) at the scheduler and at the spare's
command line: which slots become backups after a failover, when a spare is
promoted, a spare joining late or dying, the config check, `hetps ps --spare`."""

from __future__ import annotations

import dataclasses

import pytest
from shard_harness import make_plan, tiny_model

from hetps.proto.plan import NodeEntry
from hetps.proto.records import NodeStats
from hetps.proto.transport import make_server
from hetps.ps.spare import Spare
from hetps.runconfig.load import load_config
from hetps.scheduler.failover import failover_plan, with_backups, with_spares
from hetps.scheduler.nodes import Node
from hetps.training.state import model_specs

A, B = 11, 12
SPARE = 30


# ---------------------------------------------------------------- the scheduler's side


def two_shards_and_a_spare(ready: bool = True) -> tuple:
    """A ring plan of shards 1, 2 (fastest first), spare node 3 with two slots; shard 1 has failed over to 2."""
    plan = make_plan(model_specs(tiny_model()), [11, 12], n_shards=2)
    plan = dataclasses.replace(
        plan, shards=[NodeEntry(i, r, f"tcp://h:{100 + i}") for r, i in enumerate((1, 2))]
    )
    nodes = {
        i: Node(i, "ps", r, f"tcp://h:{100 + i}", 0.0, replica_address=f"tcp://h:{200 + i}")
        for r, i in enumerate((1, 2))
    }
    nodes[3] = Node(3, "spare", 0, "", 0.0, spare_slots=["tcp://h:301", "tcp://h:302"])
    plan = with_spares(with_backups(plan, nodes, 1), nodes)
    assert plan.backups == {
        "1": {"node": 2, "address": "tcp://h:202"},
        "2": {"node": 1, "address": "tcp://h:201"},
    }
    nodes[1].dead = True
    first, lost = failover_plan(plan, 1, nodes)
    first = with_spares(first, nodes)
    if ready:
        nodes[3].stats = NodeStats.read(
            {"backups": [{"of": 1, "ready": True}, {"of": 2, "ready": True}]}
        )
    return first, nodes


def test_a_failover_gives_the_spares_slots_to_the_ranges_left_without_a_backup():
    first, nodes = two_shards_and_a_spare()
    assert first.served_by == {"1": 2}
    assert first.backups == {
        "1": {"node": 3, "address": "tcp://h:301"},
        "2": {"node": 3, "address": "tcp://h:302"},
    }
    nodes[2].dead = True
    second, lost = failover_plan(first, 2, nodes)
    assert not lost and second.served_by == {"1": 3, "2": 3} and second.backups == {}
    assert [s.address for s in second.shards] == ["tcp://h:301", "tcp://h:302"]
    # the spare serves both: no slot of another process is free
    assert with_spares(second, nodes) is second


def test_a_spare_that_has_not_reported_its_copy_is_not_promoted():
    """The copy is confirmed by the spare's heartbeat: without it the range is lost, not served half-made."""
    first, nodes = two_shards_and_a_spare(ready=False)
    nodes[3].stats = NodeStats.read(
        {"backups": [{"of": 1, "ready": True}, {"of": 2, "ready": False}]}
    )
    nodes[2].dead = True
    second, lost = failover_plan(first, 2, nodes)
    assert lost == ["shard 1 (node 2)"] and second.served_by == {"1": 3}


def test_a_spare_registering_after_a_failover_becomes_the_backup_in_a_new_plan():
    from hetps.proto.codec import Envelope
    from hetps.proto.messages import Register, Welcome
    from hetps.scheduler.coordinator import Coordinator

    first, nodes = two_shards_and_a_spare()
    del nodes[3]
    # as without spares: both ranges on node 2, unreplicated
    first = dataclasses.replace(first, backups={})
    cfg = load_config(None, ["cluster.replicas=1", "cluster.spare_shards=1", "cluster.workers=2"])
    coord = Coordinator(make_server(f"mem://spare-coord-{id(nodes)}"), cfg)
    coord.keeps_state = False
    coord.nodes, coord.plan, coord.started = nodes, first, 0.0
    try:
        welcome = coord.on_register(
            b"peer", Envelope(Register(role="spare", rank=0, spare_slots=["tcp://h:9"]), 1, 0)
        )
        assert isinstance(welcome, Welcome) and welcome.role == "spare"
        assert coord.plan.plan_id == first.plan_id + 1
        # one slot: the first range without a backup gets it
        assert coord.plan.backups == {"1": {"node": welcome.node_id, "address": "tcp://h:9"}}
    finally:
        coord.server.close()


def test_spare_shards_needs_replicas():
    from hetps.runconfig.schema import ConfigError

    with pytest.raises(ConfigError, match="cluster.spare_shards.*replicas"):
        load_config(None, ["cluster.spare_shards=1"])
    with pytest.raises(ConfigError, match="cluster.spare_shards: must be >= 0"):
        load_config(None, ["cluster.replicas=1", "cluster.spare_shards=-1"])


# ---------------------------------------------------------------- `hetps ps --spare`


def test_spare_slots_take_consecutive_ports_or_random_ones():
    from hetps.ps.spare import slot_addresses

    assert slot_addresses("tcp://0.0.0.0:7101", 3) == [
        "tcp://0.0.0.0:7101",
        "tcp://0.0.0.0:7102",
        "tcp://0.0.0.0:7103",
    ]
    assert slot_addresses("tcp://127.0.0.1:0", 2) == ["tcp://127.0.0.1:0"] * 2


def test_the_spare_daemon_checks_its_flags(capfd):
    import faulthandler
    import signal

    from cluster_util import REPO

    from hetps.ps.__main__ import main

    config = str(REPO / "configs" / "sync.yaml")
    try:
        with pytest.raises(SystemExit) as ended:
            main(
                [
                    "--config",
                    config,
                    "--scheduler",
                    "tcp://scheduler:7000",
                    "--check",
                    "--spare",
                    "--rank",
                    "1",
                    "--replica-bind",
                    "tcp://0.0.0.0:7101",
                    "cluster.replicas=1",
                    "cluster.spare_shards=1",
                ]
            )
        assert ended.value.code == 0
        # one per shard
        assert "slots=tcp://0.0.0.0:7101,tcp://0.0.0.0:7102" in capfd.readouterr().out
        assert (
            main(
                [
                    "--config",
                    config,
                    "--scheduler",
                    "tcp://scheduler:7000",
                    "--spare",
                    "--rank",
                    "0",
                ]
            )
            == 2
        )
        assert "a spare needs cluster.replicas: 1" in capfd.readouterr().err
    finally:
        faulthandler.unregister(signal.SIGUSR1)  # main() pointed stack dumps at the captured stderr


def test_a_dead_spare_leaves_its_backups_to_the_next_spare():
    first, nodes = two_shards_and_a_spare()
    nodes[4] = Node(4, "spare", 1, "", 0.0, spare_slots=["tcp://h:401", "tcp://h:402"])
    nodes[3].dead = True
    new, lost = failover_plan(first, 3, nodes)
    assert not lost and new.backups == {} and new.served_by == first.served_by
    new = with_spares(new, nodes)
    assert new.backups == {
        "1": {"node": 4, "address": "tcp://h:401"},
        "2": {"node": 4, "address": "tcp://h:402"},
    }


def test_a_slot_whose_range_was_lost_takes_another_range():
    cfg = load_config(None, ["cluster.replicas=1", "cluster.spare_shards=1"])
    plan = make_plan(model_specs(tiny_model()), [A, B], n_shards=2)
    spare = Spare([make_server(f"mem://spare-lost-{id(cfg)}")], cfg, SPARE)
    slot = spare.addresses[0]
    try:
        spare.follow(
            dataclasses.replace(plan, plan_id=2, backups={"21": {"node": SPARE, "address": slot}})
        )
        assert spare.slots[0].shadow.node_id == 21
        spare.follow(
            dataclasses.replace(plan, plan_id=3, backups={"22": {"node": SPARE, "address": slot}})
        )
        assert spare.slots[0].shadow.node_id == 22 and spare.slots[0].shadow.role == "backup"
        promoted = dataclasses.replace(plan, plan_id=4, served_by={"22": SPARE})
        spare.follow(promoted)  # promoted, not dropped
        assert spare.slots[0].shadow.node_id == 22 and spare.slots[0].shadow.role == "primary"
    finally:
        spare.close()
