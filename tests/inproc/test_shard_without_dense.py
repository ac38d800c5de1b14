"""A shard the placement gave no dense tensor (a model whose dense part is one scalar, its
embeddings served sparse, on two shards): it has nothing to INIT, yet it must answer a
PULL (no values, its version), a PUSH with an empty dense part under every policy, and
checkpoint its rows; the worker's client sends it no dense traffic at all (ps-lite: a
server that holds no key of a request is not asked)."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from shard_harness import A, B

from hetps.proto.messages import Ack, Init, Params, Pull, Push
from hetps.proto.plan import TensorSpec
from hetps.proto.records import PushInfo
from hetps.runconfig.algorithms import ALGORITHMS
from hetps.worker.client import PSClient

BIAS = [TensorSpec("bias", "float32", (), "param")]  # the whole dense part: one scalar


def two_shards(harnesses, algorithm: str):
    h = harnesses(BIAS, ["cluster.request_timeout_s=10"], n_shards=2, algorithm=algorithm)
    assert h.owned(0) == ["bias"] and h.owned(1) == []
    assert h.call(A, Init(plan_id=h.plan_id, tensors={"bias": torch.zeros(())}), 0).info["first"]
    return h


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_a_shard_without_dense_tensors_answers_pulls_and_pushes(harnesses, algorithm):
    h = two_shards(harnesses, algorithm)
    empty = h.shards[1]
    reply = h.call(A, Pull(plan_id=h.plan_id, clock=0), 1)  # RequestTimeout: it was parked
    assert isinstance(reply, Params) and reply.version == 0 and dict(reply.tensors) == {}
    for node in (A, B):
        push = Push(plan_id=h.plan_id, clock=0, base_version=0, info=PushInfo.read({}), tensors={})
        assert isinstance(h.call(node, push, 1), Ack)
    reply = h.call(A, Pull(plan_id=h.plan_id, clock=-1), 1)
    assert isinstance(reply, Params) and dict(reply.tensors) == {}
    assert reply.version == empty.store.version
    assert empty.counts["pushes"] == 2 and empty.state_dict()["tensors"] == {}


def test_the_client_sends_dense_traffic_only_to_shards_that_hold_a_tensor(harnesses):
    h = two_shards(harnesses, "async")
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            for shard in h.shards:
                shard.serve_once(0.001)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    shards = [replace(s, address=a) for s, a in zip(h.plan.shards, h.addresses)]
    client = PSClient(replace(h.plan, shards=shards), A, h.cfg.cluster)
    try:
        assert set(client.pull(0)) == {"bias"}
        acks, values = client.push_pull({"bias": torch.ones(())}, 0, 1)
        assert [a.version for a in acks] == [1] and set(values) == {"bias"}
        assert [a.version for a in client.push({"bias": torch.ones(())}, 1, 1)] == [2]
    finally:
        client.close()
        stop.set()
        server.join(timeout=10)
    assert not server.is_alive()
    counts = h.shards[1].counts
    assert counts["pulls"] == 0 and counts["pushes"] == 0, counts
    assert h.shards[0].counts["pushes"] == 2
