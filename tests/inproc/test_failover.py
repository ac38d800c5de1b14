"""The scheduler's side of replicated shards: the ring of backups, the
failover plan, and the config check of `cluster.replicas`."""

from __future__ import annotations

import dataclasses

import pytest
from shard_harness import make_plan, tiny_model

from hetps.proto.errors import ProtocolError
from hetps.proto.plan import ClusterPlan, NodeEntry
from hetps.proto.records import read_plan
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ConfigError
from hetps.scheduler.failover import check_readmit, failover_plan, replaced, with_backups
from hetps.scheduler.nodes import Node
from hetps.training.state import model_specs


def three_shards() -> tuple[ClusterPlan, dict]:
    """A plan of shards with node ids 1, 2, 3 (fastest first) and their nodes."""
    plan = make_plan(model_specs(tiny_model()), [11, 12], n_shards=1)
    shards = [NodeEntry(i, rank, f"tcp://h:{100 + i}") for rank, i in enumerate((1, 2, 3))]
    plan = dataclasses.replace(
        plan, shards=shards, placement={n: i % 3 for i, n in enumerate(plan.placement)}
    )
    nodes = {
        s.node_id: Node(
            s.node_id, "ps", s.rank, s.address, 0.0, replica_address=f"tcp://h:{200 + s.node_id}"
        )
        for s in shards
    }
    return with_backups(plan, nodes, 1), nodes


def test_backups_form_a_ring_toward_the_next_slower_shard():
    plan, _ = three_shards()
    assert plan.backups == {
        "1": {"node": 2, "address": "tcp://h:202"},
        "2": {"node": 3, "address": "tcp://h:203"},
        "3": {"node": 1, "address": "tcp://h:201"},
    }
    assert read_plan(plan.to_dict()).backups == plan.backups  # travels in PLAN messages


def test_failover_promotes_the_backup_and_drops_the_backup_the_dead_one_held():
    plan, nodes = three_shards()
    nodes[2].dead = True
    new, lost = failover_plan(plan, 2, nodes)
    assert not lost and new.plan_id == plan.plan_id + 1 and new.placement == plan.placement
    assert [s.address for s in new.shards] == ["tcp://h:101", "tcp://h:203", "tcp://h:103"]
    assert new.served_by == {"2": 3}
    # shard 1's backup was on the dead process, and the promoted range has none: only shard 3 keeps one
    assert new.backups == {"3": {"node": 1, "address": "tcp://h:201"}}
    assert replaced(new, 2) and not replaced(new, 1)
    with pytest.raises(ProtocolError, match="promoted backup"):
        check_readmit(new, nodes[2])
    # then the process serving shards 2 and 3 dies: 3 fails over to node 1, 2 (unreplicated) is lost
    nodes[3].dead = True
    third, lost = failover_plan(new, 3, nodes)
    assert lost == ["shard 1 (node 2)"]
    assert third.served_by == {"2": 3, "3": 1} and third.backups == {}
    assert third.shards[2].address == "tcp://h:201"


def test_after_a_failover_the_range_whose_backup_died_waits_for_its_own_restart():
    """Node 2 dies (3 promotes its backup); then node 1, whose backup was on node 2:
    its range has no copy left and is lost (not moved), and node 1 may come back
    as its owner, restoring its checkpoint as without replicas; node 3's backup
    on node 1 is gone, so nothing is replicated any more."""
    plan, nodes = three_shards()
    nodes[2].dead = True
    new, _ = failover_plan(plan, 2, nodes)
    nodes[1].dead = True
    third, lost = failover_plan(new, 1, nodes)
    assert lost == ["shard 0 (node 1)"]
    assert third.served_by == {"2": 3} and third.backups == {}
    # still its own address: a restart serves it again
    assert third.shards[0].address == "tcp://h:101"
    assert not replaced(third, 1)
    check_readmit(third, nodes[1])  # admitted (raises when refused)


def test_a_range_without_a_live_backup_is_reported_lost():
    plan, nodes = three_shards()
    nodes[2].dead = nodes[3].dead = True  # shard 2's backup is on 3
    new, lost = failover_plan(plan, 2, nodes)
    assert lost == ["shard 1 (node 2)"] and "2" not in new.served_by


@pytest.mark.parametrize(
    "overrides,problem",
    [
        (["cluster.replicas=2"], "cluster.replicas: allowed values 0"),
        (["cluster.replicas=1", "cluster.shards=1"], "cluster.replicas: 1 needs at least 2 shards"),
    ],
)
def test_bad_replicas_name_the_key_and_the_allowed_values(overrides, problem):
    with pytest.raises(ConfigError) as ei:
        load_config(None, overrides)
    assert problem in str(ei.value)


def test_the_scheduler_fails_over_a_silent_shard_and_a_restarted_scheduler_knows_who_is_primary(
    tmp_path, monkeypatch
):
    """In one process with an injected clock: ps1 falls silent, the
    coordinator publishes the failover plan; a new coordinator restored from
    the saved state has it, with who serves what; ps1 coming back is refused."""
    from test_coordinator import SPECS, SchedulerClock

    from hetps.proto.codec import Envelope
    from hetps.proto.messages import Register
    from hetps.proto.transport import MemServer
    from hetps.scheduler import coordinator as coordinator_module
    from hetps.scheduler import state
    from hetps.scheduler.coordinator import Coordinator

    clock = SchedulerClock()
    monkeypatch.setattr(coordinator_module, "time", clock)
    monkeypatch.setattr(state, "time", clock)
    cfg = load_config(
        None,
        [
            "cluster.workers=1",
            "cluster.shards=2",
            "cluster.replicas=1",
            "cluster.dead_after_s=2",
            "cluster.heartbeat_s=0.5",
        ],
    )

    def register(coord, role, rank, node_id=0):
        msg = Register(
            role=role,
            rank=rank,
            address=f"mem://{role}{rank}" if role == "ps" else "",
            replica_address=f"mem://{role}{rank}-backup" if role == "ps" else "",
            tensor_specs=SPECS if role == "worker" else [],
            speed=1.0 + rank,
            node_id=node_id,
        )
        return coord.on_register(b"peer", Envelope(msg, req_id=1, src=0))

    server = MemServer("mem://coordinator-failover-1")
    try:
        coord = Coordinator(server, cfg, run_dir=tmp_path)
        ps = {rank: register(coord, "ps", rank).node_id for rank in (0, 1)}
        register(coord, "worker", 0)
        first = coord.plan
        assert {b["address"] for b in first.backups.values()} == {
            "mem://ps0-backup",
            "mem://ps1-backup",
        }
        clock.advance(3.0)
        for node in coord.nodes.values():  # everyone but ps1 heartbeats
            node.last_seen = clock.mono if node.node_id != ps[1] else node.last_seen
        coord.tick()
        plan = coord.plan
        assert plan.plan_id == first.plan_id + 1 and plan.served_by == {str(ps[1]): ps[0]}
        assert plan.shards[plan.shard_index(ps[1])].address == "mem://ps0-backup"
        assert [f.kind for f in coord.failures] == ["shard_dead", "shard_failover"]
    finally:
        server.close()
    again_server = MemServer("mem://coordinator-failover-2")
    try:
        again = Coordinator(again_server, cfg, run_dir=tmp_path)
        again.restore(state.read(tmp_path))
        assert again.plan == plan
        with pytest.raises(ProtocolError, match="promoted backup"):
            register(again, "ps", 1, node_id=ps[1])
        again.runlog.close()
    finally:
        again_server.close()
