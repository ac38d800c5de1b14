"""Delivering messages to the real services (shards, the coordinator) in
one process: a ServerTransport whose `recv` hands over the one request the
simulator is dispatching and whose `send` keeps the replies (copied, as the
bytes on a wire would be) for the simulator to deliver on its clock.

Requests and replies are the real encoded frames, decoded and dispatched by
the real `Service.serve_once`, so validation, handlers, parking and error
replies are the daemons' own.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from hetps.proto.codec import decode, encode
from hetps.proto.messages import Message
from hetps.proto.rpc import Service
from hetps.proto.transport import ServerTransport

from .events import Inbox, nbytes_of


class SimServer(ServerTransport):
    """A service's transport under the simulator. Not thread-safe."""

    def __init__(self, address: str):
        self.address = address
        self.inbox = Inbox()

    def recv(self, timeout_s: float):
        return self.inbox.pending.pop(0) if self.inbox.pending else None

    def send(self, peer: bytes, frames):
        # a copy: zero-copy frames alias the shard's live tensors, which later pushes write
        self.inbox.sent.append((peer, [bytes(memoryview(f)) for f in frames]))
        return None

    def close(self) -> None:
        self.inbox = Inbox()


def peer_of(node_id: int) -> bytes:
    return node_id.to_bytes(4, "big")


def node_of(peer: bytes) -> int:
    return int.from_bytes(peer, "big")


def request_ids() -> Iterator[int]:
    """One simulation's request ids (its own: the bytes a run moves must not depend on earlier runs)."""
    return itertools.count(1)


def request(msg: Message, src: int, ids: Iterator[int]) -> tuple[list, int]:
    """A request's frames (with the next id of `ids`) and its size in bytes."""
    frames = encode(msg, next(ids), src)
    return frames, nbytes_of(frames)


def dispatch(service: Service, src: int, frames: list) -> list[tuple[int, list, int]]:
    """Hand one request from node `src` to `service` (blocking: runs its
    handler now); returns the replies it sent meanwhile, each (node id,
    frames, bytes) - the answer to this request and any parked ones it freed."""
    server: SimServer = service.server
    server.inbox.pending.append((peer_of(src), frames))
    service.serve_once(0.0)
    sent, server.inbox.sent = server.inbox.sent, []
    return [(node_of(peer), f, nbytes_of(f)) for peer, f in sent]


def call(service: Service, src: int, ids: Iterator[int], msg: Message):
    """A request answered at once (coordinator calls: no tensors, no parking):
    the decoded reply message, or None when the handler parked it."""
    frames, _ = request(msg, src, ids)
    replies = dispatch(service, src, frames)
    mine = [f for node, f, _ in replies if node == src]
    return decode(mine[-1]).msg if mine else None
