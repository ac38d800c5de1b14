"""Replicated shards (`cluster.replicas: 1`) in one process, deterministically:
two shard processes, each the primary of its tensors and the backup of the
other's (mem:// transports, the workers' real PSClient, the scheduler's real
failover plan). A primary "dies" at a chosen event (a push arriving, before
or after it was forwarded to its backup): the process is never served again,
its backup is promoted by the failover plan, and the workers re-send what
was unanswered to the new address. The final parameters must equal those of
a run without the failure, and every push must be applied exactly once.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from shard_harness import SHARD_IDS, grads, make_plan, tiny_model, values_of

from hetps.proto.messages import Ack
from hetps.proto.transport import make_server
from hetps.ps.replication import ReplicaHost, ReplicatedShard, same_members
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ClusterConfig
from hetps.scheduler.failover import failover_plan, with_backups
from hetps.scheduler.nodes import Node
from hetps.training.state import model_specs
from hetps.worker.client import PSClient

A, B, C = 11, 12, 13
STEPS = 8
TIMEOUT_S = 15.0
# cpsgd: each push is a worker's model after one local step (the period the shards are configured with)
AVERAGING_INFO = {"steps": 1, "period": 1, "lr": 0.1, "weight_decay": 0.0}


@pytest.fixture(scope="module", autouse=True)
def warm_optimizer():
    """The first torch.optim optimizer imports torch._dynamo (seconds on a loaded machine)."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)


class Process:
    """One shard process: its primary and the backup it holds."""

    def __init__(self, shard: ReplicatedShard, host: ReplicaHost):
        self.shard, self.host = shard, host
        self.alive = True

    def parts(self) -> list:
        return [self.shard] + ([self.host.shadow] if self.host.shadow is not None else [])


class Cluster:
    """Two replicated shard processes served by one thread; `kill(i)` stops
    serving process i for good and publishes the scheduler's failover plan."""

    def __init__(
        self,
        algorithm: str,
        kill_at: tuple | None = None,
        late: bool = False,
        workers: tuple = (A, B),
        groups: tuple = (),
        overrides: tuple = (),
    ):
        self.model = tiny_model()
        self.cfg = load_config(
            None,
            [
                f"algorithm.name={algorithm}",
                "optimizer.momentum=0.9",
                "cluster.replicas=1",
                *overrides,
            ],
        )
        self.workers = workers
        # a model push says how it was made
        self.info = AVERAGING_INFO if algorithm == "cpsgd" else None
        tag = f"{algorithm}-{id(self)}"
        plan = make_plan(
            model_specs(self.model), list(workers), n_shards=2, algorithm=algorithm, groups=groups
        )
        plan = dataclasses.replace(
            plan,
            shards=[
                dataclasses.replace(s, address=f"mem://repl-{tag}-{i}")
                for i, s in enumerate(plan.shards)
            ],
        )
        hosts = [
            ReplicaHost(make_server(f"mem://repl-{tag}-backup-{i}"), self.cfg, SHARD_IDS[i])
            for i in range(2)
        ]
        self.nodes = {
            sid: Node(sid, "ps", i, plan.shards[i].address, 0.0, replica_address=hosts[i].address)
            for i, sid in enumerate(SHARD_IDS)
        }
        self.plan = with_backups(plan, self.nodes, 1)
        self.processes = []
        for i, host in enumerate(hosts):
            shard = KillableShard(
                make_server(self.plan.shards[i].address),
                SHARD_IDS[i],
                self.plan,
                self.cfg,
                cluster=self,
                index=i,
            )
            host.follow(self.plan)
            self.processes.append(Process(shard, host))
        self.kill_at = kill_at  # (process index, worker, clock, "before" | "after" forwarding)
        # the survivor adopts the failover plan only once a worker's request reached it
        self.late = late
        self.unadopted = None
        self.killed = threading.Event()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def plans(self, after: int):
        """What Membership.newer_plan gives a worker: the scheduler's plan if newer."""
        with self.lock:
            return self.plan if self.plan.plan_id > after else None

    def kill(self, index: int) -> None:
        """Process `index` dies (called on the serving thread); the scheduler
        declares it dead and publishes the failover plan, which the survivors adopt."""
        self.processes[index].alive = False
        dead = SHARD_IDS[index]
        self.nodes[dead].dead = True
        new, lost = failover_plan(self.plan, dead, self.nodes)
        assert new is not None and not lost and same_members(self.plan, new)
        with self.lock:
            self.plan = new
        self.killed.set()
        self.unadopted = new
        if not self.late:
            self._adopt()

    def _adopt(self) -> None:
        new, self.unadopted = self.unadopted, None
        for p in self.processes:
            if p.alive:
                p.shard.adopt(new)
                p.host.follow(new)

    def _serve(self) -> None:
        while not self.stop.is_set():
            if self.unadopted is not None and any(
                p.host.shadow.early for p in self.processes if p.alive
            ):
                self.early = len(
                    [e for p in self.processes if p.alive for e in p.host.shadow.early]
                )
                self._adopt()
            for p in self.processes:
                for part in p.parts() if p.alive else ():
                    part.serve_once(0.001)

    def serving(self, shard_index: int) -> ReplicatedShard:
        """The shard object that serves shard `shard_index`'s tensors now."""
        node = SHARD_IDS[shard_index]
        host = self.plan.served_by.get(str(node), node)
        p = self.processes[SHARD_IDS.index(host)]
        return p.shard if p.shard.node_id == node else p.host.shadow

    def client(self, node: int) -> PSClient:
        return PSClient(
            self.plan,
            node,
            ClusterConfig(request_timeout_s=TIMEOUT_S, retry_s=0.05),
            plans=self.plans,
        )

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        for p in self.processes:
            p.shard.server.close()
            p.host.close()


class KillableShard(ReplicatedShard):
    """A primary that dies when the push named by `cluster.kill_at` arrives:
    before forwarding it to its backup (applied here only, never answered)
    or right after (the backup has it; the held ACK never leaves)."""

    def __init__(self, *args, cluster: Cluster, index: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.cluster, self.index = cluster, index

    def _forward(self, env):
        at = self.cluster.kill_at
        hit = (
            at is not None
            and not self.cluster.killed.is_set()
            and self.role == "primary"
            and (self.index, env.src, getattr(env.msg, "clock", None)) == at[:3]
        )
        if hit and at[3] == "before":
            self.cluster.kill(self.index)
            return
        super()._forward(env)
        if hit:
            self.cluster.kill(self.index)

    def reply(self, peer, req_id, msg):
        if not self.cluster.processes[self.index].alive:
            return None  # nothing leaves a dead process
        return super().reply(peer, req_id, msg)


def run_sync(cluster: Cluster) -> dict:
    """Both workers train STEPS clocks in their own threads (sync rounds need both)."""
    cluster.thread.start()
    clients = {n: cluster.client(n) for n in cluster.workers}
    acked = {n: 0 for n in cluster.workers}
    errors: list[str] = []

    def train(node: int) -> None:
        try:
            for clock in range(STEPS):
                acks, _ = clients[node].push_pull(
                    grads(cluster.model, 10 * clock + node), clock, 8, cluster.info
                )
                assert all(isinstance(a, Ack) for a in acks)
                acked[node] += 1
        except Exception as exc:  # handed to the test thread
            errors.append(f"{node}: {exc!r}")

    try:
        clients[A].init(values_of(cluster.model))
        threads = [threading.Thread(target=train, args=(n,), daemon=True) for n in cluster.workers]
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


def run_async(cluster: Cluster) -> dict:
    """A and B push in turn from one thread: the same order in every run."""
    cluster.thread.start()
    clients = {n: cluster.client(n) for n in cluster.workers}
    acked = {n: 0 for n in cluster.workers}
    try:
        clients[A].init(values_of(cluster.model))
        for clock in range(STEPS):
            for node in (A, B):
                clients[node].push_pull(grads(cluster.model, 10 * clock + node), clock, 8)
                acked[node] += 1
    finally:
        cluster.close()
        for c in clients.values():
            c.close()
    return acked


def run_grouped(cluster: Cluster) -> dict:
    """Grouping, deterministically: at each clock the groups step in turn
    (group [A, B] together, in two threads, since its round needs both; then
    C alone), so the groups' updates land in the same order in every run."""
    cluster.thread.start()
    clients = {n: cluster.client(n) for n in cluster.workers}
    acked = {n: 0 for n in cluster.workers}
    errors: list[str] = []

    def step(node: int, clock: int) -> None:
        try:
            acks, _ = clients[node].push_pull(grads(cluster.model, 10 * clock + node), clock, 8)
            assert all(isinstance(a, Ack) for a in acks)
            acked[node] += 1
        except Exception as exc:  # handed to the test thread
            errors.append(f"{node}@{clock}: {exc!r}")

    try:
        clients[A].init(values_of(cluster.model))
        for clock in range(STEPS):
            for group in cluster.plan.groups:
                threads = [
                    threading.Thread(target=step, args=(n, clock), daemon=True) for n in group
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=2 * TIMEOUT_S)
                assert not any(t.is_alive() for t in threads), (
                    f"group {group} still waiting at clock {clock}"
                )
                assert not errors, errors
    finally:
        cluster.close()
        for c in clients.values():
            c.close()
    return acked


def final_values(cluster: Cluster) -> dict:
    out = {}
    for i in range(2):
        out.update({n: t.clone() for n, t in cluster.serving(i).store.tensors.items()})
    return out


RUNS = {"sync": run_sync, "async": run_async, "grouping": run_grouped, "cpsgd": run_sync}
# how each algorithm's cluster is made: workers, groups, config overrides
SETUPS = {
    "sync": {},
    "async": {},
    "grouping": {"workers": (A, B, C), "groups": ((A, B), (C,))},
    "cpsgd": {
        "overrides": (
            "algorithm.period=1",
            "optimizer.name=sgd",
            "optimizer.momentum=0",
            "optimizer.weight_decay=0",
        )
    },
}
# shard versions after STEPS clocks: one per round (sync, cpsgd), per push (async), per group round (grouping)
UPDATES = {"sync": STEPS, "async": 2 * STEPS, "grouping": 2 * STEPS, "cpsgd": STEPS}


CASES = [
    (a, when, victim, False)
    for a in ("sync", "async")
    for when in ("before", "after")
    for victim in (0, 1)
]
CASES += [(a, when, 1, True) for a in ("sync", "async") for when in ("before", "after")]
CASES += [
    (a, when, victim, late)
    for a in ("grouping", "cpsgd")
    for when, victim, late in (("before", 0, False), ("after", 1, False), ("after", 0, True))
]


@pytest.mark.parametrize("algorithm,when,victim,late", CASES)
def test_a_killed_primary_fails_over_to_its_backup_with_nothing_lost(algorithm, when, victim, late):
    """`when`: the primary dies before or after forwarding B's clock-3 push;
    `late`: B's re-sent request reaches the backup before its process learned
    of the failover (it is kept, and answered once promoted)."""
    reference = Cluster(algorithm, **SETUPS[algorithm])
    RUNS[algorithm](reference)
    cluster = Cluster(algorithm, kill_at=(victim, B, 3, when), late=late, **SETUPS[algorithm])
    acked = RUNS[algorithm](cluster)
    assert cluster.killed.is_set(), "the primary never saw the push it was to die at"
    assert not late or cluster.early >= 1, "no request reached the backup before its promotion"
    assert acked == {n: STEPS for n in cluster.workers}
    promoted = cluster.serving(victim)
    assert promoted.role == "primary" and promoted is cluster.processes[1 - victim].host.shadow
    assert cluster.plan.served_by == {str(SHARD_IDS[victim]): SHARD_IDS[1 - victim]}
    assert cluster.plan.backups == {}  # the survivor's backup died with the victim
    for i in range(2):  # every push applied exactly once, on both shards
        shard, ref = cluster.serving(i), reference.serving(i)
        assert (
            shard.policy.counts["accepted"]
            == ref.policy.counts["accepted"]
            == len(cluster.workers) * STEPS
        )
        assert shard.store.version == ref.store.version == UPDATES[algorithm]
        assert shard.policy.state_dict() == ref.policy.state_dict()
    expected, got = final_values(reference), final_values(cluster)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_the_backup_holds_the_primarys_state_and_acks_wait_for_it():
    """Without a failure: each backup ends with its primary's tensors, optimizer
    state and policy clocks; every push was forwarded, and no reply is left held."""
    cluster = Cluster("sync")
    run_sync(cluster)
    for p, other in zip(cluster.processes, reversed(cluster.processes)):
        primary, backup = p.shard, other.host.shadow
        assert backup.role == "backup" and backup.node_id == primary.node_id
        assert primary.counts["replicated"] == 2 * STEPS + 1  # the pushes and the INIT
        assert not primary.replicator.held and not primary.replicator.pending
        assert backup.store.version == primary.store.version == STEPS
        assert backup.policy.state_dict() == primary.policy.state_dict()
        assert {w: r for w, (r, _) in backup.recent_acks.by_worker.items()} == {
            w: r for w, (r, _) in primary.recent_acks.by_worker.items()
        }
        for name, t in primary.store.tensors.items():
            assert torch.equal(backup.store.tensors[name], t), name
        mine = primary.policy.updater.optimizer.state_dict()["state"]
        theirs = backup.policy.updater.optimizer.state_dict()["state"]
        assert all(
            torch.equal(mine[k]["momentum_buffer"], theirs[k]["momentum_buffer"]) for k in mine
        )


def test_a_plan_switch_reaches_the_backup_where_it_happened_in_the_push_order():
    """Sync: A's push opens a round, then B leaves (a new plan): the primary
    closes the round with A alone and forwards the plan behind A's push, so
    the backup closes the same round the same way; a later push follows it."""
    cluster = Cluster("sync")
    client = cluster.client(A)
    try:
        cluster.thread.start()
        client.init(values_of(cluster.model))
        client.push(grads(cluster.model, 1), 0, 8)  # acknowledged: both backups have it
    finally:
        cluster.stop.set()
        cluster.thread.join(timeout=10)
    without_b = dataclasses.replace(
        cluster.plan,
        plan_id=cluster.plan.plan_id + 1,
        workers=[w for w in cluster.plan.workers if w.node_id == A],
    )
    for p in cluster.processes:
        # on this thread: the serving one has stopped
        p.shard.adopt(without_b)

    def settle() -> None:
        while any(part.serve_once(0.01) for p in cluster.processes for part in p.parts()):
            pass

    settle()
    push = client.shards[0].send(
        client._push(0, client.split(grads(cluster.model, 2))[0], 1, 8, None)
    )
    settle()
    assert isinstance(client.shards[0].wait(push, timeout_s=TIMEOUT_S), Ack)
    try:
        for p, other in zip(cluster.processes, reversed(cluster.processes)):
            primary, backup = p.shard, other.host.shadow
            assert backup.plan.plan_id == without_b.plan_id and backup.policy.workers == [A]
            assert (
                backup.store.version
                == primary.store.version
                == (2 if p is cluster.processes[0] else 1)
            )
            assert backup.policy.state_dict() == primary.policy.state_dict()
            for name, t in primary.store.tensors.items():
                assert torch.equal(backup.store.tensors[name], t), name
    finally:
        client.close()
        for p in cluster.processes:
            p.shard.server.close()
            p.host.close()
