"""The scheduler's side of replicated shards: the ring of backups, the
failover plan, and the config check of `cluster.replicas`."""
from __future__ import annotations

import dataclasses

import pytest

from hetps.proto.config import ConfigError, load_config
from hetps.proto.errors import ProtocolError
from hetps.proto.plan import ClusterPlan, NodeEntry
from hetps.proto.records import read_plan
from hetps.scheduler.failover import check_readmit, failover_plan, replaced, with_backups
from hetps.scheduler.nodes import Node
from hetps.worker.state import model_specs
from shard_harness import make_plan, tiny_model


def three_shards() -> tuple[ClusterPlan, dict]:
    """A plan of shards with node ids 1, 2, 3 (fastest first) and their nodes."""
    plan = make_plan(model_specs(tiny_model()), [11, 12], n_shards=1)
    shards = [NodeEntry(i, rank, f"tcp://h:{100 + i}") for rank, i in enumerate((1, 2, 3))]
    plan = dataclasses.replace(plan, shards=shards, placement={n: i % 3 for i, n in enumerate(plan.placement)})
    nodes = {s.node_id: Node(s.node_id, "ps", s.rank, s.address, 0.0, replica_address=f"tcp://h:{200 + s.node_id}")
             for s in shards}
    return with_backups(plan, nodes, 1), nodes


def test_backups_form_a_ring_toward_the_next_slower_shard():
    plan, _ = three_shards()
    assert plan.backups == {"1": {"node": 2, "address": "tcp://h:202"}, "2": {"node": 3, "address": "tcp://h:203"},
                            "3": {"node": 1, "address": "tcp://h:201"}}
    assert read_plan(plan.to_dict()).backups == plan.backups   # travels in PLAN messages


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


def test_a_range_without_a_live_backup_is_reported_lost():
    plan, nodes = three_shards()
    nodes[2].dead = nodes[3].dead = True   # shard 2's backup is on 3
    new, lost = failover_plan(plan, 2, nodes)
    assert lost == ["shard 1 (node 2)"] and "2" not in new.served_by


@pytest.mark.parametrize("overrides,problem", [
    (["cluster.replicas=2"], "cluster.replicas: allowed values 0"),
    (["cluster.replicas=1", "cluster.shards=1"], "cluster.replicas: 1 needs at least 2 shards"),
])
def test_bad_replicas_name_the_key_and_the_allowed_values(overrides, problem):
    with pytest.raises(ConfigError) as ei:
        load_config(None, overrides)
    assert problem in str(ei.value)
