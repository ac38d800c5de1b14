"""A push that asks for the next values itself (`Push.pull`, `comm.fuse_pull`):
its PARAMS reply is what a PULL with clock + 1 right behind the push would get,
parked alike, and carries the push's ACK. In-process shards (shard_harness.py)
and, for the worker's client, shards served on a thread over inproc://."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from shard_harness import (
    PLAN_ID,
    A,
    B,
    grads,
    not_answered,
    tiny_model,
    values_of,
)

from hetps.proto.codec import decode, encode
from hetps.proto.messages import Ack, Params, Pull, Push
from hetps.proto.plan import ClusterPlan, NodeEntry
from hetps.proto.transport import make_server
from hetps.ps.shard import Shard
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ClusterConfig
from hetps.training.state import model_specs
from hetps.worker.client import PSClient


def fused(clock: int, tensors: dict, base_version: int = 0) -> Push:
    return Push(plan_id=PLAN_ID, clock=clock, base_version=base_version, pull=True, tensors=tensors)


def test_sync_fused_push_waits_for_the_round_and_carries_its_ack(harnesses):
    model = tiny_model()
    h = harnesses(model, ["optimizer.momentum=0.9"])
    h.init(values_of(model))
    a = h.client(A)
    req = a.send(fused(0, grads(model, 1)))
    h.serve()
    assert not_answered(a, req)  # parked: the round is open
    assert h.stats()[0]["parked"] == 1 and h.versions() == [0]
    reply_b = h.call(B, fused(0, grads(model, 2)))  # closes the round: both are answered
    reply_a = a.wait(req, timeout_s=2.0)
    for reply in (reply_a, reply_b):
        assert isinstance(reply, Params) and reply.version == 1
        torch.testing.assert_close(
            reply.tensors["0.weight"], h.values()["0.weight"], rtol=0, atol=0
        )
    assert reply_a.ack.version == 0 and reply_b.ack.version == 1  # each push's own ACK
    assert reply_a.ack.plan_id == PLAN_ID and reply_a.ack.staleness == 0
    assert reply_a.ack.held_s >= 0.04 and reply_b.ack.held_s < reply_a.ack.held_s


@pytest.mark.parametrize("algorithm", ["sync", "async", "ssp", "eager", "cpsgd"])
def test_fused_and_separate_push_pull_give_the_same_values(harnesses, algorithm):
    """The same pushes, fused or followed by a PULL: the same replies and tensors."""
    model = tiny_model()
    runs = []
    for fuse in (True, False):
        h = harnesses(model, ["optimizer.momentum=0.9"], algorithm=algorithm)
        h.init(values_of(model))
        replies = []
        for clock in range(3):
            reqs = []
            for node in (A, B):
                c = h.client(node)
                push = Push(
                    plan_id=PLAN_ID,
                    clock=clock,
                    base_version=clock,
                    pull=fuse,
                    tensors=grads(model, 10 * clock + node),
                )
                reqs.append((c, c.send(push)))
                if not fuse:
                    reqs.append((c, c.send(Pull(plan_id=PLAN_ID, clock=clock + 1))))
                h.serve()
            for c, req in reqs:
                replies.append(c.wait(req, timeout_s=2.0))
        runs.append(([r for r in replies if isinstance(r, Params)], h.values(), h.versions()))
    (fused_params, fused_values, fused_versions), (params, values, versions) = runs
    assert fused_versions == versions and len(fused_params) == len(params) == 6
    assert [r.version for r in fused_params] == [r.version for r in params]
    for got, want in zip(fused_params, params):
        for name in want.tensors:
            assert torch.equal(got.tensors[name], want.tensors[name]), name
    for name in values:
        assert torch.equal(fused_values[name], values[name]), name


def test_a_resent_fused_push_is_applied_once_and_answered_with_values(harnesses):
    model = tiny_model()
    h = harnesses(model, [], workers=(A,), algorithm="async")
    h.init(values_of(model))
    client = h.client(A)
    frames = encode(fused(0, grads(model, 1)), 778, A)
    for _ in range(3):  # the same request id three times, as a retrying client sends it
        client.transport.send(frames)
    h.serve()
    replies = [client.transport.recv(1.0) for _ in range(3)]
    assert all(r is not None for r in replies)
    assert h.versions() == [1] and h.stats()[0]["retried"] == 2


def test_a_resent_parked_fused_push_is_answered_once_and_keeps_its_wait(harnesses):
    """A worker re-sends a push still parked for its round (cluster.retry_s): one
    reply, and `held_s` counts from the first arrival, so the worker's push time
    (its measured speed) does not grow with the wait."""
    model = tiny_model()
    h = harnesses(model, [])
    h.init(values_of(model))
    a = h.client(A)
    frames = encode(fused(0, grads(model, 1)), 779, A)
    a.transport.send(frames)
    h.serve()
    time.sleep(0.2)
    a.transport.send(frames)  # the retry, same request id
    h.serve()
    assert h.stats()[0]["parked"] == 1 and h.versions() == [0]
    h.call(B, fused(0, grads(model, 2)))
    first = a.transport.recv(1.0)
    assert first is not None and a.transport.recv(0.1) is None  # answered once
    reply = decode(first).msg
    assert isinstance(reply, Params) and reply.version == 1
    assert reply.ack.held_s >= 0.2 and reply.ack.version == 0


def test_a_refused_fused_push_gets_an_error_and_no_values(harnesses):
    model = tiny_model()
    h = harnesses(model, [], workers=(A,), algorithm="async")
    h.init(values_of(model))
    bad = grads(model, 1)
    bad["0.weight"][0, 0] = float("nan")
    with pytest.raises(Exception, match="NaN"):
        h.call(A, fused(0, bad))
    assert h.versions() == [0] and h.stats()[0]["parked"] == 0


# ---------------------------------------------------------------- the worker's client


def serve_forever(shard: Shard, stop: threading.Event) -> None:
    while not stop.is_set():
        shard.serve_once(0.01)


@pytest.mark.parametrize("algorithm", ["sync", "async"])
def test_client_fused_and_separate_push_pull_agree(algorithm):
    model = tiny_model()
    specs = model_specs(model)
    results = []
    for fuse in (True, False):
        server = make_server("inproc://fused-" + ("on" if fuse else "off") + algorithm)
        plan = ClusterPlan(
            plan_id=1,
            algorithm=algorithm,
            workers=[NodeEntry(A, 0)],
            shards=[NodeEntry(21, 0, server.address)],
            tensors=specs,
            placement={s.name: 0 for s in specs},
        )
        shard = Shard(server, 21, plan, load_config(None, [f"algorithm.name={algorithm}"]))
        stop = threading.Event()
        thread = threading.Thread(target=serve_forever, args=(shard, stop), daemon=True)
        thread.start()
        client = PSClient(plan, A, ClusterConfig(request_timeout_s=10.0), fuse_pull=fuse)
        try:
            client.init(values_of(model))
            seen = []
            for clock in range(4):
                acks, values = client.push_pull(grads(model, clock), clock, 8)
                assert all(isinstance(a, Ack) for a in acks) and acks[0].version == clock + 1
                seen.append({n: t.clone() for n, t in values.items()})
            assert client.versions == [4] and client.last_push_s >= 0.0
            results.append(seen)
        finally:
            client.close()
            stop.set()
            thread.join(timeout=5)
            server.close()
    for fused_step, separate_step in zip(*results):
        for name in separate_step:
            assert torch.equal(fused_step[name], separate_step[name]), name
