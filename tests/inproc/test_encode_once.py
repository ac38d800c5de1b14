"""Encode once: the tensors of a pull reply are encoded once per version and
every reply of that version sends the same frames, with its own header
(request id, ACK). In-process shards (shard_harness.py) on mem:// transports."""

from __future__ import annotations

import pytest
import torch
from shard_harness import PLAN_ID, A, B, grads, tiny_model, values_of

import hetps.ps.store as store_module
from hetps.proto.codec import decode, encode, encode_tensors
from hetps.proto.messages import Params, Push


def test_a_pre_encoded_message_is_the_same_bytes():
    tensors = {
        "w": torch.randn(300, 300),
        "b": torch.randn(5),
        "c": torch.arange(7),
        "m": torch.ones(2, 2),
    }
    msg = Params(version=4, tensors=tensors)
    direct = encode(msg, req_id=9, src=2)
    shared = encode(msg, req_id=9, src=2, encoded=encode_tensors(tensors))
    assert [bytes(f) for f in direct] == [bytes(f) for f in shared]
    got = decode(shared).msg
    for name, t in tensors.items():
        assert torch.equal(got.tensors[name], t)


@pytest.fixture
def encodings(monkeypatch):
    """Counts the store's encodings of pull replies (the real encoder runs)."""
    calls = []
    real = store_module.TensorStore._encode

    def counting(store, tensors, *args):
        calls.append({n: t.clone() for n, t in tensors.items()})  # the values as encoded
        return real(store, tensors, *args)

    monkeypatch.setattr(store_module.TensorStore, "_encode", counting)
    return calls


def fused(clock: int, tensors: dict) -> Push:
    return Push(plan_id=PLAN_ID, clock=clock, base_version=0, pull=True, tensors=tensors)


def test_the_replies_of_a_sync_round_share_one_encoding(harnesses, encodings):
    model = tiny_model()
    h = harnesses(model, ["optimizer.momentum=0.9"])
    h.init(values_of(model))
    a = h.client(A)
    req = a.send(fused(0, grads(model, 1)))
    h.serve()
    reply_b = h.call(B, fused(0, grads(model, 2)))  # closes the round: both answered at once
    reply_a = a.wait(req, timeout_s=2.0)
    assert len(encodings) == 1  # one encoding for both replies
    for reply in (reply_a, reply_b):
        assert isinstance(reply, Params) and reply.version == 1
        for name, value in h.values().items():
            assert torch.equal(reply.tensors[name], value), name
    assert reply_a.ack.version == 0 and reply_b.ack.version == 1  # each reply's own header

    # the next round writes the tensors: a new encoding, of the new values
    req = a.send(fused(1, grads(model, 3)))
    h.serve()
    reply_b = h.call(B, fused(1, grads(model, 4)))
    reply_a = a.wait(req, timeout_s=2.0)
    assert len(encodings) == 2 and reply_a.version == reply_b.version == 2
    for name, value in h.values().items():
        assert torch.equal(reply_a.tensors[name], value) and torch.equal(
            reply_b.tensors[name], value
        ), name
    assert not torch.equal(encodings[0]["0.weight"], encodings[1]["0.weight"])
