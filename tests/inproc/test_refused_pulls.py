"""Requests a shard refuses and that change nothing there: a PULL or PULL_ROWS with a clock
from a node that is no worker of the plan (BAD_STATE, as a PUSH from one gets; the
evaluator's clock -1 read, which no plan names, is still served), and row requests whose
ids are a 0-D tensor (SHAPE_MISMATCH: ids are 1-D). Shards on the in-process transport."""

from __future__ import annotations

import uuid

import pytest
import torch
from shard_harness import PLAN_ID, A, B, tiny_model, values_of

from hetps.proto.messages import Params, Pull, PullRows, PushRows, Rows, Status
from hetps.proto.plan import ClusterPlan, NodeEntry, TensorSpec
from hetps.proto.rpc import RemoteError, RpcClient
from hetps.proto.transport import make_server
from hetps.ps.shard import Shard
from hetps.runconfig.load import load_config

OUTSIDER = 99  # a node id the plan does not name
IDS = "emb.weight:ids"


@pytest.mark.parametrize("algorithm", ["sync", "ssp", "async"])
def test_a_pull_from_a_node_outside_the_plan_is_refused(harnesses, algorithm):
    h = harnesses(tiny_model(), algorithm=algorithm)
    h.init(values_of(tiny_model()))
    before = h.stats()[0]
    with pytest.raises(RemoteError) as err:
        h.call(OUTSIDER, Pull(plan_id=PLAN_ID, clock=0))
    assert err.value.status == Status.BAD_STATE
    after = h.stats()[0]
    assert (after["parked"], after["pulls"]) == (before["parked"], before["pulls"]) == (0, 0)
    # the evaluator's read (clock -1) and a worker's pull are served
    assert isinstance(h.call(OUTSIDER, Pull(plan_id=PLAN_ID, clock=-1)), Params)
    assert isinstance(h.call(A, Pull(plan_id=PLAN_ID, clock=0)), Params)


class RowShard:
    """One shard of a 10 x 2 table (async: nothing parks) for workers A and B."""

    def __init__(self):
        cfg = load_config(
            None, ["algorithm.name=async", "sparse.tables=[emb]", "sparse.optimizer.name=sgd"]
        )
        address = f"mem://rows-{uuid.uuid4().hex}"
        plan = ClusterPlan(
            plan_id=PLAN_ID,
            algorithm="async",
            workers=[NodeEntry(A, 0), NodeEntry(B, 1)],
            shards=[NodeEntry(21, 0, address)],
            tensors=[],
            placement={},
            tables=[TensorSpec("emb.weight", "float32", (10, 2), "table")],
            groups=[[A], [B]],
        )
        self.shard = Shard(make_server(address), 21, plan, cfg)
        self.clients = {n: RpcClient(address, src=n, timeout_s=5.0) for n in (A, OUTSIDER)}

    def call(self, node: int, msg):
        client = self.clients[node]
        req = client.send(msg)
        while self.shard.serve_once(0.0):
            pass
        return client.wait(req, timeout_s=2.0)

    def table(self) -> torch.Tensor:
        return self.call(A, PullRows(plan_id=PLAN_ID, tensors={IDS: torch.arange(10)}))

    def close(self):
        for c in self.clients.values():
            c.close()
        self.shard.server.close()


@pytest.fixture
def row_shard():
    shard = RowShard()
    yield shard
    shard.close()


def test_a_row_pull_from_a_node_outside_the_plan_is_refused(row_shard):
    pull = PullRows(plan_id=PLAN_ID, clock=0, tensors={IDS: torch.tensor([0, 3])})
    with pytest.raises(RemoteError) as err:
        row_shard.call(OUTSIDER, pull)
    assert err.value.status == Status.BAD_STATE
    assert row_shard.shard.counts["row_pulls"] == 0 and not row_shard.shard.rows.parked
    # the evaluator's read (clock -1) and a worker's pull are served
    assert isinstance(
        row_shard.call(OUTSIDER, PullRows(plan_id=PLAN_ID, tensors=pull.tensors)), Rows
    )
    assert isinstance(row_shard.call(A, pull), Rows)


@pytest.mark.parametrize("push", [False, True])
def test_0d_ids_are_a_shape_mismatch_and_change_nothing(row_shard, push):
    before = row_shard.table().tensors["emb.weight:rows"].clone()
    ids = torch.tensor(4)  # 0-D: one id, but not a 1-D list of ids
    msg = (
        PushRows(plan_id=PLAN_ID, clock=0, tensors={IDS: ids, "emb.weight:rows": torch.ones(1, 2)})
        if push
        else PullRows(plan_id=PLAN_ID, clock=0, tensors={IDS: ids})
    )
    with pytest.raises(RemoteError) as err:
        row_shard.call(A, msg)
    assert err.value.status == Status.SHAPE_MISMATCH
    assert row_shard.shard.sparse.updates == 0 and row_shard.shard.counts["row_pushes"] == 0
    assert torch.equal(row_shard.table().tensors["emb.weight:rows"], before)
