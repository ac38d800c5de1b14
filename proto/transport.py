"""Transports: move lists of frames between a server and its clients.

Two implementations behind one interface:
- ZeroMQ (`tcp://`, `ipc://`, `inproc://`): a ROUTER per server, a DEALER per
  client; frames of ZERO_COPY_BYTES and more are sent without a copy.
- in-process (`mem://NAME`): thread-safe queues, for protocol and policy
  tests in one process without sockets.

How a socket is made is given where it is made, as a `TransportOptions`
(nothing process-wide but CurveZMQ, below); a daemon builds one from its
config and node (runtime/daemon.py `transport_options`) and passes that same
object to every socket it makes:
- `max_message_bytes`: the most a peer can make a ZeroMQ socket allocate;
- `shm_bytes` (`comm.shm_bytes`): a client's frames of at least that many
  bytes go through shared memory and the server takes them in place
  (shm.py); its large replies to such a client go back the same way. For
  processes on one host; 0 (the default) is off;
- `link` (from a node's `link_mbps`): an emulated capped link (link.py)
  whose token buckets every socket given it shares; None (the default) is
  no cap and costs nothing per message.
The in-process transport ignores the shared memory and the link.

With CurveZMQ turned on for the process (`security.use_keys`, from the
config by runtime/curve_setup.py), every ZeroMQ socket made here is a curve
server (ROUTER) or client (DEALER).

`make_server(address, options)` / `make_client(address, options)` pick one by
the address scheme. Servers bound to port 0 (`tcp://HOST:0`) get a random
free port; read `server.address` for the one actually bound. Nothing here
blocks longer than the `timeout_s` it is given, except a capped link's
sleeps. Sockets are not thread-safe: one per thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from .errors import HetpsError
from .link import Link, frames_nbytes
from .messages import ZERO_COPY_BYTES
from .security import SecurityError, secure_socket
from .shm import SegmentPool, SegmentReader, ShmRefused, is_descriptor

log = logging.getLogger(__name__)


class TransportError(HetpsError):
    """Bind/connect failed or the peer is unknown."""


REPLY_SEGMENTS = 2  # a server's segments per peer for replies through shared memory
# peers a server keeps reply segments for (least recently heard closed first)
REPLY_PEERS = 256


@dataclass(frozen=True)
class TransportOptions:
    """How ZeroMQ sockets are made; the defaults are plain sockets.

    `max_message_bytes`: a socket drops a message larger than this (None: no
    bound). `shm_bytes`: frames of at least this many bytes go through shared
    memory, and a server takes such frames in (0: off; only for peers on this
    host running as the same user, shm.py). `link`: an emulated capped link
    shared by every socket given it (None: no cap). Immutable, so one object
    can be handed to every socket of a process and to any thread."""

    max_message_bytes: int | None = None
    shm_bytes: int = 0
    link: Link | None = None

    def __post_init__(self):
        if self.shm_bytes < 0:
            raise ValueError(f"shm_bytes must be >= 0, got {self.shm_bytes}")


DEFAULT_OPTIONS = TransportOptions()


class ServerTransport(ABC):
    address: str
    # made with these (a shard's own clients reuse them)
    options: TransportOptions = DEFAULT_OPTIONS

    @abstractmethod
    def recv(self, timeout_s: float) -> tuple[bytes, list] | None:
        """Next (peer id, frames), or None after `timeout_s` seconds."""

    @abstractmethod
    def send(self, peer: bytes, frames: Sequence) -> zmq.MessageTracker | None:
        """Queue frames to `peer`; never blocks. The frames must not be written
        until the returned tracker is `done` (None: the bytes were copied)."""

    @abstractmethod
    def close(self) -> None: ...


class ClientTransport(ABC):
    address: str
    bytes_sent: int = 0
    bytes_received: int = 0

    @abstractmethod
    def send(self, frames: Sequence) -> None: ...

    @abstractmethod
    def recv(self, timeout_s: float) -> list | None:
        """Next reply frames, or None after `timeout_s` seconds."""

    def reconnected(self) -> bool:
        """True if the connection was made again since the last call (the
        server restarted): what it had received may be lost."""
        return False

    @abstractmethod
    def close(self) -> None: ...


# ---------------------------------------------------------------- ZeroMQ


def _zmq_socket(kind: int, max_message_bytes: int | None) -> zmq.Socket:
    sock: zmq.Socket = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.copy_threshold = ZERO_COPY_BYTES
    if max_message_bytes:
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    try:
        secure_socket(sock, server=kind == zmq.ROUTER)  # CurveZMQ when this process turned it on
    except SecurityError:
        sock.close(0)
        raise
    return sock


def _zero_copy(frames: Sequence, track: bool) -> tuple[list, zmq.MessageTracker | None]:
    """Frames of ZERO_COPY_BYTES and more wrapped for a zero-copy send (the
    others ZeroMQ copies), and, with `track`, one tracker for all of them."""
    out, trackers = [], []
    for f in frames:
        if memoryview(f).nbytes >= ZERO_COPY_BYTES:
            f = zmq.Frame(f, copy=False, track=track)
            if track:
                trackers.append(f.tracker)
        out.append(f)
    return out, (zmq.MessageTracker(*trackers) if trackers else None)


def _send_parts(sock: zmq.Socket, parts: Sequence) -> None:
    """One multipart message: Frames as they are (zero-copy), anything else
    copied by ZeroMQ directly, which for a small part is cheaper than the
    Frame object `send_multipart(copy=False)` would make for it."""
    last = len(parts) - 1
    for i, part in enumerate(parts):
        sock.send(part, zmq.SNDMORE if i < last else 0, copy=not isinstance(part, zmq.Frame))


def _recv_frames(sock: zmq.Socket, timeout_s: float) -> list | None:
    try:  # a message already queued needs no poll (the common case under load)
        parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
    except zmq.Again:
        if not sock.poll(max(0, int(timeout_s * 1000))):
            return None
        parts = sock.recv_multipart(copy=False)
    return [f.buffer for f in parts]


class ZmqServer(ServerTransport):
    """A ROUTER socket bound to `address`; `options.max_message_bytes` bounds
    what a peer can make us allocate. Raises TransportError if it cannot bind."""

    def __init__(self, address: str, options: TransportOptions | None = None):
        self.options = options = options or DEFAULT_OPTIONS
        self.link = options.link
        self.sock = _zmq_socket(zmq.ROUTER, options.max_message_bytes)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        bind_to = (
            address[:-2] + ":*"
            if address.startswith("tcp://") and address.endswith(":0")
            else address
        )
        try:
            self.sock.bind(bind_to)
        except zmq.ZMQError as exc:
            self.sock.close(0)
            raise TransportError(f"cannot bind {address}: {exc}") from None
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.shm = SegmentReader() if options.shm_bytes else None
        # peers whose shared-memory frames were taken (so on this host, opted in): replies to them
        # go back the same way, through segments of this server's own (least recently heard first out)
        self.reply_pools: OrderedDict[bytes, SegmentPool] = OrderedDict()

    def recv(self, timeout_s: float):
        frames = _recv_frames(self.sock, timeout_s)
        if frames is None:
            return None
        if self.link is not None:
            self.link.receive(frames[1:])
        peer = bytes(frames[0])
        if len(frames) > 1 and is_descriptor(frames[1]):
            return peer, self._from_shared_memory(peer, frames[1:])
        return peer, frames[1:]

    def _from_shared_memory(self, peer: bytes, frames: list) -> list:
        """The frames a descriptor stands for; on a refusal the message without
        them (the codec then refuses it, MALFORMED, and the peer is told)."""
        try:
            if self.shm is None:
                raise ShmRefused("shared-memory frames, but comm.shm_bytes is 0 here")
            restored = self.shm.restore(frames)
        except ShmRefused as exc:
            log.warning("shared-memory frames refused: %s", exc)
            return frames[1:]
        if peer not in self.reply_pools:
            self.reply_pools[peer] = SegmentPool(self.options.shm_bytes, REPLY_SEGMENTS)
            while len(self.reply_pools) > REPLY_PEERS:
                self.reply_pools.popitem(last=False)[1].close()
        self.reply_pools.move_to_end(peer)
        return restored

    def send(self, peer: bytes, frames: Sequence) -> zmq.MessageTracker | None:
        """To a peer that sent shared-memory frames, large frames go back the
        same way, copied into a segment (no tracker: the frames are free at once)."""
        if self.link is not None:
            self.link.send(frames)
        pool = self.reply_pools.get(peer)
        staged = pool.stage(frames) if pool is not None else None
        if staged is not None:
            _send_parts(self.sock, [peer, *staged])
            return None
        parts, tracker = _zero_copy(frames, track=True)
        _send_parts(self.sock, [peer, *parts])
        return tracker

    def close(self) -> None:
        self.sock.close(0)
        if self.shm is not None:
            self.shm.close()
        for pool in self.reply_pools.values():
            pool.close()


class ZmqClient(ClientTransport):
    """A DEALER socket connected to `address`, made as `options` say. Raises
    TransportError if the address cannot be connected to."""

    def __init__(self, address: str, options: TransportOptions | None = None):
        self.address = address
        options = options or DEFAULT_OPTIONS
        self.link = options.link
        self.sock = _zmq_socket(zmq.DEALER, options.max_message_bytes)
        # before connecting: sees the first
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED)
        self.connects = 0
        self.shm = SegmentPool(options.shm_bytes) if options.shm_bytes else None
        self.shm_replies = SegmentReader(REPLY_SEGMENTS) if options.shm_bytes else None
        try:
            self.sock.connect(address)
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(f"cannot connect to {address}: {exc}") from None
        self.bytes_sent = 0
        self.bytes_received = 0

    def reconnected(self) -> bool:
        again = False
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_CONNECTED:
                self.connects += 1
                again = again or self.connects > 1
        if again and self.shm is not None:
            self.shm.set_aside()  # what the server held of our segments may never be let go
        return again

    def send(self, frames: Sequence) -> None:
        self.bytes_sent += frames_nbytes(frames)
        if self.link is not None:
            self.link.send(frames)
        staged = self.shm.stage(frames) if self.shm is not None else None
        _send_parts(self.sock, staged if staged is not None else _zero_copy(frames, track=False)[0])

    def recv(self, timeout_s: float):
        frames = _recv_frames(self.sock, timeout_s)
        if frames is not None:
            if self.link is not None:
                self.link.receive(frames)
            if frames and is_descriptor(frames[0]):
                frames = self._from_shared_memory(frames)
            self.bytes_received += frames_nbytes(frames)
        return frames

    def _from_shared_memory(self, frames: list) -> list:
        """A reply's frames from the server's segment; on a refusal without them
        (the codec then refuses the reply)."""
        try:
            if self.shm_replies is None:
                raise ShmRefused("shared-memory frames, but comm.shm_bytes is 0 here")
            return self.shm_replies.restore(frames)
        except ShmRefused as exc:
            log.warning("shared-memory reply refused: %s", exc)
            return frames[1:]

    def close(self) -> None:
        self.monitor.close(0)
        self.sock.close(0)
        if self.shm is not None:
            self.shm.close()
        if self.shm_replies is not None:
            self.shm_replies.close()


# ---------------------------------------------------------------- in-process

_MEM_SERVERS: dict[str, "MemServer"] = {}
_MEM_LOCK = threading.Lock()
_MEM_IDS = itertools.count(1)


class MemServer(ServerTransport):
    def __init__(
        self, address: str, take_over: bool = False, options: TransportOptions | None = None
    ):
        """`take_over`: replace the server bound at `address` in one step (a
        restarted process at a dead one's address, in tests); what was queued
        for the old one stays with it, as a killed process's input would.
        `options` are only kept (`self.options`): no socket, so no shared
        memory, link or size bound applies here."""
        self.address = address
        self.options = options or DEFAULT_OPTIONS
        self.inbox: queue.Queue = queue.Queue()
        self.clients: dict[bytes, "MemClient"] = {}
        with _MEM_LOCK:
            if address in _MEM_SERVERS and not take_over:
                raise TransportError(f"cannot bind {address}: address in use")
            _MEM_SERVERS[address] = self

    def recv(self, timeout_s: float):
        try:
            return self.inbox.get(timeout=max(timeout_s, 1e-6))
        except queue.Empty:
            return None

    def send(self, peer: bytes, frames: Sequence) -> None:
        client = self.clients.get(peer)
        if client is not None:  # like ROUTER: replies to unknown peers are dropped
            client.inbox.put([bytes(f) for f in frames])

    def close(self) -> None:
        with _MEM_LOCK:
            if _MEM_SERVERS.get(self.address) is self:  # not a server that took the address over
                del _MEM_SERVERS[self.address]


class MemClient(ClientTransport):
    def __init__(self, address: str):
        self.address = address
        self.peer = b"mem-%d" % next(_MEM_IDS)
        self.inbox: queue.Queue = queue.Queue()
        self.bytes_sent = 0
        self.bytes_received = 0

    def _server(self) -> MemServer:
        with _MEM_LOCK:
            server = _MEM_SERVERS.get(self.address)
        if server is None:
            raise TransportError(f"no in-process server at {self.address}")
        server.clients[self.peer] = self
        return server

    def send(self, frames: Sequence) -> None:
        copied = [bytes(f) for f in frames]
        self.bytes_sent += sum(len(f) for f in copied)
        self._server().inbox.put((self.peer, copied))

    def recv(self, timeout_s: float):
        try:
            frames = self.inbox.get(timeout=max(timeout_s, 1e-6))
        except queue.Empty:
            return None
        self.bytes_received += sum(len(f) for f in frames)
        return frames

    def close(self) -> None:
        """Nothing to release: the in-process queues go with the object."""


class ServerPoll:
    """Waits on several servers at once (one process serving several sockets
    from one thread). ZeroMQ servers are polled together; in-process ones are
    looked at every millisecond, as there is no socket to poll. Not thread-safe."""

    def __init__(self, servers: Sequence[ServerTransport]):
        self.servers = list(servers)
        self.poller = None
        socks = [s.sock for s in self.servers if isinstance(s, ZmqServer)]
        if len(socks) == len(self.servers):
            self.poller = zmq.Poller()
            for sock in socks:
                self.poller.register(sock, zmq.POLLIN)

    def wait(self, timeout_s: float) -> None:
        """Block until one server has a request queued, at most `timeout_s` seconds."""
        if self.poller is not None:
            self.poller.poll(max(0, int(timeout_s * 1000)))
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not any(self._queued(s) for s in self.servers):
            time.sleep(0.001)

    @staticmethod
    def _queued(server: ServerTransport) -> bool:
        if isinstance(server, MemServer):
            return not server.inbox.empty()
        if isinstance(server, ZmqServer):
            return bool(server.sock.poll(0))
        raise TypeError(f"ServerPoll waits on ZeroMQ and in-process servers, not {type(server)}")


def make_server(address: str, options: TransportOptions | None = None) -> ServerTransport:
    """A server bound to `address`: in-process for `mem://`, else ZeroMQ made
    as `options` say (None: DEFAULT_OPTIONS). Raises TransportError."""
    if address.startswith("mem://"):
        return MemServer(address, options=options)
    return ZmqServer(address, options)


def make_client(address: str, options: TransportOptions | None = None) -> ClientTransport:
    """A client of `address`: in-process for `mem://`, else ZeroMQ made as
    `options` say (None: DEFAULT_OPTIONS). Raises TransportError."""
    if address.startswith("mem://"):
        return MemClient(address)
    return ZmqClient(address, options)
