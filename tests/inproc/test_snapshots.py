"""Snapshot copies for pull replies: one per version, buffers recycled only
once the transport is done with them. Over inproc:// ZeroMQ hands the very
same memory to the receiver, so a received tensor that changed after a later
update would show a recycled buffer still in use."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
import time
import uuid

import torch
from shard_harness import make_plan

from hetps.proto import messages as m
from hetps.proto.plan import TensorSpec
from hetps.proto.rpc import RpcClient
from hetps.proto.transport import make_server
from hetps.ps.shard import Shard
from hetps.ps.snapshots import Snapshots as SnapshotCopies
from hetps.runconfig.load import load_config


class Tracker:
    def __init__(self, done: bool):
        self.done = done


def test_lend_aliases_and_settle_without_replies_in_flight_copies_nothing():
    live = {"w": torch.zeros(4), "n": torch.zeros(2, dtype=torch.int64)}
    snaps = SnapshotCopies()
    lent = snaps.lend(live)
    assert lent["w"].data_ptr() == live["w"].data_ptr()  # no copy per version
    assert snaps.lend(live) is lent  # every pull until the next write shares it
    snaps.track(lent, Tracker(done=True))
    snaps.track(lent, None)
    snaps.settle(live)
    live["w"] += 1
    assert snaps.moves == 0 and live["w"].data_ptr() == lent["w"].data_ptr()
    assert snaps.lend(live) is not lent  # after a write: new aliases


def test_settle_moves_the_live_tensors_away_from_replies_in_flight():
    live = {"w": torch.zeros(4), "n": torch.zeros(2, dtype=torch.int64)}
    w = live["w"]
    snaps = SnapshotCopies()
    first = snaps.lend(live)
    tracker = Tracker(done=False)
    snaps.track(first, tracker)
    snaps.settle(live)
    live["w"] += 1  # as an optimizer step would
    assert live["w"] is w and first["w"].tolist() == [0.0] * 4 and w.tolist() == [1.0] * 4
    assert snaps.moves == 1 and snaps.reused == 0
    second = snaps.lend(live)
    snaps.track(second, Tracker(done=False))
    tracker.done = True  # the first reply is out: its memory can take the live tensors next time
    old_memory = first["w"].data_ptr()
    snaps.settle(live)
    live["w"] += 1
    assert second["w"].tolist() == [1.0] * 4 and w.tolist() == [2.0] * 4
    assert w.data_ptr() == old_memory and (snaps.moves, snaps.reused) == (2, 1)


def test_aliases_never_tracked_keep_their_values_for_good():
    live = {"w": torch.zeros(3)}
    snaps = SnapshotCopies()
    kept = snaps.lend(live)  # e.g. a handler called in-process: the caller may hold it forever
    for step in range(1, 5):
        snaps.settle(live)
        live["w"] += 1
        snaps.track(snaps.lend(live), None)
        assert kept["w"].tolist() == [0.0] * 3
    assert snaps.moves == 1  # only the first settle had something in flight


@contextlib.contextmanager
def inproc_shard(specs, overrides):
    address = f"inproc://snap-{uuid.uuid4().hex[:10]}"
    cfg = load_config(None, ["algorithm.name=async", *overrides])
    shard = Shard(make_server(address), 21, make_plan(specs, workers=[7], algorithm="async"), cfg)
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            shard.serve_once(0.02)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    client = RpcClient(address, src=7, timeout_s=10.0)
    try:
        yield shard, client
    finally:
        client.close()
        stop.set()
        thread.join(timeout=5)
        shard.server.close()
        assert not thread.is_alive()


def test_zero_copy_reply_never_sees_a_later_update():
    n = 1 << 17  # 512 KiB: sent zero-copy
    specs = [TensorSpec("w", "float32", (n,)), TensorSpec("b", "float32", (3,))]
    with inproc_shard(specs, ["optimizer.momentum=0.0", "optimizer.lr=1.0"]) as (shard, client):
        client.call(m.Init(plan_id=3, tensors={"w": torch.zeros(n), "b": torch.zeros(3)}))
        held = []
        for step in range(6):
            reply = client.call(m.Pull(plan_id=3, clock=-1))
            assert reply.version == step
            held.append(reply.tensors["w"])  # a view of the shard's own memory (inproc)
            client.call(
                m.Push(
                    plan_id=3,
                    clock=step,
                    base_version=step,
                    tensors={"w": torch.full((n,), -1.0), "b": torch.zeros(3)},
                )
            )
        for version, w in enumerate(held):
            assert float(w.min()) == float(w.max()) == float(version), version
        # every reply was still held: the live tensors moved
        assert shard.store.snapshots.moves == 6
        held.clear()
        reply = None
        gc.collect()
        moves, deadline, step = shard.store.snapshots.moves, time.monotonic() + 10, 6
        while time.monotonic() < deadline and shard.store.snapshots.moves > moves - 1:
            got = client.call(m.Pull(plan_id=3, clock=-1))
            assert float(got.tensors["w"][0]) == float(step)
            del got
            gc.collect()
            time.sleep(0.01)  # pyzmq's garbage-collector thread marks the reply done
            moves = shard.store.snapshots.moves
            client.call(
                m.Push(
                    plan_id=3,
                    clock=step,
                    base_version=step,
                    tensors={"w": torch.full((n,), -1.0), "b": torch.zeros(3)},
                )
            )
            step += 1
            if shard.store.snapshots.moves == moves:
                break
        assert shard.store.snapshots.moves == moves, "a push after a finished reply still copied"


def test_plan_switch_closing_a_round_settles_first():
    n = 1 << 17
    specs = [TensorSpec("w", "float32", (n,))]
    address = f"inproc://snap-{uuid.uuid4().hex[:10]}"
    cfg = load_config(None, ["algorithm.name=sync", "optimizer.momentum=0.0", "optimizer.lr=1.0"])
    plan = make_plan(specs, workers=[7, 8], algorithm="sync")
    shard = Shard(make_server(address), 21, plan, cfg)
    client = RpcClient(address, src=7, timeout_s=10.0)
    try:
        for msg in (
            m.Init(plan_id=3, tensors={"w": torch.zeros(n)}),
            m.Push(plan_id=3, clock=0, base_version=0, tensors={"w": torch.ones(n)}),
        ):
            req = client.send(msg)
            assert shard.serve_once(5.0)
            client.wait(req)
        req = client.send(m.Pull(plan_id=3, clock=-1))
        assert shard.serve_once(5.0)
        # version 0, worker 8 has not pushed: the round is open
        held = client.wait(req).tensors["w"]
        # closes it: an update
        shard.adopt(dataclasses.replace(plan, plan_id=4, workers=plan.workers[:1]))
        assert shard.store.version == 1 and float(shard.store.tensors["w"][0]) < 0
        assert float(held.min()) == float(held.max()) == 0.0
    finally:
        client.close()
        shard.server.close()
