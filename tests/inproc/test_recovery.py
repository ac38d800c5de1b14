"""Recovery pieces in one process: shard checkpoints (atomic files, restore
continues bit-identically, every policy's state survives a checkpoint),
re-sent requests applied once, NaN/Inf handling modes, dropped messages
recovered by retries, resume points."""

from __future__ import annotations

import dataclasses
import math
import os
import time

import pytest
import torch
from shard_harness import (
    PLAN_ID,
    A,
    B,
    ShardHarness,
    grads,
    make_plan,
    tiny_model,
    values_of,
)

from hetps.proto.codec import encode
from hetps.proto.messages import Ack, Params, Pull, Push, Status
from hetps.proto.rpc import RemoteError, RpcClient
from hetps.runconfig.algorithms import ALGORITHMS
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import CheckpointConfig
from hetps.runtime import checkpoint
from hetps.runtime.emulation import wire_faults
from hetps.training.state import model_specs, model_tensors
from hetps.worker.client import PSClient


def sync_round(h: ShardHarness, model, clock: int) -> None:
    for node in (A, B):
        h.push(node, clock, grads(model, 10 * clock + node))


# ---------------------------------------------------------------- checkpoint files


def test_checkpointer_writes_atomically_keeps_the_newest_and_knows_when(tmp_path):
    cp = checkpoint.Checkpointer(
        CheckpointConfig(every_updates=10, every_s=0, keep=2), tmp_path / "ps0"
    )
    assert cp.due(10) and not cp.due(5)  # the first one is due once 10 updates exist
    for v in (10, 20, 30):
        assert cp.due(v)
        cp.write({"version": v, "x": torch.arange(3) * v})
        assert not cp.due(v)
    assert not cp.due(35)
    assert [v for v, _ in checkpoint.checkpoints(tmp_path / "ps0")] == [20, 30]  # keep=2
    assert not [p for p in (tmp_path / "ps0").iterdir() if p.name.endswith(".tmp")]
    state = checkpoint.load(checkpoint.latest(tmp_path / "ps0"))
    assert state["version"] == 30 and torch.equal(state["x"], torch.arange(3) * 30)
    assert checkpoint.latest(tmp_path / "ps0", version=20).name == "v000000000020.pt"
    assert checkpoint.latest(tmp_path / "ps0", version=25) is None
    # a half-written temporary file from a crash is never taken for a checkpoint
    (tmp_path / "ps0" / ".v000000000040.pt.123.tmp").write_bytes(b"partial")
    assert checkpoint.latest(tmp_path / "ps0").name == "v000000000030.pt"


def test_checkpoint_by_time(tmp_path):
    cp = checkpoint.Checkpointer(CheckpointConfig(every_updates=0, every_s=0.2), tmp_path)
    assert not cp.due(1)
    time.sleep(0.25)
    assert cp.due(1)


def test_not_a_checkpoint_is_refused(tmp_path):
    path = tmp_path / "v000000000001.pt"
    torch.save({"format": 99}, path)
    with pytest.raises(ValueError, match="not a hetps shard checkpoint"):
        checkpoint.load(path)


# ---------------------------------------------------------------- restore


def restored_twin(
    h: ShardHarness, model, state: dict, overrides=(), algorithm="sync", new_workers=False
):
    twin = ShardHarness(model, overrides, algorithm=algorithm)
    twin.shards[0].restore(state, new_workers=new_workers)
    return twin


@pytest.mark.parametrize(
    "optimizer", [["optimizer.momentum=0.9"], ["optimizer.name=adam", "optimizer.lr=0.01"]]
)
def test_restored_shard_continues_exactly_like_the_original(harnesses, optimizer, tmp_path):
    model = tiny_model()
    h = harnesses(model, optimizer)
    h.init(values_of(model))
    for clock in range(3):
        sync_round(h, model, clock)
    h.push(A, 3, grads(model, 99))  # an open round: A pushed, B not yet
    path = tmp_path / "ckpt.pt"
    checkpoint.write_atomic(path, {"format": checkpoint.FORMAT, **h.shards[0].state_dict()})
    twin = restored_twin(h, model, checkpoint.load(path), optimizer)
    try:
        assert twin.versions() == h.versions() == [3]
        assert twin.shards[0].stats()["restored_version"] == 3
        for hh in (h, twin):  # B completes the open round, then one more full round
            hh.push(B, 3, grads(model, 98))
            sync_round(hh, model, 4)
        assert twin.versions() == h.versions() == [5]
        for name, t in h.values().items():
            assert torch.equal(twin.values()[name], t), name  # momentum / Adam moments restored too
    finally:
        twin.close()


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_policy_serves_workers_that_are_ahead_of_its_restored_checkpoint(
    harnesses, algorithm, tmp_path
):
    """The shard is restored from a checkpoint written rounds ago; the workers
    carry on from where they are. Their next round must close and their pulls
    must be answered (no round waits for pushes the shard lost)."""
    model = tiny_model()
    h = harnesses(model, [], algorithm=algorithm)
    h.init(values_of(model))
    path, base = tmp_path / "ckpt.pt", 0
    for clock in range(6):
        for node in (A, B):
            h.push(node, clock, grads(model, 10 * clock + node), base_version=base)
        base = h.versions()[0]
        if clock == 1:
            checkpoint.write_atomic(path, {"format": checkpoint.FORMAT, **h.shards[0].state_dict()})
    twin = restored_twin(h, model, checkpoint.load(path), algorithm=algorithm)
    try:
        restored = twin.versions()[0]
        assert 0 < restored < base
        for node in (A, B):
            twin.push(node, 6, grads(model, 60 + node), base_version=base)
        reqs = {node: twin.client(node).send(Pull(plan_id=PLAN_ID, clock=7)) for node in (A, B)}
        twin.serve()
        for node, req in reqs.items():
            assert isinstance(twin.client(node).wait(req, timeout_s=1.0), Params), (algorithm, node)
        assert twin.versions()[0] > restored
    finally:
        twin.close()


def test_restoring_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path):
    folder = tmp_path / "ps0"
    for v in (20, 30):
        checkpoint.write_atomic(
            folder / f"v{v:012d}.pt", {"format": checkpoint.FORMAT, "version": v}
        )
    moved = checkpoint.abandon_after(folder, 20)
    assert [p.name for p in moved] == ["v000000000030.pt.abandoned"]
    cp = checkpoint.Checkpointer(CheckpointConfig(every_updates=1, keep=2), folder)
    cp.last_version = 20
    for v in (21, 22):
        cp.write({"version": v})
    assert [v for v, _ in checkpoint.checkpoints(folder)] == [21, 22]  # the new timeline, not v30
    assert checkpoint.latest(folder).name == "v000000000022.pt"


def test_a_restarted_process_does_not_resume_again():
    from hetps.frontend.resume import strip_resume

    assert strip_resume(("--rank", "1", "--resume", "--restore-version", "40", "--bind", "x")) == (
        "--rank",
        "1",
        "--bind",
        "x",
    )


def test_resumed_shard_keeps_values_but_starts_worker_clocks_afresh(harnesses, tmp_path):
    model = tiny_model()
    h = harnesses(model)
    h.init(values_of(model))
    for clock in range(4):
        sync_round(h, model, clock)
    twin = restored_twin(h, model, h.shards[0].state_dict(), new_workers=True)
    try:
        assert twin.versions() == [4]
        # new workers start at clock 0: with the old clocks their pushes would count as duplicates
        sync_round(twin, model, 0)
        assert twin.versions() == [5]
    finally:
        twin.close()


# ---------------------------------------------------------------- re-sent requests


def test_a_resent_push_is_applied_once_and_answered_like_the_first(harnesses):
    model = tiny_model()
    h = harnesses(model, [], workers=(A,), algorithm="async")
    h.init(values_of(model))
    client = h.client(A)
    push = Push(plan_id=PLAN_ID, clock=0, base_version=0, tensors=grads(model, 1))
    frames = encode(push, 777, A)
    for _ in range(3):  # the same request id three times, as a retrying client sends it
        client.transport.send(frames)
    h.serve()
    replies = [client.transport.recv(1.0) for _ in range(3)]
    assert all(r is not None for r in replies)
    assert h.versions() == [1]
    assert h.stats()[0]["retried"] == 2


def test_a_resent_parked_pull_is_answered_and_not_parked_twice(harnesses):
    model = tiny_model()
    h = harnesses(model)
    h.init(values_of(model))
    client = h.client(A)
    h.push(A, 0, grads(model, 1))
    frames = encode(Pull(plan_id=PLAN_ID, clock=1), 555, A)
    client.transport.send(frames)
    client.transport.send(frames)
    h.serve()
    assert len(h.shards[0].parked) == 1
    h.push(B, 0, grads(model, 2))
    assert client.transport.recv(1.0) is not None
    assert not h.shards[0].parked


def test_retries_with_dropped_messages_complete_every_request(harnesses):
    """Half the messages vanish; the client re-sends until answered, the
    server applies each push once."""
    import threading

    model = tiny_model()
    h = harnesses(model, [], workers=(A,), algorithm="async")
    h.init(values_of(model))
    cfg = load_config(None, ["cluster.faults.drop=0.5"])
    client = RpcClient(
        h.addresses[0],
        src=A,
        timeout_s=20.0,
        retry_s=0.02,
        faults=wire_faults(cfg.cluster.faults, seed=3),
    )
    stop = threading.Event()
    server = threading.Thread(
        target=lambda: [h.shards[0].serve_once(0.01) for _ in iter(stop.is_set, True)]
    )
    server.start()
    try:
        for clock in range(20):
            ack = client.call(
                Push(plan_id=PLAN_ID, clock=clock, base_version=0, tensors=grads(model, clock))
            )
            assert isinstance(ack, Ack)
            assert isinstance(client.call(Pull(plan_id=PLAN_ID, clock=clock + 1)), Params)
    finally:
        stop.set()
        server.join(timeout=5)
        client.close()
    assert h.versions() == [20]  # every push applied exactly once
    assert client.faults.dropped > 5 and client.resent >= client.faults.dropped


def test_wire_faults_delay_and_count():
    cfg = load_config(None, ["cluster.faults.delay=1.0", "cluster.faults.delay_s=0.05"])
    faults = wire_faults(cfg.cluster.faults, seed=0)
    started = time.monotonic()
    assert faults.admit()
    assert time.monotonic() - started >= 0.05 and faults.delayed == 1 and faults.dropped == 0


def test_each_shard_connection_draws_its_own_repeatable_faults():
    """With comm.overlap each shard's requests leave from their own thread: one
    shared generator would make the drops depend on thread timing."""
    cfg = load_config(None, ["cluster.faults.drop=0.5"])
    plan = make_plan(model_specs(tiny_model()), [A], n_shards=2)
    plan = dataclasses.replace(
        plan,
        shards=[
            dataclasses.replace(s, address=f"tcp://127.0.0.1:{9 + i}")
            for i, s in enumerate(plan.shards)
        ],
    )
    draws = []
    for _ in range(2):
        client = PSClient(plan, A, cfg.cluster)
        try:
            draws.append([[f.admit() for _ in range(40)] for f in client.faults])
            assert client.fault_stats()["dropped"] == sum(not ok for d in draws[-1] for ok in d)
        finally:
            client.close()
    assert draws[0] == draws[1]  # the same node draws the same drops on each connection
    assert draws[0][0] != draws[0][1]  # and the connections draw independently


# ---------------------------------------------------------------- NaN / Inf


def nan_push(model, seed: int) -> dict:
    g = grads(model, seed)
    name = next(n for n, (_, kind) in model_tensors(model).items() if kind == "param")
    g[name] = g[name].clone()
    g[name].view(-1)[0] = math.nan
    g[name].view(-1)[1] = math.inf
    return g


def test_nonfinite_reject_refuses_and_records_nothing(harnesses):
    model = tiny_model()
    h = harnesses(model)
    h.init(values_of(model))
    with pytest.raises(RemoteError) as info:
        h.push(A, 0, nan_push(model, 1))
    assert info.value.status == Status.NONFINITE
    assert h.stats()[0]["nonfinite"] == 1 and h.stats()[0]["accepted"] == 0


def test_nonfinite_skip_takes_part_in_the_round_as_zero(harnesses):
    model = tiny_model()
    h = harnesses(model, ["cluster.nonfinite=skip", "optimizer.momentum=0"])
    h.init(values_of(model))
    before = h.values()
    h.push(A, 0, nan_push(model, 1))  # acknowledged, counted, worth a zero gradient
    gb = grads(model, 2)
    h.push(B, 0, gb)  # closes the round: the mean is gb / 2
    assert h.versions() == [1] and h.stats()[0]["nonfinite"] == 1
    lr = h.cfg.optimizer.lr
    for name in h.params():
        torch.testing.assert_close(h.values()[name], before[name] - lr * gb[name] / 2)


def test_nonfinite_clip_replaces_nan_and_inf(harnesses):
    model = tiny_model()
    h = harnesses(
        model,
        ["cluster.nonfinite=clip", "cluster.clip_value=0.5", "optimizer.momentum=0"],
        workers=(A,),
        algorithm="async",
    )
    h.init(values_of(model))
    before = h.values()
    g = nan_push(model, 1)
    h.push(A, 0, g)
    name = h.params()[0]
    expected = torch.nan_to_num(g[name], nan=0.0, posinf=0.5, neginf=-0.5)
    torch.testing.assert_close(h.values()[name], before[name] - h.cfg.optimizer.lr * expected)
    assert h.stats()[0]["nonfinite"] == 1


# ---------------------------------------------------------------- resume points


def test_resume_point_takes_the_newest_common_version(tmp_path):
    from hetps.frontend.resume import resume_point
    from hetps.runconfig.schema import ConfigError
    from hetps.scheduler import state

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(ConfigError, match="no scheduler-state.json"):
        resume_point(run_dir, 2)
    (run_dir / state.STATE_FILE).write_text('{"run_id": "abc", "finished": true}')
    root = run_dir / "checkpoints"
    for rank, versions in ((0, (10, 20, 30)), (1, (10, 20))):
        folder = checkpoint.shard_dir(root, "abc", rank)
        folder.mkdir(parents=True)
        for v in versions:
            checkpoint.write_atomic(
                folder / f"v{v:012d}.pt", {"format": checkpoint.FORMAT, "version": v}
            )
    point = resume_point(run_dir, 2)
    assert point.run_id == "abc" and point.versions == {0: 20, 1: 20} and point.consistent
    with pytest.raises(ConfigError, match="no checkpoints of ps2"):
        resume_point(run_dir, 3)
    os.remove(checkpoint.shard_dir(root, "abc", 1) / f"v{20:012d}.pt")
    os.remove(checkpoint.shard_dir(root, "abc", 1) / f"v{10:012d}.pt")
    checkpoint.write_atomic(
        checkpoint.shard_dir(root, "abc", 1) / f"v{25:012d}.pt",
        {"format": checkpoint.FORMAT, "version": 25},
    )
    point = resume_point(run_dir, 2)
    assert point.versions == {0: 30, 1: 25} and not point.consistent


def test_a_resent_request_carries_its_own_copy_of_the_sender_memory(harnesses):
    """A worker's push frame is its live gradient buffer (worker/flat_model.py);
    once a request is re-sent, a copy of it may still be queued after the
    first reply, when the next backward rewrites that buffer: so a re-send
    carries frames of its own, equal to what was first sent."""
    h = harnesses(tiny_model(), [], workers=(A,), algorithm="async")
    flat = torch.arange(6, dtype=torch.float32)  # two tensors back to back in the pack layout
    views = {"w": flat[:4].view(2, 2), "b": flat[4:]}
    client = RpcClient(h.addresses[0], src=A, timeout_s=5.0, retry_s=0.01)
    try:
        req = client.send(Push(plan_id=PLAN_ID, clock=0, base_version=0, tensors=views))
        frames = client._unanswered[req].frames
        # the live memory
        assert torch.frombuffer(frames[-1], dtype=torch.uint8).data_ptr() == flat.data_ptr()
        first = [bytes(memoryview(f)) for f in frames]
        client._unanswered[req].resend_at = 0.0  # due now: nobody answered
        client.tend()  # re-sent
        assert client.resent >= 1
        flat.fill_(7.0)  # the next backward
        kept = client._unanswered[req].frames
        assert all(type(f) is bytes for f in kept) and kept == first
    finally:
        client.close()
