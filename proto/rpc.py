"""Request tracking on top of a transport: a client that matches replies to
requests by id, and a server loop that dispatches each op to one handler.

A failing handler becomes an ERROR reply (INTERNAL) and the loop keeps
serving; at the caller an ERROR reply becomes `RemoteError`, which names the
peer and the op. Every wait has a deadline.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from .codec import ProtocolError, TensorCatalog, decode, encode, error_frames
from .errors import HetpsError
from .faults import WireFaults
from .messages import Error, Message, Op, Params, Status
from .transport import ServerTransport, TransportOptions, make_client

log = logging.getLogger(__name__)
TEND_EVERY_S = 0.02  # while other servers' requests are tended, the longest block on one socket


class RemoteError(HetpsError):
    """The peer answered ERROR."""

    def __init__(self, status: Status, message: str, peer: str, op: str):
        super().__init__(f"{peer} refused {op}: {status.name}: {message}")
        self.status, self.message, self.peer, self.op = status, message, peer, op


class RequestTimeout(HetpsError):
    """No reply within the deadline."""

    def __init__(self, peer: str, op: str, timeout_s: float):
        super().__init__(f"no reply from {peer} to {op} within {timeout_s:.1f}s")
        self.peer, self.op, self.timeout_s = peer, op, timeout_s


class Aborted(HetpsError):
    """A wait was abandoned because the caller's abort condition became true."""


@dataclass
class Unanswered:
    """A request kept for re-sending until its reply arrives."""

    frames: list
    resend_at: float
    interval: float
    before: list | None = None  # frames of an earlier request to re-send first (`send(after=)`)

    def own_frames(self) -> None:
        """Copy the frames before a re-send: a frame may be a view of the sender's
        live memory (a worker's gradient buffer, worker/flat_model.py), valid
        until the first reply; a re-sent copy may still be queued after it."""
        if self.before is not None:
            self.before = [f if type(f) is bytes else bytes(memoryview(f)) for f in self.before]
        self.frames = [f if type(f) is bytes else bytes(memoryview(f)) for f in self.frames]


class RpcClient:
    """Requests to one server. Not thread-safe: one per thread.

    `should_abort`, if given, is checked while waiting; when it returns True
    the wait raises `Aborted` (used to leave a parked pull when the run stops).

    With `retry_s` > 0 a request still unanswered after `retry_s` is sent
    again, with the same request id, then after 2x, 4x ... (at most 8x)
    `retry_s`, until the wait's deadline: a server that restarted, or a
    message that was lost, does not cost the whole timeout. The server must
    make a re-sent request harmless (shards answer a re-sent push with the
    first one's ACK). `faults` injects drops and delays on every send.
    `options`: how its socket is made (size bound, shared memory, emulated
    link; transport.py), also for the sockets `retarget` makes.

    A server that lost what it had is recognised two ways: the transport
    reconnected, or a PARAMS reply carries a lower version than an earlier
    one (a shard restored from an older checkpoint; one shard's replies never
    go back otherwise). Either way every unanswered request is re-sent at
    once, each after the request it depends on (`send(after=)`).
    Requests to several servers are awaited together with `wait_all`, so a
    request to one server is re-sent while the caller waits on another.
    """

    # request ids start at a random point, so a restarted process does not reuse its old ids
    # (re-drawn in every forked child: daemons forked from one warm server must not share it)
    _ids = itertools.count(secrets.randbelow(1 << 40) + 1)

    def __init__(
        self,
        address: str,
        src: int = 0,
        timeout_s: float = 60.0,
        options: TransportOptions | None = None,
        should_abort: Callable[[], bool] | None = None,
        retry_s: float = 0.0,
        faults: WireFaults | None = None,
        redirect: Callable[[], str] | None = None,
    ):
        """`redirect`, if given, is asked while waiting for the server's
        current address (a failover moved it): on a change every unanswered
        request is re-sent there at once. Raises TransportError."""
        self.address = address
        self.redirect = redirect
        self.options = options
        self._bytes_before = (0, 0)  # counted on transports left behind by `retarget`
        self.src = src
        self.timeout_s = timeout_s
        self.should_abort = should_abort
        self.retry_s = retry_s
        self.faults = faults if faults is not None and faults.active else None
        self.transport = make_client(address, options)
        self._early: dict[int, Message] = {}
        self._ops: dict[int, str] = {}
        self._unanswered: dict[int, Unanswered] = {}
        self._served_version = -1  # highest PARAMS version seen since the server last (re)started
        # a reply showed the server went back: re-send everything at once
        self._lost_state = False
        self.resent = 0

    @property
    def bytes_sent(self) -> int:
        return self._bytes_before[0] + self.transport.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self._bytes_before[1] + self.transport.bytes_received

    def retarget(self, address: str) -> None:
        """Talk to `address` from now on (a promoted backup serves what the
        old one did): every unanswered request is re-sent there, each after
        the one it depends on; the server answers those it already applied
        with their first ACK."""
        if address == self.address:
            return
        log.warning(
            "server %s replaced by %s: re-sending %d unanswered requests",
            self.address,
            address,
            len(self._unanswered),
        )
        self._bytes_before = (self.bytes_sent, self.bytes_received)
        self.transport.close()
        self.transport = make_client(address, self.options)
        self.address = address
        self._served_version = -1
        self._lost_state = True

    def _follow(self) -> None:
        if self.redirect is not None:
            self.retarget(self.redirect())

    def send(self, msg: Message, after: int | None = None) -> int:
        """Send without waiting; returns the request id to `wait` on.
        `after`: an earlier request this one depends on (a push before its
        pull), still unanswered when this one is sent: when this one is re-sent
        after a reconnect, that one is re-sent first, even if it was answered
        meanwhile (a restarted server may have lost it)."""
        req_id = next(self._ids)
        self._ops[req_id] = msg.OP.name
        frames = encode(msg, req_id, self.src)
        if self.retry_s > 0:
            earlier = self._unanswered.get(after) if after is not None else None
            self._unanswered[req_id] = Unanswered(
                frames,
                time.monotonic() + self.retry_s,
                self.retry_s,
                earlier.frames if earlier else None,
            )
        self._transmit(frames)
        return req_id

    def _transmit(self, frames: list) -> None:
        if self.faults is None or self.faults.admit():
            self.transport.send(frames)

    def _resend_due(self) -> None:
        """Re-send what waited too long; after a reconnect (the server may have
        restarted and lost what it had) re-send everything unanswered at once,
        each with the request it depends on."""
        now = time.monotonic()
        restarted = self.transport.reconnected() or self._lost_state
        self._lost_state = False
        for kept in self._unanswered.values():
            if restarted or now >= kept.resend_at:
                kept.interval = min(kept.interval * 2, self.retry_s * 8)
                kept.resend_at = now + kept.interval
                self.resent += 1
                kept.own_frames()
                if restarted and kept.before is not None:
                    self._transmit(kept.before)
                self._transmit(kept.frames)

    def wait(
        self, req_id: int, timeout_s: float | None = None, tend: Sequence["RpcClient"] = ()
    ) -> Message:
        """Block until the reply to `req_id` arrives. While waiting, the
        clients in `tend` (other servers' requests of the same step) re-send
        what is due and take in their replies (`tend()`). Raises RemoteError,
        RequestTimeout, Aborted."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        op = self._ops.get(req_id, "?")
        deadline = time.monotonic() + timeout_s
        try:
            self._await(req_id, op, timeout_s, deadline, tend)
        finally:
            self._unanswered.pop(req_id, None)
        self._ops.pop(req_id, None)  # after a timeout the caller may wait for it again
        reply = self._early.pop(req_id)
        if isinstance(reply, Error):
            status = (
                Status(reply.status) if reply.status in Status._value2member_map_ else Status.UNSET
            )
            raise RemoteError(status, reply.message, self.address, op)
        return reply

    def _await(
        self, req_id: int, op: str, timeout_s: float, deadline: float, tend: Sequence["RpcClient"]
    ) -> None:
        while req_id not in self._early:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestTimeout(self.address, op, timeout_s)
            if self.should_abort is not None and self.should_abort():
                raise Aborted(f"{op} to {self.address} abandoned")
            for other in tend:
                other.tend()
            self._follow()
            if self._unanswered:
                self._resend_due()
            self._take_reply(min(left, 0.1 if not tend else TEND_EVERY_S))

    def tend(self) -> None:
        """Without blocking: re-send what is due and keep the replies that
        have arrived (for a later `wait`)."""
        self._follow()
        if self._unanswered:
            self._resend_due()
        while self._take_reply(0.0):
            pass

    def _take_reply(self, timeout_s: float) -> bool:
        """Receive one reply (waiting at most `timeout_s`); False if none came."""
        frames = self.transport.recv(timeout_s)
        if frames is None:
            return False
        env = decode(frames)
        if isinstance(env.msg, Params):
            if env.msg.version < self._served_version:
                # restored from an older checkpoint: it may lack our requests
                self._lost_state = True
            self._served_version = env.msg.version
        if env.req_id in self._ops:
            self._early[env.req_id] = env.msg
            self._unanswered.pop(env.req_id, None)
        return True

    def call(self, msg: Message, timeout_s: float | None = None) -> Message:
        return self.wait(self.send(msg), timeout_s)

    def close(self) -> None:
        self.transport.close()


def _fresh_request_ids() -> None:
    RpcClient._ids = itertools.count(secrets.randbelow(1 << 40) + 1)


os.register_at_fork(after_in_child=_fresh_request_ids)


def wait_all(
    requests: Sequence[tuple[RpcClient, int]], timeout_s: float | None = None
) -> list[Message]:
    """The replies to requests sent to several servers, in the given order.
    Blocking: while one reply is awaited, every other client re-sends its due
    requests and takes in its replies, so a server that restarted (and lost
    a request) gets it again even while the caller waits on another server.
    Raises what `RpcClient.wait` raises, for the first failing request."""
    clients = [c for c, _ in requests]
    return [c.wait(req, timeout_s, tend=[o for o in clients if o is not c]) for c, req in requests]


class Service:
    """A server loop: decode, dispatch to `on_<op>` methods, reply.

    A handler returns the reply Message, or None to park the request and
    answer later with `reply()`. Subclasses may override `catalog()` to have
    tensors checked against what this server holds. The socket is made by the
    caller (`make_server(address, options)`); `server.options` are those
    options, for any client the service makes itself (a shard's replication).
    """

    def __init__(self, server: ServerTransport, node_id: int = 0):
        self.server = server
        self.node_id = node_id
        self.handlers: dict[Op, Callable] = {
            op: getattr(self, f"on_{op.name.lower()}")
            for op in Op
            if hasattr(self, f"on_{op.name.lower()}")
        }
        self.malformed = 0  # requests refused at decode

    def catalog(self) -> TensorCatalog | None:
        return None

    def max_tensor_bytes(self) -> int:
        return 1 << 30

    def reply(self, peer: bytes, req_id: int, msg: Message):
        """Send `msg`; returns the transport's tracker of its zero-copy frames (or None)."""
        return self.server.send(peer, encode(msg, req_id, self.node_id))

    def serve_once(self, timeout_s: float) -> bool:
        """Handle at most one request; False if none arrived within `timeout_s`."""
        got = self.server.recv(timeout_s)
        if got is None:
            return False
        peer, frames = got
        try:
            try:
                env = decode(frames, self.catalog(), self.max_tensor_bytes())
            except ProtocolError:
                raise
            except Exception as exc:  # a decoder bug must not kill the loop either
                log.exception("decoder failed on a message from %r", peer)
                raise ProtocolError(
                    Status.MALFORMED, f"undecodable: {type(exc).__name__}"
                ) from None
            handler = self.handlers.get(env.msg.OP)
            if handler is None:
                raise ProtocolError(
                    Status.UNKNOWN_OP,
                    f"{env.msg.OP.name} is not served by {type(self).__name__}",
                    env.req_id,
                )
        except ProtocolError as err:
            self.malformed += 1
            log.warning("refused request from %r: %s", peer, err)
            self.server.send(peer, error_frames(err, self.node_id))
            return True
        try:
            answer = handler(peer, env)
        except ProtocolError as err:  # a handler refusing with a status (e.g. NOT_READY)
            answer = Error(status=int(err.status), message=err.message)
        except Exception as exc:  # a bug in a handler must not kill the loop
            log.exception("%s handler failed", env.msg.OP.name)
            answer = Error(status=int(Status.INTERNAL), message=repr(exc)[:200])
        if answer is not None:
            self.reply(peer, env.req_id, answer)
        return True
