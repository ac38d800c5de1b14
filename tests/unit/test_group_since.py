"""ClusterPlan.group_since (scheduler/planning.py `with_group_since`): the plan since which a
group has had exactly its members, carried across plans that keep it, new for a group that
changed; a group that comes back after a break gets a new one (its collectives' old names,
in the store, belong to its former life)."""

from __future__ import annotations

import dataclasses

import pytest

from hetps.proto.codec import ProtocolError
from hetps.proto.plan import ClusterPlan, NodeEntry
from hetps.proto.records import read_plan
from hetps.scheduler.planning import with_group_since


def plan(plan_id: int, groups: list[list[int]]) -> ClusterPlan:
    workers = sorted(w for g in groups for w in g)
    return ClusterPlan(
        plan_id=plan_id,
        algorithm="grouping",
        workers=[NodeEntry(w, r) for r, w in enumerate(workers)],
        shards=[],
        tensors=[],
        placement={},
        groups=groups,
    )


def test_a_group_keeps_its_since_while_its_members_stay_and_gets_a_new_one_otherwise():
    first = with_group_since(plan(1, [[1, 2], [3, 4], [5]]), None)
    assert first.group_since == {"1": 1, "3": 1}  # groups of one have no collectives
    same = with_group_since(plan(2, [[1, 2], [3, 4], [5]]), first)
    assert same.group_since == {"1": 1, "3": 1}
    changed = with_group_since(plan(3, [[1, 2], [3, 4, 5]]), same)
    assert changed.group_since == {"1": 1, "3": 3}
    mixed = with_group_since(plan(4, [[1, 3], [2, 4, 5]]), changed)
    assert mixed.group_since == {"1": 4, "2": 4}
    back = with_group_since(plan(5, [[1, 2], [3, 4, 5]]), mixed)
    assert back.group_since == {"1": 5, "3": 5}


def test_it_travels_in_the_plan_and_is_read_back_checked():
    p = with_group_since(plan(1, [[1, 2]]), None)
    assert read_plan(p.to_dict()).group_since == {"1": 1}
    assert ClusterPlan.from_dict(p.to_dict()).group_since == {"1": 1}
    bad = dataclasses.replace(p, group_since={"1": "one"}).to_dict()
    with pytest.raises(ProtocolError, match="plan.group_since"):
        read_plan(bad)
