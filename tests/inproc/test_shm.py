"""Shared-memory frames (proto/shm.py, `comm.shm_bytes`): real ZeroMQ sockets and
sealed memfd segments in one process; a shard applying a push read in place."""

from __future__ import annotations

import contextlib
import gc
import os

import msgpack
import pytest
import torch
import zmq
from cluster_util import wait_for
from shard_harness import PLAN_ID, SHARD_IDS, make_plan

from hetps.proto import shm
from hetps.proto.messages import Push, Status
from hetps.proto.plan import TensorSpec
from hetps.proto.rpc import RemoteError, RpcClient
from hetps.proto.transport import TransportError, TransportOptions, make_client, make_server
from hetps.ps.shard import Shard
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ConfigError

MIN_BYTES = 64 << 10
N = 1 << 16  # floats per test tensor: 256 KiB, over MIN_BYTES


@pytest.fixture
def shm_on() -> TransportOptions:
    """Socket options passing frames of >= MIN_BYTES through shared memory."""
    return TransportOptions(shm_bytes=MIN_BYTES)


@pytest.fixture
def pair(shm_on):
    server = make_server("tcp://127.0.0.1:0", shm_on)
    client = make_client(server.address, shm_on)
    yield server, client
    client.close()
    server.close()


def frames_of(t: torch.Tensor) -> list:
    return [b"header", memoryview(t.numpy()).cast("B"), b"small"]


def received(server) -> list:
    got = server.recv(5.0)
    assert got is not None, "nothing arrived within 5 s"
    return got[1]


def test_large_frames_arrive_through_shared_memory(pair):
    server, client = pair
    sent = torch.randn(N)
    client.send(frames_of(sent))
    frames = received(server)
    assert bytes(frames[0]) == b"header" and bytes(frames[2]) == b"small"
    assert torch.equal(torch.frombuffer(frames[1], dtype=torch.float32), sent)
    assert frames[1].readonly
    assert client.shm.staged == 1 and client.shm.fallbacks == 0


def test_segment_is_not_rewritten_while_a_view_of_it_lives(pair):
    server, client = pair
    first, second = torch.full((N,), 1.0), torch.full((N,), 2.0)
    client.send(frames_of(first))
    # the frames list is gone, the view not
    held = torch.frombuffer(received(server)[1], dtype=torch.float32)
    gc.collect()
    assert [s.free() for s in client.shm.segments] == [False]
    client.send(frames_of(second))  # must take another segment
    assert len(client.shm.segments) == 2
    assert torch.equal(held, first)
    assert torch.equal(torch.frombuffer(received(server)[1], dtype=torch.float32), second)
    gc.collect()
    assert [s.free() for s in client.shm.segments] == [False, True]
    del held
    gc.collect()
    assert [s.free() for s in client.shm.segments] == [True, True]


def test_no_free_segment_falls_back_to_the_socket(pair):
    server, client = pair
    client.shm.max_segments = 1
    values = [torch.full((N,), float(i)) for i in range(3)]
    client.send(frames_of(values[0]))
    kept = received(server)  # holds the only segment
    for v in values[1:]:
        client.send(frames_of(v))
        assert torch.equal(torch.frombuffer(received(server)[1], dtype=torch.float32), v)
    assert client.shm.staged == 1 and client.shm.fallbacks == 2
    assert torch.equal(torch.frombuffer(kept[1], dtype=torch.float32), values[0])


def test_a_larger_message_replaces_a_free_segment_too_small(pair):
    server, client = pair
    client.shm.max_segments = 1
    client.send(frames_of(torch.ones(N)))
    received(server)
    gc.collect()
    big = torch.randn(4 * N)
    client.send(frames_of(big))
    assert torch.equal(torch.frombuffer(received(server)[1], dtype=torch.float32), big)
    assert len(client.shm.segments) == 1 and client.shm.segments[0].capacity >= big.numel() * 4


def forged(server, boot=shm.BOOT_ID, pid=None, fd=0, ino=0, places=None) -> list:
    """Send a hand-made descriptor with one emptied frame through a raw DEALER; what the server returns."""
    desc = shm.MARK + msgpack.packb(
        [
            boot,
            os.getpid() if pid is None else pid,
            fd,
            ino,
            [[1, 0, 4096]] if places is None else places,
        ]
    )
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    try:
        sock.send_multipart([desc, b"header", b""])
        return [bytes(f) for f in received(server)]
    finally:
        sock.close(0)


def test_forged_descriptors_are_refused(shm_on, tmp_path):
    server = make_server("tcp://127.0.0.1:0", shm_on)
    good = shm.Segment(1 << 16)
    unsealed = os.memfd_create(shm.MEMFD_NAME)
    os.ftruncate(unsealed, 1 << 16)
    with open(tmp_path / "plain", "wb") as f:
        f.write(bytes(1 << 16))
    plain = os.open(tmp_path / "plain", os.O_RDWR)
    try:
        # the descriptor dropped, the frame left empty: the codec refuses it
        refused = [b"header", b""]
        assert forged(server, fd=good.fd, ino=good.ino, boot="another-host") == refused
        assert forged(server, fd=good.fd, ino=good.ino + 1) == refused
        assert forged(server, fd=good.fd, ino=good.ino, places=[[1, 1 << 16, 4096]]) == refused
        assert forged(server, fd=good.fd, ino=good.ino, places=[[2, 0, 4096]]) == refused
        assert forged(server, fd=unsealed, ino=os.fstat(unsealed).st_ino) == refused
        assert forged(server, fd=plain, ino=os.fstat(plain).st_ino) == refused
        good.view[shm.PAGE : shm.PAGE + 4] = b"abcd"
        # the same, well formed, is taken
        assert forged(server, fd=good.fd, ino=good.ino)[1][:4] == b"abcd"
    finally:
        os.close(plain)
        os.close(unsealed)
        good.close()
        server.close()


SPECS = [TensorSpec("w", "float32", (N,)), TensorSpec("b", "float32", (8,))]


def shard_over_tcp(
    overrides: list[str],
    workers: list[int],
    algorithm: str = "async",
    options: TransportOptions | None = None,
) -> Shard:
    cfg = load_config(None, [f"algorithm.name={algorithm}", "optimizer.lr=0.5", *overrides])
    server = make_server("tcp://127.0.0.1:0", options)
    return Shard(server, SHARD_IDS[0], make_plan(SPECS, workers, 1, algorithm), cfg)


def call(shard: Shard, client: RpcClient, msg):
    req = client.send(msg)
    assert shard.serve_once(5.0)
    return client.wait(req, timeout_s=5.0)


@pytest.mark.parametrize("algorithm", ["async", "sync"])
def test_shard_applies_pushes_read_from_shared_memory(shm_on, algorithm):
    from hetps.proto.messages import Init

    workers = [10, 11]
    shard = shard_over_tcp(["optimizer.momentum=0.0"], workers, algorithm, shm_on)
    clients = {
        w: RpcClient(shard.server.address, src=w, timeout_s=5.0, options=shm_on) for w in workers
    }
    try:
        start = {"w": torch.zeros(N), "b": torch.zeros(8)}
        call(shard, clients[10], Init(plan_id=PLAN_ID, tensors=start))
        grads = {w: {"w": torch.randn(N), "b": torch.randn(8)} for w in workers}
        reqs = {
            w: clients[w].send(Push(plan_id=PLAN_ID, clock=0, base_version=0, tensors=grads[w]))
            for w in workers
        }
        for _ in workers:
            assert shard.serve_once(5.0)
        for w in workers:
            clients[w].wait(reqs[w], timeout_s=5.0)
        mean = (grads[10]["w"] + grads[11]["w"]) / 2
        want = -0.5 * (mean if algorithm == "sync" else grads[10]["w"] + grads[11]["w"])
        assert torch.allclose(shard.store.tensors["w"], want, atol=1e-6)
        # INIT and PUSH from 10, PUSH from 11: "w" of each went through shared memory
        assert [clients[w].transport.shm.staged for w in workers] == [2, 1]
    finally:
        for c in clients.values():
            c.close()
        shard.server.close()


def test_a_server_without_shared_memory_refuses_such_frames(shm_on):
    from hetps.proto.messages import Init

    shard = shard_over_tcp([], [10])  # its socket made with shared memory off
    client = RpcClient(shard.server.address, src=10, timeout_s=5.0, options=shm_on)
    try:
        with pytest.raises(RemoteError) as err:
            call(
                shard,
                client,
                Init(plan_id=PLAN_ID, tensors={"w": torch.zeros(N), "b": torch.zeros(8)}),
            )
        assert err.value.status == Status.MALFORMED
        assert shard.policy is None  # nothing of it was taken
    finally:
        client.close()
        shard.server.close()


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["comm.shm_bytes=100"], "comm.shm_bytes"),
        (["comm.shm_bytes=1048576", "security.curve=true"], "comm.shm_bytes"),
    ],
)
def test_bad_shm_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, overrides)


def test_replies_go_back_through_shared_memory_only_to_peers_that_used_it(shm_on):
    from hetps.proto.messages import Init, Params, Pull

    shard = shard_over_tcp(["optimizer.momentum=0.0"], [10, 11], options=shm_on)
    near = RpcClient(shard.server.address, src=10, timeout_s=5.0, options=shm_on)
    far = RpcClient(shard.server.address, src=11, timeout_s=5.0)  # made with shared memory off
    try:
        start = {"w": torch.randn(N), "b": torch.randn(8)}
        call(shard, near, Init(plan_id=PLAN_ID, tensors=start))
        for client in (near, far):
            reply = call(shard, client, Pull(plan_id=PLAN_ID, clock=0))
            assert isinstance(reply, Params) and torch.equal(reply.tensors["w"], start["w"])
        pools = list(shard.server.reply_pools.values())
        assert len(pools) == 1 and pools[0].staged == 1  # the pull of `near` only
        assert near.transport.shm_replies.opened and far.transport.shm is None
    finally:
        near.close()
        far.close()
        shard.server.close()


def bind_again(address: str, options: TransportOptions):
    """A server at a closed one's address (its port may take a moment to free up)."""

    def bound():
        with contextlib.suppress(TransportError):
            return make_server(address, options)

    return wait_for(bound, 60, f"{address} to bind again")


def test_segments_a_restarted_server_held_are_set_aside_then_closed(shm_on):
    """A server dies holding a message (its flag is never cleared). When the
    client connects again the busy segment leaves the pool, so the next
    message still goes through shared memory. Set-aside segments beyond
    `max_segments` are closed once they are from before the previous
    reconnect (a message in one set aside at the last reconnect may still be
    queued for the new server); one that is let go after all is closed."""
    server = make_server("tcp://127.0.0.1:0", shm_on)
    address = server.address
    client = make_client(address, shm_on)
    client.shm.max_segments = 1
    held = []
    try:
        for restart in range(3):
            client.send(frames_of(torch.full((N,), float(restart))))
            held.append(received(server))  # the dying server's views: never let go
            server.close()
            server = bind_again(address, shm_on)
            wait_for(client.reconnected, 60, "the client to connect again")
            assert client.shm.segments == []
            # set aside at reconnects 1..restart+1; beyond max_segments (1), only those before the previous go
            assert [r for r, _ in client.shm.aside] == [[1], [1, 2], [2, 3]][restart]
        # the client closed its side of the older ones: the views the server kept still read
        assert [float(torch.frombuffer(f[1], dtype=torch.float32)[0]) for f in held] == [
            0.0,
            1.0,
            2.0,
        ]
        last = torch.randn(N)
        client.send(frames_of(last))
        assert torch.equal(torch.frombuffer(received(server)[1], dtype=torch.float32), last)
        assert client.shm.staged == 4 and client.shm.fallbacks == 0
        held.clear()
        gc.collect()
        # the aside segment was let go: closed when the pool looks again
        client.send(frames_of(last))
        received(server)
        assert client.shm.aside == [] and client.shm.fallbacks == 0
    finally:
        client.close()
        server.close()
