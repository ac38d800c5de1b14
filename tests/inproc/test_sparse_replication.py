"""Sparse tables under replication (`cluster.replicas: 1`), in one process:
two replicated shard processes (each the primary of its slices and the backup
of the other's), the workers' real SparseEmbedding modules and RowExchange,
mem:// transports. After every acknowledged PUSH_ROWS the backup's slices,
optimizer state, step counts, open rounds and last ACK per worker equal the
primary's; a re-sent push is applied once, on the primary, its backup and the
backup once promoted; a parked row pull under sync is answered only after the
backup confirmed the push that freed it; a backup made late, by a SNAPSHOT of
the primary's state, holds the same rows and follows on.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid

import pytest
import torch
from shard_harness import SHARD_IDS, make_plan, tiny_model, values_of
from torch import nn

from hetps.proto.codec import decode, encode
from hetps.proto.messages import Ack, Init, PullRows, PushRows, Rows
from hetps.proto.plan import TensorSpec
from hetps.proto.transport import TransportOptions, make_client, make_server
from hetps.ps.replication import ReplicaHost, ReplicatedShard
from hetps.ps.state_copy import from_wire, snapshot_of, to_wire
from hetps.runconfig.load import load_config
from hetps.scheduler.failover import failover_plan, with_backups
from hetps.scheduler.nodes import Node
from hetps.training.sparse import install
from hetps.training.state import model_specs
from hetps.worker.row_exchange import RowExchange

A, B = 11, 12
ROWS, DIM = 300, 4
TABLE = "emb.weight"
STEPS = 4
TIMEOUT_S = 15.0


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(ROWS, DIM, mode="sum")

    def forward(self, ids):
        return self.emb(ids).sum(1)


def config(algorithm: str, *extra: str):
    return load_config(
        None,
        [
            f"algorithm.name={algorithm}",
            "cluster.replicas=1",
            "sparse.tables=[emb]",
            "sparse.optimizer.name=adam",
            "sparse.optimizer.lr=0.05",
            "sparse.init_std=0.5",
            f"cluster.request_timeout_s={TIMEOUT_S}",
            *extra,
        ],
    )


class Cluster:
    """Two replicated shard processes of a plan with dense tensors (for INIT) and one sparse
    table. `late`: the first plan names no backups; `add_backups()` switches to one that
    does, and each primary copies its state to its new backup by a SNAPSHOT."""

    def __init__(self, algorithm: str, late: bool = False, rows: int = ROWS, server=None, extra=()):
        self.cfg = config(algorithm, *extra)
        self.model = tiny_model()
        tag = uuid.uuid4().hex[:10]
        make = server or (lambda name: make_server(f"mem://sprepl-{tag}-{name}"))
        primaries = [make(f"p{i}") for i in range(2)]
        self.hosts = [ReplicaHost(make(f"b{i}"), self.cfg, SHARD_IDS[i]) for i in range(2)]
        plan = make_plan(model_specs(self.model), [A, B], n_shards=2, algorithm=algorithm)
        plan = dataclasses.replace(
            plan,
            shards=[
                dataclasses.replace(s, address=primaries[i].address)
                for i, s in enumerate(plan.shards)
            ],
            tables=[TensorSpec(TABLE, "float32", (rows, DIM), "table")],
        )
        self.nodes = {
            sid: Node(sid, "ps", i, plan.shards[i].address, 0.0, replica_address=h.address)
            for i, (sid, h) in enumerate(zip(SHARD_IDS, self.hosts))
        }
        self.replicated = with_backups(plan, self.nodes, 1)
        self.plan = plan if late else self.replicated
        self.shards = [
            ReplicatedShard(primaries[i], SHARD_IDS[i], self.plan, self.cfg) for i in range(2)
        ]
        for h in self.hosts:
            h.follow(self.plan)
        self.alive = [True, True]
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def add_backups(self) -> None:
        self.plan = self.replicated
        for shard, host in zip(self.shards, self.hosts):
            host.follow(self.plan)
            shard.adopt(self.plan)

    def backup(self, i: int) -> ReplicatedShard:
        """The backup of shard i (held by the next process in the ring)."""
        return self.hosts[(i + 1) % 2].shadow

    def parts(self) -> list:
        return [
            p
            for i, (s, h) in enumerate(zip(self.shards, self.hosts))
            if self.alive[i]
            for p in (s, h.shadow)
            if p is not None
        ]

    def serve(self) -> None:
        """Serve until nothing is left to handle and no forward is unconfirmed."""
        for _ in range(1000):
            handled = sum(bool(p.serve_once(0.0)) for p in self.parts())
            pending = any(p.replicator and p.replicator.pending for p in self.parts())
            if not handled and not pending:
                return
        raise AssertionError("the shards did not settle")

    def answer(self, client, timeout_s: float = TIMEOUT_S):
        """Serve until `client` has its reply (sockets deliver after a while); the message."""
        for _ in range(int(timeout_s / 0.005)):
            for p in self.parts():
                p.serve_once(0.005)
            frames = client.recv(0.0)
            if frames is not None:
                return decode(frames).msg
        raise AssertionError("no reply")

    def start(self) -> None:
        def loop():
            while not self.stop.is_set():
                for p in self.parts():
                    with self.lock:
                        p.serve_once(0.001)

        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()

    def init(self) -> None:
        """A's INIT of the dense tensors (a shard's state_dict needs its policy)."""
        values = values_of(self.model)
        for i, shard in enumerate(self.shards):
            client = make_client(shard.server.address)
            owned = {t.name: values[t.name] for t in self.plan.owned(i)}
            client.send(encode(Init(plan_id=self.plan.plan_id, tensors=owned), 1, A))
            assert isinstance(self.answer(client), Ack)
            client.close()

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=10)
        for s, h in zip(self.shards, self.hosts):
            s.server.close()
            h.close()


@pytest.fixture
def clusters():
    made = []

    def make(*args, **kwargs):
        made.append(Cluster(*args, **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.close()


def sparse_state(shard: ReplicatedShard) -> dict:
    """What must be equal on a primary and its backup: slices, optimizer state, steps, open
    rounds, rows updated, updates and the last row ACK per worker."""
    state = shard.sparse.state_dict()
    state["counters"] = state["counters"][1:]  # rows pulled: pulls are not replicated
    return {"sparse": state, "acks": shard.rows.recent_acks.by_worker}


def assert_same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {set(a)} != {set(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_backups_equal(cluster: Cluster) -> None:
    for i, shard in enumerate(cluster.shards):
        assert_same(sparse_state(shard), sparse_state(cluster.backup(i)), f"shard {i}")


def worker(cluster: Cluster, node: int):
    torch.manual_seed(node)
    model = Bag()
    install(model, cluster.cfg)
    exchange = RowExchange(cluster.plan, node, cluster.cfg.cluster)
    exchange.bind(model)
    return model, exchange


def batch(node: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * node + step)
    # a hot range shared by both workers, and rows only one of them touches
    return torch.randint(0, 20 if step % 2 else ROWS, (6, 3), generator=g)


@pytest.mark.parametrize("algorithm", ["async", "sync"])
def test_backup_equals_primary_after_every_acknowledged_row_push(clusters, algorithm):
    cluster = clusters(algorithm)
    cluster.start()
    workers = {n: worker(cluster, n) for n in (A, B)}
    initial = [s.sparse.state_dict() for s in cluster.shards]
    for step in range(STEPS):
        for node, (model, exchange) in workers.items():
            (model(batch(node, step)) ** 2).mean().backward()
            acks = exchange.push(6)
            assert all(isinstance(a, Ack) for a in acks)
            with cluster.lock:
                assert_backups_equal(cluster)
    for i, shard in enumerate(cluster.shards):
        # one update per push (async) or per round of both (sync), on both copies
        assert shard.sparse.updates == (2 * STEPS if algorithm == "async" else STEPS)
        assert not torch.equal(
            initial[i]["tables"][TABLE]["weight"], shard.sparse.table(TABLE).weight
        )
        assert cluster.backup(i).counts["row_pushes"] == 2 * STEPS
    for _, exchange in workers.values():
        exchange.close()


def row_push(shard: int, clock: int, ids: list[int], plan_id: int) -> PushRows:
    ids_t = torch.tensor(ids, dtype=torch.int64)
    assert all(i % 2 == shard for i in ids)
    rows = torch.arange(len(ids) * DIM, dtype=torch.float32).reshape(len(ids), DIM) / 10 + 0.1
    return PushRows(
        plan_id=plan_id,
        clock=clock,
        n_samples=4,
        tensors={f"{TABLE}:ids": ids_t, f"{TABLE}:rows": rows},
    )


def test_a_resent_row_push_is_applied_once_on_primary_backup_and_promoted_backup(clusters):
    cluster = clusters("async")
    primary, backup = cluster.shards[0], cluster.backup(0)
    frames = encode(row_push(0, 0, [0, 4, 10], cluster.plan.plan_id), 777, A)
    client = make_client(primary.server.address)
    replies = []
    for _ in range(2):
        client.send(list(frames))
        cluster.serve()
        replies.append(decode(client.recv(TIMEOUT_S)).msg)
    assert replies[0] == replies[1] and isinstance(replies[0], Ack)
    assert primary.sparse.updates == backup.sparse.updates == 1
    assert primary.counts["retried"] == 1 and primary.counts["replicated"] == 1
    assert_backups_equal(cluster)
    # process 0 dies; its backup (on process 1) is promoted and gets the same push re-sent
    cluster.alive[0] = False
    cluster.nodes[SHARD_IDS[0]].dead = True
    new, lost = failover_plan(cluster.plan, SHARD_IDS[0], cluster.nodes)
    assert new is not None and not lost
    cluster.shards[1].adopt(new)
    cluster.hosts[1].follow(new)
    assert backup.role == "primary"
    to_backup = make_client(cluster.hosts[1].address)
    to_backup.send(list(frames))
    cluster.serve()
    assert decode(to_backup.recv(TIMEOUT_S)).msg == replies[0]
    assert backup.sparse.updates == 1 and backup.counts["retried"] == 1
    # and a new push is applied there
    to_backup.send(encode(row_push(0, 1, [2], new.plan_id), 778, A))
    cluster.serve()
    assert isinstance(decode(to_backup.recv(TIMEOUT_S)).msg, Ack)
    assert backup.sparse.updates == 2
    client.close()
    to_backup.close()


def test_a_parked_row_pull_is_answered_only_after_the_backup_confirmed(clusters):
    """Sync: A's pull waits for its round; B's push closes it. Until the backup confirmed
    B's push, neither B's ACK nor A's rows leave the primary."""
    cluster = clusters("sync")
    primary, backup = cluster.shards[0], cluster.backup(0)
    plan_id = cluster.plan.plan_id
    ca, cb = make_client(primary.server.address), make_client(primary.server.address)
    ca.send(encode(row_push(0, 0, [0, 2], plan_id), 1, A))
    cluster.serve()
    assert isinstance(decode(ca.recv(TIMEOUT_S)).msg, Ack)
    pull = PullRows(plan_id=plan_id, clock=1, tensors={f"{TABLE}:ids": torch.tensor([0, 4])})
    ca.send(encode(pull, 2, A))
    cb.send(encode(row_push(0, 0, [2, 4], plan_id), 1, B))
    for _ in range(20):  # the primary only: its backup is not served
        primary.serve_once(0.0)
    assert primary.sparse.updates == 1 and backup.sparse.updates == 0
    assert primary.replicator.pending
    assert ca.recv(0.05) is None, "rows left before the backup had the update they show"
    assert cb.recv(0.0) is None, "an ACK left before the backup had the push"
    cluster.serve()
    rows = decode(ca.recv(TIMEOUT_S)).msg
    assert isinstance(rows, Rows) and rows.version == 1
    assert torch.equal(
        rows.tensors[f"{TABLE}:rows"], backup.sparse.rows(TABLE, torch.tensor([0, 4]))
    )
    assert isinstance(decode(cb.recv(TIMEOUT_S)).msg, Ack)
    assert_backups_equal(cluster)
    ca.close()
    cb.close()


def test_snapshot_carries_the_sparse_tables():
    cluster = Cluster("sync")
    try:
        cluster.init()
        frames = encode(row_push(0, 0, [0, 2], cluster.plan.plan_id), 5, A)
        client = make_client(cluster.shards[0].server.address)
        client.send(frames)
        cluster.serve()
        client.close()
        state = cluster.shards[0].state_dict()
        plain, tensors = to_wire(state)
        back = from_wire(plain, tensors)
        assert_same(back["sparse"], state["sparse"])  # the open round of A included
        assert back["sparse"]["rounds"] and back["recent_row_acks"][A][0] == 5
        msg = snapshot_of(cluster.shards[0])
        weight = state["sparse"]["tables"][TABLE]["weight"]
        assert any(t.shape == weight.shape for t in msg.tensors.values())  # travels as a frame
    finally:
        cluster.close()


@pytest.mark.parametrize("algorithm", ["async", "sync"])
def test_a_late_backup_made_by_snapshot_holds_the_same_rows(clusters, algorithm):
    cluster = clusters(algorithm, late=True)
    cluster.init()
    cluster.start()
    workers = {n: worker(cluster, n) for n in (A, B)}

    def train(steps):
        for step in steps:
            for node, (model, exchange) in workers.items():
                (model(batch(node, step)) ** 2).mean().backward()
                exchange.push(6)

    train(range(2))
    (model, exchange) = workers[A]
    (model(batch(A, 2)) ** 2).mean().backward()
    exchange.push(6)  # under sync, A's round is open at the copy
    with cluster.lock:
        assert cluster.backup(0) is None and cluster.backup(1) is None
        cluster.add_backups()
    # B closes the round; then both train on, replicated by replay from the copy on
    model, exchange = workers[B]
    (model(batch(B, 2)) ** 2).mean().backward()
    exchange.push(6)
    with cluster.lock:
        assert_backups_equal(cluster)
        assert all(cluster.backup(i).sparse.updates > 0 for i in range(2))
    train(range(3, 5))
    with cluster.lock:
        assert_backups_equal(cluster)
        for i in range(2):
            # the copy's counts, then the pushes replayed after it
            assert cluster.backup(i).counts["row_pushes"] == cluster.shards[i].counts["row_pushes"]
    for _, exchange in workers.values():
        exchange.close()


def test_a_snapshot_of_a_slice_larger_than_a_frame_may_be_reaches_the_backup():
    """cluster.max_message_bytes bounds each frame a socket takes: a slice larger than that
    is split into row blocks that each fit, and the late backup still gets its copy."""
    limit = 1 << 20
    options = TransportOptions(max_message_bytes=limit)
    rows = 2 * (limit // (DIM * 4)) + 2 * 1000  # each shard's slice is over `limit` bytes
    cluster = Cluster(
        "async",
        late=True,
        rows=rows,
        server=lambda name: make_server("tcp://127.0.0.1:0", options),
        extra=[f"cluster.max_message_bytes={limit}"],
    )
    try:
        cluster.init()
        assert cluster.shards[0].sparse.table(TABLE).weight.nbytes > limit
        client = make_client(cluster.shards[0].server.address, options)
        client.send(encode(row_push(0, 0, [0, 2 * (rows // 2 - 1)], cluster.plan.plan_id), 9, A))
        assert isinstance(cluster.answer(client), Ack)
        cluster.add_backups()
        # the next push's ACK leaves only once the backup confirmed the copy before it
        client.send(encode(row_push(0, 1, [2], cluster.plan.plan_id), 10, A))
        assert isinstance(cluster.answer(client), Ack), "the copy never reached the backup"
        assert_backups_equal(cluster)
        client.close()
    finally:
        cluster.close()
