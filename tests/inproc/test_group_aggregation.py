"""A group that reduces before the shards (comm.aggregate, worker/group_reduce.py):
its members' gradients are reduced with a real gloo all-reduce (one thread
per member, a real TCPStore on a free port), and each of two real shards gets
one push carrying the group's mean and its members. The shards' values after
that one push equal those after today's round of one push per member, for
sync, balanced (sample-weighted) and a grouping group beside a solo group;
a push naming members of another group is refused and changes nothing."""

from __future__ import annotations

import threading

import pytest
import torch
from shard_harness import ShardHarness, grads, tiny_model, values_of

from hetps.proto.codec import ProtocolError
from hetps.proto.messages import Error, Push
from hetps.proto.plan import ClusterPlan, NodeEntry
from hetps.proto.rpc import RemoteError
from hetps.worker.group_reduce import GroupReduce, MemberStore

A, B, C = 11, 12, 13
BUFFERS = {"1.running_mean", "1.running_var", "1.num_batches_tracked"}  # tiny_model's BatchNorm
TIMEOUT_S = 30.0


def group_plan(members: list[int], address: str, algorithm: str) -> ClusterPlan:
    return ClusterPlan(
        plan_id=1,
        algorithm=algorithm,
        workers=[NodeEntry(w, r, address) for r, w in enumerate(members)],
        shards=[],
        tensors=[],
        placement={},
        groups=[members],  # sync, balanced: one group of every worker, as the formation makes it
        group_since={str(members[0]): 1},
    )


def reduce_in_threads(pushes: dict, algorithm: str) -> dict:
    """Each member's GroupReduce.reduce of its push (gradients, samples), run at once in one
    thread per member over real gloo; the Reduced of each member."""
    members = list(pushes)
    store = MemberStore(0, "ipc:///unused", TIMEOUT_S)
    plan = group_plan(members, store.address, algorithm)
    out, errors = {}, []

    def member(node: int) -> None:
        red = GroupReduce(node, "test", TIMEOUT_S, 32, weighted=algorithm == "balanced")
        try:
            red.use_plan(plan)
            g, n = pushes[node]
            out[node] = red.reduce(
                {k: v.clone() for k, v in g.items()}, 7 + node, n, 1, frozenset(BUFFERS)
            )
        except Exception as exc:  # reported below, in the test's thread
            errors.append(exc)
        finally:
            red.close()

    threads = [threading.Thread(target=member, args=(n,)) for n in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 2)
    assert not errors and len(out) == len(members), errors
    return out


def aggregated_push(h: ShardHarness, shard: int, node: int, reduced) -> Push:
    return Push(
        plan_id=h.plan_id,
        clock=dict(reduced.members)[node],
        base_version=0,
        n_samples=reduced.n_samples,
        tensors=h.part(reduced.tensors, shard),
        members=reduced.members,
    )


CASES = {
    "sync": ([], {A: 32, B: 32, C: 32}, [A, B, C]),
    "balanced": (["algorithm.global_batch=96"], {A: 16, B: 32, C: 48}, [A, B, C]),
    "grouping": ([], {A: 32, B: 32}, [A, B]),
}


@pytest.mark.parametrize("algorithm", list(CASES))
def test_one_aggregated_push_per_shard_updates_as_the_round_of_every_members_push(algorithm):
    overrides, samples, group = CASES[algorithm]
    model = tiny_model()  # with a BatchNorm: float buffers averaged, integer ones the largest
    assert BUFFERS <= set(values_of(model))
    pushes = {node: (grads(model, node), samples[node]) for node in group}
    for node, (g, _) in pushes.items():  # buffers that differ between members
        g["1.running_mean"] += node
        g["1.num_batches_tracked"] += node
    groups = [[A, B], [C]] if algorithm == "grouping" else ()
    opts = ["optimizer.momentum=0.9", "optimizer.lr=0.1", *overrides]
    harnesses = {
        kind: ShardHarness(model, opts, [A, B, C], n_shards=2, algorithm=algorithm, groups=groups)
        for kind in ("plain", "aggregated")
    }
    try:
        for h in harnesses.values():
            h.init(values_of(model))
        plain = harnesses["plain"]
        for node, (g, n) in pushes.items():
            for i in range(2):
                reply = plain.call(
                    node,
                    Push(
                        plan_id=plain.plan_id,
                        clock=7 + node,
                        base_version=0,
                        n_samples=n,
                        tensors=plain.part(g, i),
                    ),
                    i,
                )
                assert not isinstance(reply, Error), reply
        reduced = reduce_in_threads(pushes, algorithm)
        agg = harnesses["aggregated"]
        # shard i's slice is pushed by member i mod k, as Trainer.exchange_in_group does
        for i in range(2):
            node = group[i % len(group)]
            reply = agg.call(node, aggregated_push(agg, i, node, reduced[node]), i)
            assert not isinstance(reply, Error), reply
        got, want = agg.values(), plain.values()
        assert agg.versions() == plain.versions() == [1, 1]
        for name, t in want.items():
            torch.testing.assert_close(got[name], t, rtol=1e-6, atol=1e-7)
        assert not torch.equal(got["0.weight"], values_of(model)["0.weight"])
        # every member's clock moved as if each had pushed: the shards took one message each
        for stats in agg.stats():
            policy = stats.get("policy", stats)
            assert policy["accepted"] == 1 and policy["aggregated"] == 1, stats
            assert policy["contributions"] == len(group), stats
        for stats in plain.stats():
            policy = stats.get("policy", stats)
            assert policy["accepted"] == len(group), stats
    finally:
        for h in harnesses.values():
            h.close()


def test_members_of_two_groups_in_one_push_are_refused_and_change_nothing():
    model = tiny_model(batchnorm=False)
    h = ShardHarness(model, [], [A, B, C], algorithm="grouping", groups=[[A, B], [C]])
    try:
        h.init(values_of(model))
        before = h.values()
        with pytest.raises(RemoteError, match="BAD_STATE: aggregated push .* not all of its group"):
            h.call(
                A,
                Push(
                    plan_id=h.plan_id,
                    clock=0,
                    base_version=0,
                    n_samples=64,
                    tensors=h.part(grads(model, 1), 0),
                    members=[(A, 0), (C, 0)],
                ),
            )
        for name, t in before.items():
            assert torch.equal(h.values()[name], t)
    finally:
        h.close()


def test_an_aggregated_push_to_an_async_shard_is_refused():
    model = tiny_model(batchnorm=False)
    h = ShardHarness(model, [], [A, B], algorithm="async")
    try:
        h.init(values_of(model))
        with pytest.raises(RemoteError, match="BAD_STATE: async takes no aggregated push"):
            h.call(
                A,
                Push(
                    plan_id=h.plan_id,
                    clock=0,
                    base_version=0,
                    tensors=h.part(grads(model, 1), 0),
                    members=[(A, 0), (B, 0)],
                ),
            )
    finally:
        h.close()


def test_members_that_are_not_pairs_are_malformed():
    from hetps.proto.records import read_members

    assert read_members([[1, 0], [2, 5]]) == [(1, 0), (2, 5)]
    for bad in ([[1, 0], [1, 2]], [[1]], [[1, -1]], [["1", 0]], [[1, True]], "x"):
        with pytest.raises(ProtocolError):
            read_members(bad)
