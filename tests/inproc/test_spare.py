"""Spare shards (`cluster.spare_shards`) in one process, deterministically:
two replicated shard processes and one spare with two backup slots (mem://
transports, the workers' real PSClient, the scheduler's real failover plan
and spare assignment). Shard process 0 dies; its backup on process 1 is
promoted, and the spare becomes the new backup of both ranges process 1 now
serves, by a copy of their state. Once both copies are confirmed, process 1
dies too: the spare takes both ranges over. Every acknowledged push must
still be there: the final parameters equal those of a run without failures,
and every push was applied exactly once.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from shard_harness import SHARD_IDS, grads, make_plan, tiny_model, values_of

from hetps.proto.messages import Ack
from hetps.proto.records import NodeStats
from hetps.proto.transport import make_server
from hetps.ps.replication import ReplicaHost, ReplicatedShard
from hetps.ps.spare import Spare
from hetps.ps.state_copy import from_wire, to_wire
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ClusterConfig
from hetps.scheduler.failover import failover_plan, with_backups, with_spares
from hetps.scheduler.nodes import Node
from hetps.training.state import model_specs
from hetps.worker.client import PSClient

A, B = 11, 12
SPARE = 30
STEPS = 12
TIMEOUT_S = 15.0


@pytest.fixture(scope="module", autouse=True)
def warm_optimizer():
    """The first torch.optim optimizer imports torch._dynamo (seconds on a loaded machine)."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)


class SpareCluster:
    """Two shard processes and a spare, served by one thread. With `kills`,
    process 0 dies once the shards applied `kills[0]` updates in all; process
    1 once both of the spare's copies were confirmed and `kills[1]` more
    updates were applied."""

    def __init__(self, algorithm: str, kills: tuple[int, int] | None = None):
        self.model = tiny_model()
        self.cfg = load_config(
            None,
            [
                f"algorithm.name={algorithm}",
                "optimizer.momentum=0.9",
                "cluster.replicas=1",
                "cluster.spare_shards=1",
            ],
        )
        tag = f"{algorithm}-{id(self)}"
        plan = make_plan(model_specs(self.model), [A, B], n_shards=2, algorithm=algorithm)
        plan = dataclasses.replace(
            plan,
            shards=[
                dataclasses.replace(s, address=f"mem://spare-{tag}-{i}")
                for i, s in enumerate(plan.shards)
            ],
        )
        self.hosts = [
            ReplicaHost(make_server(f"mem://spare-{tag}-backup-{i}"), self.cfg, SHARD_IDS[i])
            for i in range(2)
        ]
        self.spare = Spare(
            [make_server(f"mem://spare-{tag}-slot-{i}") for i in range(2)], self.cfg, SPARE
        )
        self.nodes = {
            sid: Node(
                sid, "ps", i, plan.shards[i].address, 0.0, replica_address=self.hosts[i].address
            )
            for i, sid in enumerate(SHARD_IDS)
        }
        self.nodes[SPARE] = Node(SPARE, "spare", 0, "", 0.0, spare_slots=self.spare.addresses)
        self.plan = with_spares(with_backups(plan, self.nodes, 1), self.nodes)
        self.shards = [
            ReplicatedShard(
                make_server(self.plan.shards[i].address), SHARD_IDS[i], self.plan, self.cfg
            )
            for i in range(2)
        ]
        for h in self.hosts:
            h.follow(self.plan)
        self.spare.follow(self.plan)
        self.alive = [True, True]
        self.kills = kills
        self.plans = [self.plan]  # every plan published, in order
        self.copied_at: int | None = None  # total updates when both copies were confirmed
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    # ------------------------------------------------------------ what the scheduler does
    def newer(self, after: int):
        with self.lock:
            return self.plan if self.plan.plan_id > after else None

    def kill(self, index: int) -> None:
        """Process `index` dies; the scheduler's failover plan (with the spare's
        slots as new backups) goes to every live process."""
        self.alive[index] = False
        dead = SHARD_IDS[index]
        self.nodes[dead].dead = True
        self.nodes[SPARE].stats = NodeStats.read(self.spare.stats())  # as its last heartbeat said
        new, lost = failover_plan(self.plan, dead, self.nodes)
        assert new is not None and not lost
        new = with_spares(new, self.nodes)
        with self.lock:
            self.plan = new
        self.plans.append(new)
        for i in (i for i in range(2) if self.alive[i]):
            self.shards[i].adopt(new)
            self.hosts[i].follow(new)
        self.spare.follow(new)

    # ------------------------------------------------------------ serving
    def parts(self) -> list:
        out = []
        for i in (i for i in range(2) if self.alive[i]):
            out += [self.shards[i]] + (
                [self.hosts[i].shadow] if self.hosts[i].shadow is not None else []
            )
        return out + [s.shadow for s in self.spare.slots if s.shadow is not None]

    def updates(self) -> int:
        return sum(self.serving(i).store.version for i in range(2))

    def copies_confirmed(self) -> bool:
        """Both spare slots hold a copied state, and the primaries heard so."""
        shadows = [s.shadow for s in self.spare.slots]
        return all(s is not None and s.policy is not None for s in shadows) and all(
            self.serving(i).replicator is not None and self.serving(i).replicator.confirmed >= 1
            for i in range(2)
        )

    def _maybe_kill(self) -> bool:
        """Kill what is due now (on the serving thread, between two requests); True if one died."""
        if self.kills is None:
            return False
        if self.alive[0] and self.updates() >= self.kills[0]:
            self.kill(0)
            return True
        if not self.alive[0] and self.alive[1]:
            if self.copied_at is None and self.copies_confirmed():
                self.copied_at = self.updates()
            if self.copied_at is not None and self.updates() >= self.copied_at + self.kills[1]:
                self.kill(1)
                return True
        return False

    def _serve(self) -> None:
        while not self.stop.is_set():
            for part in self.parts():
                part.serve_once(0.001)
                if self._maybe_kill():
                    break  # the dead process's parts are never served again

    def serving(self, index: int) -> ReplicatedShard:
        """The shard object that serves shard `index`'s tensors now."""
        node = SHARD_IDS[index]
        host = self.plan.served_by.get(str(node), node)
        if host == SPARE:
            return next(
                s.shadow
                for s in self.spare.slots
                if s.shadow is not None and s.shadow.node_id == node
            )
        i = SHARD_IDS.index(host)
        return self.shards[i] if node == host else self.hosts[i].shadow

    def client(self, node: int) -> PSClient:
        return PSClient(
            self.plan,
            node,
            ClusterConfig(request_timeout_s=TIMEOUT_S, retry_s=0.05),
            plans=self.newer,
        )

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        for s in self.shards:
            s.server.close()
        for h in self.hosts:
            h.close()
        self.spare.close()


def run(cluster: SpareCluster) -> dict:
    """STEPS clocks of A and B. Sync, grouping: each worker in its own thread
    (a round needs both); async, ssp: A and B in turn from this thread (the
    same order in every run). Returns the acknowledged pushes per worker."""
    cluster.thread.start()
    clients = {n: cluster.client(n) for n in (A, B)}
    acked = {A: 0, B: 0}
    errors: list[str] = []

    def step(node: int, clock: int) -> None:
        acks, _ = clients[node].push_pull(grads(cluster.model, 10 * clock + node), clock, 8)
        assert all(isinstance(a, Ack) for a in acks)
        acked[node] += 1

    def train(node: int) -> None:
        try:
            for clock in range(STEPS):
                step(node, clock)
        except Exception as exc:  # handed to the test thread
            errors.append(f"{node}: {exc!r}")

    try:
        clients[A].init(values_of(cluster.model))
        if cluster.plan.algorithm in ("async", "ssp"):
            for clock in range(STEPS):
                for node in (A, B):
                    step(node, clock)
        else:
            threads = [threading.Thread(target=train, args=(n,), daemon=True) for n in (A, B)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=STEPS * TIMEOUT_S)
            assert not any(t.is_alive() for t in threads), f"workers still waiting after {acked}"
    finally:
        cluster.close()
        for c in clients.values():
            c.close()
    assert not errors, errors
    return acked


def final_values(cluster: SpareCluster) -> dict:
    return {n: t.clone() for i in range(2) for n, t in cluster.serving(i).store.tensors.items()}


# shard versions after STEPS clocks: one per round (sync, grouping with one group), one per push (async, ssp)
UPDATES = {"sync": STEPS, "async": 2 * STEPS, "grouping": STEPS, "ssp": 2 * STEPS}


@pytest.mark.parametrize("algorithm", list(UPDATES))
def test_the_spare_becomes_the_new_backup_and_then_takes_over_with_nothing_lost(algorithm):
    reference = SpareCluster(algorithm)
    run(reference)
    cluster = SpareCluster(algorithm, kills=(5, 4))
    acked = run(cluster)
    assert cluster.alive == [False, False], (
        f"not both killed: {cluster.alive}, copies at {cluster.copied_at}"
    )
    assert acked == {A: STEPS, B: STEPS}
    first, second = cluster.plans[1], cluster.plans[2]
    slots = cluster.spare.addresses
    # the first failover: process 1 serves both ranges, each backed up on a spare slot
    assert first.served_by == {str(SHARD_IDS[0]): SHARD_IDS[1]}
    assert {b["node"] for b in first.backups.values()} == {SPARE} and len(first.backups) == 2
    assert sorted(b["address"] for b in first.backups.values()) == sorted(slots)
    # the second: the spare serves both, unreplicated
    assert second.served_by == {str(SHARD_IDS[0]): SPARE, str(SHARD_IDS[1]): SPARE}
    assert second.backups == {} and sorted(s.address for s in second.shards) == sorted(slots)
    for i in range(2):  # every push applied exactly once, by the spare that serves it now
        shard, ref = cluster.serving(i), reference.serving(i)
        assert shard.role == "primary" and shard in [s.shadow for s in cluster.spare.slots]
        assert shard.policy.counts["accepted"] == ref.policy.counts["accepted"] == 2 * STEPS
        assert shard.store.version == ref.store.version == UPDATES[algorithm]
        assert shard.counts["pushes"] == ref.counts["pushes"]
    expected, got = final_values(reference), final_values(cluster)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_a_copy_holds_the_primarys_state_bit_for_bit():
    """Sync, mid-round: A pushed, B not yet. The copy the spare takes holds the
    open round, the momentum, the clocks and the last ACK per worker; B's push
    then closes the round on both the same way."""
    cluster = SpareCluster("sync")
    client_a, client_b = cluster.client(A), cluster.client(B)
    try:
        cluster.thread.start()
        client_a.init(values_of(cluster.model))
        for clock in range(2):
            reqs = [
                c.shards[0].send(
                    c._push(0, c.split(grads(cluster.model, 10 * clock + n))[0], clock, 8, None)
                )
                for c, n in ((client_a, A), (client_b, B))
            ]
            assert all(
                isinstance(c.shards[0].wait(r, timeout_s=TIMEOUT_S), Ack)
                for c, r in zip((client_a, client_b), reqs)
            )
        open_a = client_a.shards[0].send(
            client_a._push(0, client_a.split(grads(cluster.model, 99))[0], 2, 8, None)
        )
        assert isinstance(client_a.shards[0].wait(open_a, timeout_s=TIMEOUT_S), Ack)
    finally:
        cluster.stop.set()
        cluster.thread.join(timeout=10)
    primary = cluster.shards[0]
    # a spare slot as the new backup of shard 0, by a plan that names it (as after a failover)
    moved = dataclasses.replace(
        cluster.plan,
        plan_id=cluster.plan.plan_id + 1,
        backups={str(SHARD_IDS[0]): {"node": SPARE, "address": cluster.spare.addresses[0]}},
    )
    primary.adopt(moved)
    cluster.spare.follow(moved)
    copy = cluster.spare.slots[0].shadow
    assert copy is not None and copy.policy is None
    try:

        def settle() -> None:
            while any(p.serve_once(0.01) for p in (primary, copy)):
                pass

        settle()
        assert copy.policy is not None and not primary.replicator.pending
        assert copy.store.version == primary.store.version == 2
        assert copy.policy.state_dict().keys() == primary.policy.state_dict().keys()
        assert copy.policy.pushed == primary.policy.pushed == {A: 3, B: 2}
        assert {w: r for w, (r, _) in copy.recent_acks.by_worker.items()} == {
            w: r for w, (r, _) in primary.recent_acks.by_worker.items()
        }
        assert_same_state(primary, copy)
        push = client_b.shards[0].send(
            client_b._push(0, client_b.split(grads(cluster.model, 98))[0], 2, 8, None)
        )
        settle()
        assert isinstance(client_b.shards[0].wait(push, timeout_s=TIMEOUT_S), Ack)
        settle()
        assert copy.store.version == primary.store.version == 3
        assert_same_state(primary, copy)
    finally:
        for c in (client_a, client_b):
            c.close()
        cluster.close()


def assert_same_state(primary: ReplicatedShard, copy: ReplicatedShard) -> None:
    for name, t in primary.store.tensors.items():
        assert torch.equal(copy.store.tensors[name], t), name
    mine = primary.policy.updater.optimizer.state_dict()["state"]
    theirs = copy.policy.updater.optimizer.state_dict()["state"]
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k]["momentum_buffer"], theirs[k]["momentum_buffer"]) for k in mine)
    ours, its = to_wire(primary.policy.state_dict()), to_wire(copy.policy.state_dict())
    assert ours[0] == its[0]  # same structure, scalars and clocks; the open rounds' tensors:
    assert ours[1].keys() == its[1].keys() and all(
        torch.equal(ours[1][k], its[1][k]) for k in ours[1]
    )


def test_state_wire_form_round_trips_and_refuses_what_it_does_not_make():
    state = {
        1: {"momentum_buffer": torch.arange(3.0)},
        "s": {2, 3},
        "u": (1, None, "x"),
        "l": [0.5, True],
    }
    plain, tensors = to_wire(state)
    back = from_wire(plain, tensors)
    assert back.keys() == state.keys() and torch.equal(
        back[1]["momentum_buffer"], state[1]["momentum_buffer"]
    )
    assert back["s"] == {2, 3} and back["u"] == (1, None, "x") and back["l"] == [0.5, True]
    from hetps.proto.errors import ProtocolError

    for bad in ({"t": "missing"}, {"x": []}, {"d": [[{"l": []}, 1]]}, {"d": [[1]]}, [1, 2]):
        with pytest.raises(ProtocolError):
            from_wire(bad, tensors)
    with pytest.raises(TypeError):
        to_wire({"f": object()})
