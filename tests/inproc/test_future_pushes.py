"""A push made under a plan the shard has not adopted yet waits for that
plan without blocking the shard's loop (ps/future_pushes.py): the handler
returns at once, the push is answered when the plan is adopted, and it joins
the new plan's round. A push whose plan never comes is taken under the plan
the shard has. Shards over the in-process transport."""

from __future__ import annotations

import dataclasses

import torch
from shard_harness import (
    PLAN_ID,
    SHARD_IDS,
    grads,
    not_answered,
    tiny_model,
    values_of,
)

from hetps.proto.codec import encode
from hetps.proto.messages import Ack, Push
from hetps.proto.transport import MemServer
from hetps.ps.shard import Shard
from hetps.training.state import model_specs

A, B = 11, 12


def sync_shard(harnesses):
    model = tiny_model()
    h = harnesses(model_specs(model), ["optimizer.momentum=0"], workers=[A, B])
    # as the daemon makes it: a push of a plan not adopted yet waits for that plan
    old = h.shards[0]
    shard = h.shards[0] = Shard(
        MemServer(h.addresses[0], take_over=True),
        SHARD_IDS[0],
        h.plan,
        h.cfg,
        park_future_pushes=True,
    )
    old.server.close()
    values = values_of(model)
    h.init(values)
    return h, shard, values, grads(model, seed=1)


def test_a_push_of_a_newer_plan_waits_for_it_and_joins_its_round(harnesses):
    h, shard, values, g = sync_shard(harnesses)
    client = h.client(A)
    push = Push(plan_id=PLAN_ID + 1, clock=0, base_version=0, tensors=g)
    req = client.send(push)
    # handled at once: parked, not fetched inline
    assert h.serve() == 1
    client.transport.send(encode(push, req, A))  # a re-send of the same request
    assert h.serve() == 1
    assert not_answered(client, req) and shard.store.version == 0
    assert shard.future_pushes.wanted() == PLAN_ID + 1 and len(shard.future_pushes.parked) == 1

    # B left: under the new plan A's push alone closes the sync round
    shard.adopt(dataclasses.replace(h.plan, plan_id=PLAN_ID + 1, workers=h.plan.workers[:1]))
    ack = client.wait(req, timeout_s=2.0)
    assert isinstance(ack, Ack) and ack.plan_id == PLAN_ID + 1 and ack.version == 1
    lr = h.cfg.optimizer.lr
    for name in shard.store.tensors:
        if h.kinds[name] == "param":
            torch.testing.assert_close(shard.store.tensors[name], values[name] - lr * g[name])
    assert shard.future_pushes.parked == [] and shard.stats()["pushes_awaiting_plan"] == 1


def test_a_push_whose_plan_never_comes_is_taken_under_the_plan_the_shard_has(harnesses):
    h, shard, values, g = sync_shard(harnesses)
    client = h.client(A)
    req = client.send(Push(plan_id=PLAN_ID + 1000, clock=0, base_version=0, tensors=g))
    h.serve()
    assert not_answered(client, req)
    shard.take_future_pushes()  # what the daemon does once the scheduler does not know that plan
    ack = client.wait(req, timeout_s=2.0)
    # the round waits for B
    assert isinstance(ack, Ack) and ack.plan_id == PLAN_ID and ack.version == 0
    # and closes with B's push
    assert h.push(B, 0, grads(tiny_model(), seed=2))[0].version == 1
