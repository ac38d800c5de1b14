"""Whom a shard waits for (stall attribution, the shard's half): every policy
family names, in its heartbeat stats, the nodes its open rounds and parked
pulls wait for and who waits; a push that releases waiters is credited with
the time it held them up. Driven through ps.shard.Shard over the in-process
`mem://` transport (shard_harness.py), stats read back through the wire
records (proto.waits) exactly as the scheduler reads them."""

from __future__ import annotations

import pytest
from shard_harness import ShardHarness, closing_factory, grads, tiny_model

from hetps.proto.errors import ProtocolError
from hetps.proto.records import NodeStats
from hetps.proto.waits import HeldUp, WaitingFor
from hetps.training.state import model_specs, model_tensors

W = [11, 12, 13]  # worker node ids


class Cluster(ShardHarness):
    def __init__(self, algorithm: str, overrides: list[str] = (), groups=()):
        self.model = tiny_model()
        super().__init__(
            model_specs(self.model), list(overrides), W, 1, algorithm, plan_id=1, groups=groups
        )
        self.init({n: t.detach().clone() for n, (t, _) in model_tensors(self.model).items()}, W[0])

    def wire_stats(self) -> NodeStats:
        """The shard's stats as the scheduler decodes them from a heartbeat."""
        return NodeStats.read(self.shards[0].stats())

    def waiting(self) -> dict[int, WaitingFor]:
        return {w.node: w for w in self.wire_stats().waiting}

    def held(self) -> dict[int, HeldUp]:
        return {h.node: h for h in self.wire_stats().held}


@pytest.fixture
def clusters():
    yield from closing_factory(Cluster)


def test_a_sync_round_names_the_missing_worker_and_credits_its_push(clusters):
    c = clusters("sync")
    assert c.waiting() == {} and c.held() == {}
    for w in W[:2]:  # two of three push and pull: parked, waiting for the third
        c.push(w, 0, grads(c.model, w))
        c.send_pull(w, 1)
    waiting = c.waiting()
    assert list(waiting) == [W[2]]
    assert waiting[W[2]].waiters == tuple(W[:2]) and waiting[W[2]].for_s >= 0
    c.push(W[2], 0, grads(c.model, 3))  # closes the round: both pulls are answered
    assert c.shards[0].stats()["parked"] == 0 and c.waiting() == {}
    held = c.held()
    assert list(held) == [W[2]] and held[W[2]].waiters == 2 and held[W[2]].seconds > 0


def test_grouping_names_only_the_missing_member_of_its_own_group(clusters):
    c = clusters("grouping", groups=[[W[0], W[1]], [W[2]]])
    c.push(W[2], 0, grads(c.model, 1))  # the one-member group closes its round alone
    c.send_pull(W[2], 1)
    c.push(W[0], 0, grads(c.model, 2))
    c.send_pull(W[0], 1)
    waiting = c.waiting()
    assert list(waiting) == [W[1]] and waiting[W[1]].waiters == (W[0],)


def test_an_ssp_reader_names_the_workers_below_its_bound(clusters):
    c = clusters("ssp", ["algorithm.staleness=1"])
    for clock in range(3):  # W0 runs 3 pushes ahead; W1 made 1, W2 none
        c.push(W[0], clock, grads(c.model, clock))
    c.push(W[1], 0, grads(c.model, 9))
    c.send_pull(W[0], 3)  # needs every clock >= 2
    waiting = c.waiting()
    assert sorted(waiting) == [W[1], W[2]] and waiting[W[2]].waiters == (W[0],)
    c.push(W[1], 1, grads(c.model, 10))
    assert list(c.waiting()) == [W[2]]
    c.push(W[2], 0, grads(c.model, 11))
    c.push(W[2], 1, grads(c.model, 12))  # the slowest is the one who releases the reader
    assert c.waiting() == {} and list(c.held()) == [W[2]]


def test_eager_random_names_the_initiator(clusters):
    c = clusters("eager", ["algorithm.quorum=random", "algorithm.limiter=0"])
    initiator = c.shards[0].policy.initiator
    other = next(w for w in W if w != initiator)
    c.push(other, 0, grads(c.model, 1))
    c.send_pull(other, 1)
    assert list(c.waiting()) == [initiator]


def test_an_averaging_round_names_the_workers_whose_models_it_lacks(clusters):
    c = clusters("cpsgd", ["algorithm.period=1"])
    # a model, as tensors
    c.push(W[0], 0, grads(c.model, 1), info={"steps": 1, "period": 1, "lr": 0.1})
    c.send_pull(W[0], 1)
    assert sorted(c.waiting()) == W[1:]


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"waiting": [{"node": 1, "for_s": -1.0, "waiters": []}]}, "stats.waiting[0].for_s"),
        (
            {"waiting": [{"node": 1, "for_s": float("nan"), "waiters": []}]},
            "stats.waiting[0].for_s",
        ),
        ({"waiting": [{"node": "w", "for_s": 1.0, "waiters": []}]}, "stats.waiting[0].node"),
        ({"waiting": [{"node": 1, "for_s": 1.0}]}, "stats.waiting[0]"),
        ({"waiting": {"node": 1}}, "stats.waiting"),
        ({"held": [{"node": 1, "s": 2.0, "waiters": -3}]}, "stats.held[0].waiters"),
    ],
)
def test_a_bad_wait_record_is_refused_naming_the_field(bad, field):
    with pytest.raises(ProtocolError) as err:
        NodeStats.read(bad)
    assert field in str(err.value)


def test_wait_records_survive_the_wire_round_trip():
    wire = {
        "waiting": [{"node": 4, "for_s": 1.5, "waiters": [1, 2]}],
        "held": [{"node": 4, "s": 9.0, "waiters": 2}],
        "version": 3,
    }
    stats = NodeStats.read(wire)
    assert stats.waiting == (WaitingFor(4, 1.5, (1, 2)),) and stats.held == (HeldUp(4, 9.0, 2),)
    assert NodeStats.read(stats.as_dict()) == stats and stats.as_dict() == wire
