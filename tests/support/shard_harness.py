"""Parameter-server shards driven in-process and deterministically, for the
shard-level tests (test_shard.py, test_grouping.py, test_algorithms.py).

A ShardHarness binds the Shards of one hand-built ClusterPlan on `mem://`
transports and talks to them with RpcClients, one per (worker node id, shard).
A request is `send`, then the harness runs `serve_once` on every shard until
its inbox is empty, then the client `wait`s; a reply that must NOT have come
yet (a parked pull) is checked with a short `wait` that times out.

`tiny_model` is the small torch model every tier's tests use; the `harnesses`
fixture (tests/conftest.py) makes ShardHarnesses and closes them after the test.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from hetps.proto.messages import Ack, Init, Pull, Push
from hetps.proto.plan import ClusterPlan, NodeEntry, TensorSpec, schema_hash
from hetps.proto.records import PushInfo
from hetps.proto.rpc import RequestTimeout, RpcClient
from hetps.proto.transport import make_server
from hetps.ps.shard import Shard
from hetps.runconfig.load import load_config
from hetps.scheduler.placement import place
from hetps.training.state import model_specs, model_tensors

SHARD_IDS = (21, 22)  # shard node ids
PLAN_ID = 3
A, B = 11, 12  # the node ids of a harness's workers by default


def tiny_model(
    seed: int = 0, widths: Sequence[int] = (4, 3, 2), batchnorm: bool = True
) -> nn.Module:
    """Linear layers of `widths` with ReLUs between them, initialised from torch's global
    generator seeded with `seed`. With `batchnorm`, a BatchNorm1d after each hidden Linear
    gives the model float and integer buffers, set away from their defaults (running mean
    and variance drawn, 5 batches tracked) so that "unchanged" and "mean" mean something."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for n_in, n_out in zip(widths[:-2], widths[1:-1]):
        layers += [
            nn.Linear(n_in, n_out),
            *([nn.BatchNorm1d(n_out)] if batchnorm else []),
            nn.ReLU(),
        ]
    model = nn.Sequential(*layers, nn.Linear(widths[-2], widths[-1]))
    with torch.no_grad():
        for bn in (m for m in model if isinstance(m, nn.BatchNorm1d)):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.num_batches_tracked.fill_(5)
    return model


def values_of(model: nn.Module) -> dict:
    return {n: t.detach().clone() for n, (t, _) in model_tensors(model).items()}


def grads(model: nn.Module, seed: int) -> dict:
    """A push as a worker makes it: a seeded gradient per parameter, current values per buffer."""
    g = torch.Generator().manual_seed(seed)
    return {
        n: (torch.randn(t.shape, generator=g) if kind == "param" else t.detach().clone())
        for n, (t, kind) in model_tensors(model).items()
    }


def make_plan(
    specs: list[TensorSpec],
    workers: Sequence[int],
    n_shards: int = 1,
    algorithm: str = "sync",
    plan_id: int = PLAN_ID,
    groups: Sequence[Sequence[int]] = (),
) -> ClusterPlan:
    """A plan of `workers` (node ids, in rank order) and `n_shards` shards with
    the tensors `specs` placed for equal shard speeds."""
    return ClusterPlan(
        plan_id=plan_id,
        algorithm=algorithm,
        workers=[NodeEntry(w, r) for r, w in enumerate(workers)],
        shards=[NodeEntry(SHARD_IDS[i], i, f"mem://unused-{i}") for i in range(n_shards)],
        tensors=specs,
        placement=place(specs, [1.0] * n_shards),
        schema_hash=schema_hash(specs),
        groups=[list(g) for g in groups],
        placement_id=plan_id,
    )


def not_answered(client: RpcClient, req: int, timeout_s: float = 0.05) -> bool:
    """True when the reply to `req` has not come within `timeout_s`."""
    try:
        client.wait(req, timeout_s=timeout_s)
    except RequestTimeout:
        return True
    return False


class ShardHarness:
    """Shards of one plan on mem:// transports, and one RpcClient per (worker, shard).
    `tensors`: the plan's tensor specs, or a model whose tensors they are."""

    def __init__(
        self,
        tensors: nn.Module | list[TensorSpec],
        overrides: Sequence[str] = (),
        workers: Sequence[int] = (A, B),
        n_shards: int = 1,
        algorithm: str = "sync",
        plan_id: int = PLAN_ID,
        groups: Sequence[Sequence[int]] = (),
    ):
        specs = model_specs(tensors) if isinstance(tensors, nn.Module) else tensors
        self.cfg = load_config(None, [f"algorithm.name={algorithm}", *overrides])
        self.plan = make_plan(specs, workers, n_shards, algorithm, plan_id, groups)
        self.plan_id = plan_id
        self.addresses = [f"mem://test-shard-{uuid.uuid4().hex[:12]}" for _ in range(n_shards)]
        self.shards = [
            Shard(make_server(a), SHARD_IDS[i], self.plan, self.cfg)
            for i, a in enumerate(self.addresses)
        ]
        self.clients: dict[tuple[int, int], RpcClient] = {}
        self.kinds = {s.name: s.kind for s in self.plan.tensors}

    def client(self, node: int, shard: int = 0) -> RpcClient:
        if (node, shard) not in self.clients:
            self.clients[node, shard] = RpcClient(self.addresses[shard], src=node, timeout_s=5.0)
        return self.clients[node, shard]

    def serve(self) -> int:
        """Let every shard handle everything queued for it; how many requests were handled."""
        handled = 0
        for shard in self.shards:
            while shard.serve_once(0.0):
                handled += 1
        return handled

    def call(self, node: int, msg, shard: int = 0):
        c = self.client(node, shard)
        req = c.send(msg)
        self.serve()
        return c.wait(req, timeout_s=2.0)

    def owned(self, shard: int) -> list[str]:
        return [t.name for t in self.plan.owned(shard)]

    def part(self, tensors: dict, shard: int) -> dict:
        """The entries of `tensors` that shard `shard` holds."""
        return {n: tensors[n] for n in self.owned(shard) if n in tensors}

    def init(self, values: dict, node: int | None = None) -> None:
        """Offer `values` to every shard as `node` (default: the plan's first
        worker); each must take them as the first offer."""
        node = self.plan.workers[0].node_id if node is None else node
        for i in range(len(self.shards)):
            ack = self.call(node, Init(plan_id=self.plan_id, tensors=self.part(values, i)), i)
            assert isinstance(ack, Ack) and ack.info["first"] is True

    def push(
        self,
        node: int,
        clock: int,
        tensors: dict,
        base_version: int = 0,
        info: dict | None = None,
        n_samples: int = 0,
    ) -> list[Ack]:
        """One push to every shard (its part of `tensors`); the replies in shard order."""
        return [
            self.call(
                node,
                Push(
                    plan_id=self.plan_id,
                    clock=clock,
                    base_version=base_version,
                    n_samples=n_samples,
                    info=PushInfo.read(info or {}),  # raises ProtocolError, as a worker's would
                    tensors=self.part(tensors, i),
                ),
                i,
            )
            for i in range(len(self.shards))
        ]

    def send_pull(self, node: int, clock: int) -> list[int]:
        """A pull to every shard, served but not waited for: the request ids in shard order."""
        reqs = [
            self.client(node, i).send(Pull(plan_id=self.plan_id, clock=clock))
            for i in range(len(self.shards))
        ]
        self.serve()
        return reqs

    def values(self) -> dict[str, torch.Tensor]:
        out = {}
        for s in self.shards:
            out.update({n: t.clone() for n, t in s.store.tensors.items()})
        return out

    def params(self) -> list[str]:
        return [n for n, k in self.kinds.items() if k == "param"]

    def versions(self) -> list[int]:
        return [s.store.version for s in self.shards]

    def stats(self) -> list[dict]:
        return [s.stats() for s in self.shards]

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        for s in self.shards:
            s.server.close()


def closing_factory(cls) -> Iterator:
    """The body of a fixture that yields `make(*args, **kwargs) -> cls(...)` and
    closes every harness made once the test is done:

        @pytest.fixture
        def harnesses():
            yield from closing_factory(MyHarness)
    """
    made = []

    def make(*args, **kwargs):
        made.append(cls(*args, **kwargs))
        return made[-1]

    yield make
    for h in made:
        h.close()
