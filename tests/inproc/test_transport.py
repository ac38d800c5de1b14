"""Transports and the RPC layer: in-process queues and ZeroMQ (tcp, ipc, inproc)."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import uuid

import pytest
import torch
import zmq

from hetps.proto import messages as m
from hetps.proto.codec import ProtocolError, decode, encode
from hetps.proto.link import Link
from hetps.proto.messages import PROTOCOL_VERSION, Status
from hetps.proto.rpc import Aborted, RemoteError, RequestTimeout, RpcClient, Service
from hetps.proto.transport import (
    MemClient,
    MemServer,
    TransportError,
    TransportOptions,
    ZmqServer,
    make_client,
    make_server,
)

TRANSPORTS = ["mem", "tcp", "ipc", "inproc"]
ZMQ_TRANSPORTS = ["tcp", "ipc", "inproc"]
JOIN_S = 5.0


def bind_address(kind: str, tmp_path) -> str:
    name = uuid.uuid4().hex[:12]
    if kind == "mem":
        return f"mem://test-{name}"
    if kind == "tcp":
        return "tcp://127.0.0.1:0"
    if kind == "ipc":
        path = tmp_path / "s.ipc"
        assert len(str(path)) < 100, "ipc path too long for a unix socket"
        return f"ipc://{path}"
    if kind == "inproc":
        return f"inproc://test-{name}"
    raise ValueError(kind)


class EchoService(Service):
    """PULL -> Params(value); PUSH -> Params echoing the pushed tensors;
    BARRIER parks until `count` arrived, then answers them newest first."""

    def __init__(self, server, node_id: int = 99):
        super().__init__(server, node_id)
        self.value = torch.arange(1000, dtype=torch.float32)
        self.parked: list = []
        self.sent: list = []  # (req_id, op name) in the order replies left
        self.served = 0

    def reply(self, peer, req_id, msg):
        self.sent.append((req_id, msg.OP.name))
        super().reply(peer, req_id, msg)

    def on_pull(self, peer, env):
        self.served += 1
        return m.Params(version=env.msg.clock, tensors={"value": self.value})

    def on_push(self, peer, env):
        self.served += 1
        # received tensors are read-only views of the frames: copy before keeping them
        return m.Params(
            version=env.msg.clock, tensors={k: v.clone() for k, v in env.msg.tensors.items()}
        )

    def on_barrier(self, peer, env):
        self.parked.append((peer, env.req_id))
        if len(self.parked) >= env.msg.count:
            for p, rid in reversed(self.parked):
                self.reply(p, rid, m.Ack(info={"barrier": env.msg.name}))
            self.parked.clear()
        return None

    def on_stop(self, peer, env):
        raise RuntimeError("handler bug")

    def on_init(self, peer, env):
        raise ProtocolError(Status.NOT_READY, "not yet", env.req_id)


@contextlib.contextmanager
def serving(address: str, service_cls=EchoService, max_message_bytes: int | None = None):
    server = make_server(address, TransportOptions(max_message_bytes=max_message_bytes))
    service = service_cls(server)
    stop = threading.Event()
    errors: list = []

    def loop():
        try:
            while not stop.is_set():
                service.serve_once(0.02)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    thread = threading.Thread(target=loop, name=f"serve {address}", daemon=True)
    thread.start()
    try:
        yield service
    finally:
        stop.set()
        thread.join(JOIN_S)
        alive = thread.is_alive()
        if not alive:
            server.close()
    assert not alive, "service thread did not stop"
    assert not errors, f"service loop died: {errors!r}"


@contextlib.contextmanager
def client(address: str, **kw):
    c = RpcClient(address, src=7, timeout_s=kw.pop("timeout_s", 5.0), **kw)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(params=TRANSPORTS)
def address(request, tmp_path):
    return bind_address(request.param, tmp_path)


@pytest.fixture(params=ZMQ_TRANSPORTS)
def zmq_address(request, tmp_path):
    return bind_address(request.param, tmp_path)


def test_tcp_port_zero_gets_a_real_port():
    with serving("tcp://127.0.0.1:0") as svc:
        addr = svc.server.address
        assert addr.startswith("tcp://127.0.0.1:")
        assert int(addr.rsplit(":", 1)[1]) > 0


def test_request_reply_and_parked_out_of_order(address):
    with serving(address) as svc, client(svc.server.address) as c:
        reply = c.call(m.Pull(plan_id=1, clock=3))
        assert isinstance(reply, m.Params)
        assert reply.version == 3
        assert torch.equal(reply.tensors["value"], svc.value)

        pushed = {"g": torch.randn(4, 5), "i": torch.arange(3), "b": torch.tensor([True, False])}
        echo = c.call(m.Push(plan_id=1, clock=4, base_version=0, tensors=pushed))
        assert echo.version == 4
        for k, t in pushed.items():
            assert echo.tensors[k].dtype == t.dtype and torch.equal(echo.tensors[k], t)

        first = c.send(m.Barrier(name="b", count=2))
        with pytest.raises(RequestTimeout):
            c.wait(first, timeout_s=0.15)  # parked: no reply yet
        later = c.send(m.Pull(plan_id=1, clock=5))  # answered while the barrier is parked
        assert c.wait(later, timeout_s=5.0).version == 5
        second = c.send(m.Barrier(name="b", count=2))  # releases both, newest first
        assert c.wait(first, timeout_s=5.0) == m.Ack(info={"barrier": "b"})
        assert c.wait(second, timeout_s=5.0) == m.Ack(info={"barrier": "b"})
        assert svc.sent[-3:] == [(later, "PARAMS"), (second, "ACK"), (first, "ACK")]
        assert svc.malformed == 0


def test_parked_reply_after_later_request_ids(address):
    with serving(address) as svc, client(svc.server.address) as c:
        parked = c.send(m.Barrier(name="x", count=2))
        pull_id = c.send(m.Pull(plan_id=0))
        assert c.wait(pull_id).version == -1
        release = c.send(m.Barrier(name="x", count=2))
        assert c.wait(parked).OP is m.Op.ACK
        assert c.wait(release).OP is m.Op.ACK
        ids = [rid for rid, _ in svc.sent]
        assert ids.index(pull_id) < ids.index(parked)
        assert ids.index(release) < ids.index(parked)  # out-of-order replies matched by id


def test_handler_exception_is_internal_and_service_survives(address):
    with serving(address) as svc, client(svc.server.address) as c:
        with pytest.raises(RemoteError) as ei:
            c.call(m.Stop(reason="boom"))
        assert ei.value.status == Status.INTERNAL
        assert ei.value.op == "STOP"
        assert ei.value.peer == svc.server.address
        assert "handler bug" in ei.value.message
        assert c.call(m.Pull(plan_id=1, clock=1)).version == 1
        with pytest.raises(RemoteError) as ei:
            c.call(m.Init(plan_id=1, tensors={"a": torch.zeros(2)}))
        assert ei.value.status == Status.NOT_READY
        assert c.call(m.Pull(plan_id=1, clock=2)).version == 2


def test_unhandled_op_is_unknown_op(address):
    with serving(address) as svc, client(svc.server.address) as c:
        with pytest.raises(RemoteError) as ei:
            c.call(m.Heartbeat(node_id=1))
        assert ei.value.status == Status.UNKNOWN_OP
        assert ei.value.op == "HEARTBEAT"
        assert svc.malformed == 1
        assert c.call(m.Pull(plan_id=1, clock=9)).version == 9


def test_garbage_on_zmq_dealer_gets_malformed(zmq_address):
    with serving(zmq_address) as svc:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(svc.server.address)
            sock.send_multipart([b"\xc1 this is not msgpack \xff"])
            assert sock.poll(5000), "no reply to garbage"
            env = decode(sock.recv_multipart())
            assert isinstance(env.msg, m.Error)
            assert env.msg.status == Status.MALFORMED
            assert env.src == svc.node_id

            # a readable header with a bad version: the request id is echoed
            bad = encode(m.Pull(plan_id=1), req_id=4242)
            bad[0] = bad[0].replace(b"\xa1v" + bytes([PROTOCOL_VERSION]), b"\xa1v\x07")
            sock.send_multipart(bad)
            assert sock.poll(5000)
            env = decode(sock.recv_multipart())
            assert env.msg.status == Status.BAD_VERSION
            assert env.req_id == 4242

            # the same socket is still served
            sock.send_multipart(encode(m.Pull(plan_id=1, clock=11), req_id=5))
            assert sock.poll(5000)
            env = decode(sock.recv_multipart())
            assert env.req_id == 5 and env.msg.version == 11
        finally:
            sock.close(0)
        assert svc.malformed == 2
        with client(svc.server.address) as c:
            assert c.call(m.Pull(plan_id=1, clock=12)).version == 12


def test_garbage_on_mem_transport_gets_malformed(tmp_path):
    with serving(bind_address("mem", tmp_path)) as svc:
        raw = make_client(svc.server.address)
        try:
            raw.send([b"garbage", b"more garbage"])
            frames = raw.recv(5.0)
            assert frames is not None
            assert decode(frames).msg.status == Status.MALFORMED
        finally:
            raw.close()
        with client(svc.server.address) as c:
            assert c.call(m.Pull(plan_id=1, clock=2)).version == 2


def test_wait_times_out_naming_the_address(address):
    with serving(address) as svc, client(svc.server.address) as c:
        req = c.send(m.Barrier(name="never", count=99))
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout) as ei:
            c.wait(req, timeout_s=0.3)
        elapsed = time.monotonic() - t0
        assert 0.25 <= elapsed < 5.0
        assert svc.server.address in str(ei.value)
        assert ei.value.peer == svc.server.address
        assert ei.value.op == "BARRIER"
        # default timeout comes from the client
        c.timeout_s = 0.2
        with pytest.raises(RequestTimeout):
            c.call(m.Barrier(name="never", count=99))


def test_wait_with_nobody_serving(tmp_path):
    address = bind_address("tcp", tmp_path)
    server = make_server(address)
    try:
        with client(server.address) as c:
            t0 = time.monotonic()
            with pytest.raises(RequestTimeout) as ei:
                c.call(m.Pull(plan_id=1), timeout_s=0.3)
            assert time.monotonic() - t0 < 5.0
            assert server.address in str(ei.value)
    finally:
        server.close()


def test_wait_aborted(address):
    calls = itertools.count()
    with (
        serving(address) as svc,
        client(svc.server.address, should_abort=lambda: next(calls) >= 2) as c,
    ):
        req = c.send(m.Barrier(name="never", count=99))
        t0 = time.monotonic()
        with pytest.raises(Aborted):
            c.wait(req, timeout_s=10.0)
        assert time.monotonic() - t0 < 5.0


def test_byte_counters(address):
    t = torch.randn(256, 256)  # 256 KiB: goes zero-copy on ZeroMQ
    nbytes = t.numel() * t.element_size()
    with serving(address) as svc, client(svc.server.address) as c:
        assert c.bytes_sent == 0 and c.bytes_received == 0
        echo = c.call(m.Push(plan_id=1, clock=1, base_version=0, tensors={"t": t}))
        assert torch.equal(echo.tensors["t"], t)
        assert c.bytes_sent >= nbytes
        assert c.bytes_received >= nbytes
        sent, received = c.bytes_sent, c.bytes_received
        c.call(m.Pull(plan_id=1))
        assert c.bytes_sent > sent
        assert c.bytes_received >= received + svc.value.numel() * 4


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
def test_max_message_bytes_drops_oversized(kind, tmp_path):
    with serving(bind_address(kind, tmp_path), max_message_bytes=1000) as svc:
        with client(svc.server.address) as offender:
            big = torch.zeros(500)  # 2000 bytes > 1000
            t0 = time.monotonic()
            with pytest.raises(RequestTimeout):
                offender.call(
                    m.Push(plan_id=1, clock=0, base_version=0, tensors={"g": big}), timeout_s=0.3
                )
            assert time.monotonic() - t0 < 5.0
        assert svc.served == 0 and svc.malformed == 0  # dropped whole, never half-delivered
        with client(svc.server.address) as fresh:
            reply = fresh.call(
                m.Push(plan_id=1, clock=3, base_version=0, tensors={"g": torch.ones(10)}),
                timeout_s=5.0,
            )
            assert reply.version == 3
            assert fresh.call(m.Pull(plan_id=1, clock=4), timeout_s=5.0).version == 4
        assert svc.served == 2


def test_mem_transport_errors(tmp_path):
    address = bind_address("mem", tmp_path)
    c = MemClient(address)
    with pytest.raises(TransportError):
        c.send([b"x"])
    server = MemServer(address)
    try:
        with pytest.raises(TransportError):
            MemServer(address)
        assert server.recv(0.01) is None
        c.send([b"hello"])
        peer, frames = server.recv(1.0)
        assert frames == [b"hello"]
        server.send(peer, [b"reply"])
        server.send(b"nobody", [b"dropped"])  # unknown peers are dropped, like ROUTER
        assert c.recv(1.0) == [b"reply"]
        assert c.recv(0.01) is None
    finally:
        server.close()
        c.close()
    MemServer(address).close()  # the name is free again after close


def test_zmq_bind_conflict_is_transport_error():
    first = ZmqServer("tcp://127.0.0.1:0")
    try:
        with pytest.raises(TransportError):
            ZmqServer(first.address)
    finally:
        first.close()


def test_link_cap_paces_every_socket_given_it_and_no_other():
    """One Link (8 Mbit/s = 1 MB/s each way) shared by two clients: their
    sends queue on the same bucket; a socket made without it is not paced;
    the server's replies pass its own options' link (none here)."""
    server = make_server("tcp://127.0.0.1:0")
    capped = TransportOptions(link=Link(8.0))
    clients = [make_client(server.address, capped) for _ in range(2)]
    plain = make_client(server.address)
    body = bytes(100_000)  # 0.1 s on the capped link
    try:
        t0 = time.monotonic()
        plain.send([body])
        assert time.monotonic() - t0 < 0.08  # no cap: no sleep
        t0 = time.monotonic()
        for c in clients:
            c.send([body])
        assert time.monotonic() - t0 >= 0.19  # the two sends shared one bucket
        for _ in range(3):
            assert server.recv(5.0) is not None
        assert server.recv(0.01) is None
    finally:
        for c in [*clients, plain]:
            c.close()
        server.close()
    assert Link.capped(0) is None and TransportOptions().link is None


def test_options_reach_the_socket_and_the_server_keeps_them(tmp_path):
    options = TransportOptions(max_message_bytes=4096, shm_bytes=0)
    server = make_server(bind_address("ipc", tmp_path), options)
    mem = make_server(bind_address("mem", tmp_path), options)
    try:
        assert server.options is options and mem.options is options
        assert server.sock.getsockopt(zmq.MAXMSGSIZE) == 4096 and server.shm is None
        c = RpcClient(server.address, options=options)
        try:
            assert c.transport.sock.getsockopt(zmq.MAXMSGSIZE) == 4096 and c.transport.shm is None
            c.retarget(server.address + "-moved")  # a failover: the new socket is made the same way
            assert c.transport.sock.getsockopt(zmq.MAXMSGSIZE) == 4096
        finally:
            c.close()
    finally:
        server.close()
        mem.close()
    plain = make_server("tcp://127.0.0.1:0")
    plain.close()
    assert plain.options == TransportOptions() and plain.shm is None  # defaults: plain sockets
    with pytest.raises(ValueError):
        TransportOptions(shm_bytes=-1)


def test_zmq_recv_timeout_returns_none(zmq_address):
    server = make_server(zmq_address)
    c = make_client(server.address)
    try:
        t0 = time.monotonic()
        assert server.recv(0.05) is None
        assert c.recv(0.05) is None
        assert time.monotonic() - t0 < 1.0
    finally:
        c.close()
        server.close()
