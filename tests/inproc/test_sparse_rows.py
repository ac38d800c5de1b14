"""Sparse tables end to end in one process: the workers' SparseEmbedding
modules and RowExchange against real Shards (served on a thread over the
in-process transport). Row-sparse training must equal dense training of the
same table with the same torch optimizer; malformed id frames get ERROR
replies and the shard keeps serving; a synchronous round makes a member's
next pull wait for the others."""

from __future__ import annotations

import threading
import uuid
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetps.proto.codec import Envelope
from hetps.proto.messages import PullRows, PushRows, Status
from hetps.proto.plan import ClusterPlan, NodeEntry, TensorSpec
from hetps.proto.rpc import RemoteError, RequestTimeout, RpcClient
from hetps.proto.transport import make_server
from hetps.ps.shard import Shard
from hetps.runconfig.load import load_config
from hetps.training.sparse import install, tables_of
from hetps.worker.row_exchange import RowExchange

ROWS, DIM = 500, 6
SHARDS = (21, 22)
WORKERS = (11, 12)


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(ROWS, DIM, mode="sum")
        self.tok = nn.Embedding(ROWS, DIM)

    def forward(self, ids):
        # ids (B, 3): a bag of the three, plus a plain lookup of the first (a table used twice
        # in one step: its rows' gradients must be summed before the push)
        return self.emb(ids).sum(1) + self.tok(ids[:, 0]).sum(1)


def config(algorithm: str, optimizer: str):
    return load_config(
        None,
        [
            f"algorithm.name={algorithm}",
            "sparse.tables=[emb, tok]",
            f"sparse.optimizer.name={optimizer}",
            "sparse.optimizer.lr=0.1",
            "sparse.init_std=0.5",
            "cluster.request_timeout_s=20",
        ],
    )


class Cluster:
    """Two shards on a serving thread, a plan with the two tables."""

    def __init__(self, cfg, algorithm: str):
        tables = [
            TensorSpec("emb.weight", "float32", (ROWS, DIM), "table"),
            TensorSpec("tok.weight", "float32", (ROWS, DIM), "table"),
        ]
        addresses = [f"mem://sparse-{uuid.uuid4().hex}" for _ in SHARDS]
        self.plan = ClusterPlan(
            plan_id=1,
            algorithm=algorithm,
            workers=[NodeEntry(w, r) for r, w in enumerate(WORKERS)],
            shards=[NodeEntry(s, i, a) for i, (s, a) in enumerate(zip(SHARDS, addresses))],
            tensors=[],
            placement={},
            tables=tables,
            groups=[list(WORKERS)] if algorithm == "sync" else [[w] for w in WORKERS],
        )
        self.shards = [Shard(make_server(a), s, self.plan, cfg) for s, a in zip(SHARDS, addresses)]
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            for s in self.shards:
                with self.lock:
                    s.serve_once(0.001)

    def close(self):
        self.stop.set()
        self.thread.join(timeout=10)


@pytest.fixture
def cluster_of():
    made = []

    def make(algorithm, optimizer):
        c = Cluster(config(algorithm, optimizer), algorithm)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def worker(cluster, node_id, cfg, read_only=False):
    torch.manual_seed(0)
    model = Bag()
    install(model, cfg)
    exchange = RowExchange(cluster.plan, node_id, cfg.cluster, read_only=read_only)
    exchange.bind(model)
    return model, exchange


def full_tables(cluster, cfg):
    model, reader = worker(cluster, 99, cfg, read_only=True)
    out = {n: reader.full_table(t.spec, batch=128) for n, t in tables_of(model).items()}
    reader.close()
    return out


def batches(seed, steps):
    g = torch.Generator().manual_seed(seed)
    # repeated ids within a batch, and a hot range, as in skewed categorical data
    return [torch.randint(0, 40 if s % 2 else ROWS, (8, 3), generator=g) for s in range(steps)]


def dense_reference(initial, optimizer):
    weights = {n: nn.Parameter(t.clone()) for n, t in initial.items()}
    opt = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
        "adam": lambda p: torch.optim.SparseAdam(p, lr=0.1),
    }[optimizer](list(weights.values()))
    return weights, opt


def dense_loss(weights, ids):
    # sparse gradients, as torch.optim.SparseAdam needs (SGD and Adagrad take them too)
    out = F.embedding_bag(ids, weights["emb.weight"], mode="sum", sparse=True).sum(1)
    out = out + F.embedding(ids[:, 0], weights["tok.weight"], sparse=True).sum(1)
    return (out**2).mean()


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_sync_rounds_equal_dense_training(cluster_of, optimizer):
    """Two workers under sync: each step's row pushes are averaged per id and
    applied once per round, exactly the dense mean gradient's update."""
    cfg = config("sync", optimizer)
    cluster = cluster_of("sync", optimizer)
    initial = full_tables(cluster, cfg)
    weights, opt = dense_reference(initial, optimizer)
    workers = [worker(cluster, w, cfg) for w in WORKERS]
    data = [batches(i, 6) for i in range(2)]
    for step in range(6):
        for (model, exchange), stream in zip(workers, data):
            (model(stream[step]) ** 2).mean().backward()
            exchange.push(8)
        opt.zero_grad()
        for stream in data:
            (dense_loss(weights, stream[step]) / 2).backward()
        opt.step()
    trained = full_tables(cluster, cfg)
    for name, w in weights.items():
        assert not torch.equal(trained[name], initial[name])
        torch.testing.assert_close(trained[name], w.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_async_pushes_apply_one_by_one(cluster_of, optimizer):
    cfg = config("async", optimizer)
    cluster = cluster_of("async", optimizer)
    initial = full_tables(cluster, cfg)
    weights, opt = dense_reference(initial, optimizer)
    workers = [worker(cluster, w, cfg) for w in WORKERS]
    data = [batches(i + 5, 4) for i in range(2)]
    for step in range(4):
        for (model, exchange), stream in zip(workers, data):
            (model(stream[step]) ** 2).mean().backward()
            exchange.push(8)
            opt.zero_grad()
            dense_loss(weights, stream[step]).backward()
            opt.step()
    trained = full_tables(cluster, cfg)
    for name, w in weights.items():
        torch.testing.assert_close(trained[name], w.detach(), rtol=1e-6, atol=1e-6)


def test_a_members_pull_waits_for_its_round(cluster_of):
    cfg = config("sync", "sgd")
    cluster = cluster_of("sync", "sgd")
    (model_a, a), (model_b, b) = (worker(cluster, w, cfg) for w in WORKERS)
    ids = torch.tensor([[0, 1, 2], [3, 4, 5]])
    (model_a(ids) ** 2).mean().backward()
    a.push(2)
    # a's next pull of a row of shard 0 waits: b has not pushed this round
    client = a.shards[0]
    req = client.send(
        PullRows(plan_id=1, clock=a.clock, tensors={"emb.weight:ids": torch.tensor([0])})
    )
    with pytest.raises(RequestTimeout):
        client.wait(req, timeout_s=0.3)
    (model_b(ids) ** 2).mean().backward()
    b.push(2)
    reply = client.wait(req, timeout_s=10)
    assert reply.tensors["emb.weight:rows"].shape == (1, DIM)


@pytest.mark.parametrize(
    "frames, status",
    [
        ({"emb.weight:ids": torch.tensor([1])}, Status.MALFORMED),  # shard 1's row
        ({"emb.weight:ids": torch.tensor([0, 0])}, Status.MALFORMED),  # repeated
        ({"emb.weight:ids": torch.tensor([-2])}, Status.MALFORMED),  # negative
        ({"emb.weight:ids": torch.tensor([ROWS * 2])}, Status.MALFORMED),  # past the end
        ({"emb.weight:ids": torch.tensor([0], dtype=torch.int32)}, Status.DTYPE_NOT_ALLOWED),
        ({"emb.weight:ids": torch.zeros(1, 1, dtype=torch.int64)}, Status.SHAPE_MISMATCH),
        ({"nope:ids": torch.tensor([0])}, Status.UNKNOWN_TENSOR),
        ({"emb.weight": torch.tensor([0])}, Status.MALFORMED),
    ],
)
def test_malformed_ids_get_an_error_and_the_shard_serves_on(cluster_of, frames, status):
    cfg = config("async", "sgd")
    cluster = cluster_of("async", "sgd")
    client = RpcClient(cluster.plan.shards[0].address, src=WORKERS[0], timeout_s=10)
    with pytest.raises(RemoteError) as err:
        client.wait(client.send(PullRows(plan_id=1, tensors=frames)))
    assert err.value.status == status
    bad_push = {**frames, "emb.weight:rows": torch.zeros(1, DIM)}
    with pytest.raises(RemoteError):
        client.wait(client.send(PushRows(plan_id=1, clock=0, tensors=bad_push)))
    # nothing was applied, and the shard still answers
    ok = client.wait(
        client.send(PullRows(plan_id=1, tensors={"emb.weight:ids": torch.tensor([0, 2])}))
    )
    assert ok.tensors["emb.weight:rows"].shape == (2, DIM)
    assert cluster.shards[0].sparse.updates == 0
    client.close()
    del cfg


def test_wrong_rows_shape_and_nonfinite_rows_are_refused(cluster_of):
    cluster = cluster_of("async", "sgd")
    client = RpcClient(cluster.plan.shards[0].address, src=WORKERS[0], timeout_s=10)
    ids = torch.tensor([0, 2])
    for rows, status in (
        (torch.zeros(3, DIM), Status.SHAPE_MISMATCH),
        (torch.zeros(2, DIM, dtype=torch.float64), Status.DTYPE_NOT_ALLOWED),
        (torch.full((2, DIM), float("nan")), Status.NONFINITE),
    ):
        push = PushRows(
            plan_id=1, clock=0, tensors={"emb.weight:ids": ids, "emb.weight:rows": rows}
        )
        with pytest.raises(RemoteError) as err:
            client.wait(client.send(push))
        assert err.value.status == status
    assert cluster.shards[0].sparse.updates == 0
    client.close()


# ---------------------------------------------------------------- rounds across plan changes


def one_shard(plan_workers=(11, 12, 13), plan_id=1):
    """A shard of a 10 x 2 table under sync, driven by direct handler calls."""
    cfg = load_config(
        None, ["algorithm.name=sync", "sparse.tables=[emb]", "sparse.optimizer.name=sgd"]
    )
    plan = ClusterPlan(
        plan_id=plan_id,
        algorithm="sync",
        run_id="r",
        workers=[NodeEntry(w, r) for r, w in enumerate(plan_workers)],
        shards=[NodeEntry(21, 0, "")],
        tensors=[TensorSpec("w", "float32", (2,))],
        placement={"w": 0},
        tables=[TensorSpec("emb.weight", "float32", (10, 2), "table")],
        groups=[list(plan_workers)],
    )
    shard = Shard(make_server(f"mem://one-{uuid.uuid4().hex}"), 21, plan, cfg)
    shard.store.initialize({"w": torch.zeros(2)})
    shard._make_policy()
    return shard, plan


REQ = iter(range(1000, 10**9))


def row_push(shard, worker, plan_id):
    frames = {"emb.weight:ids": torch.tensor([0]), "emb.weight:rows": torch.ones(1, 2)}
    env = Envelope(PushRows(plan_id=plan_id, clock=0, tensors=frames), next(REQ), worker)
    return shard.on_push_rows(b"peer", env)


def row_pull_waits(shard, worker) -> bool:
    env = Envelope(
        PullRows(plan_id=2, clock=1, tensors={"emb.weight:ids": torch.tensor([0])}),
        next(REQ),
        worker,
    )
    return shard.on_pull_rows(b"peer", env) is None


def test_a_push_of_the_plan_before_a_member_left_is_applied_alone():
    """Worker 13 dies mid-round: the round closes with 11's push; 12's push of that step,
    made under the old plan, is applied alone instead of opening a round of the new plan
    that every later step would join one step out of line (both members' pulls must then
    wait for each other's push of the same step, as before)."""
    shard, plan = one_shard()
    row_push(shard, 11, 1)
    shard.adopt(replace(plan, plan_id=2, workers=plan.workers[:2], groups=[[11, 12]]))
    row_push(shard, 12, 1)
    assert not shard.sparse.rounds, shard.sparse.rounds
    for _ in range(3):
        assert not row_pull_waits(shard, 11) and not row_pull_waits(shard, 12)
        row_push(shard, 11, 2)
        assert row_pull_waits(shard, 11)  # its round waits for 12
        row_push(shard, 12, 2)
        assert not shard.sparse.rounds and not shard.rows.parked


def test_a_shard_restored_under_a_newer_plan_closes_the_checkpoints_rounds():
    """A checkpoint taken with 11's push in round (11, 12, 13); the shard restarts under a
    plan without 13: that round is applied, so nobody waits for the dead member."""
    old, plan = one_shard()
    row_push(old, 11, 1)
    state = old.state_dict()
    new, _ = one_shard((11, 12), plan_id=2)
    new.restore(state)
    assert not new.sparse.rounds and not row_pull_waits(new, 11)
    row_push(new, 12, 2)
    row_push(new, 11, 2)
    assert not new.sparse.rounds
