"""The simulator's virtual clock and event queue, and the cost model of the
network and the shards.

Time is a float of virtual seconds from the first plan. Events at the same
time run in the order they were scheduled (a sequence number breaks ties),
so a run is a pure function of its config and seed. Nothing here sleeps or
reads the wall clock.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from hetps.runconfig.schema import NodeConfig


class EventQueue:
    """A virtual clock and the events due on it. Not thread-safe (one loop)."""

    def __init__(self):
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self.processed = 0

    def clock(self) -> float:
        """The virtual time, seconds (what the coordinator's and shards' timers read)."""
        return self.now

    def at(self, t: float, fn: Callable, *args) -> None:
        """Run `fn(*args)` at virtual time `t` (never before now)."""
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def after(self, delay_s: float, fn: Callable, *args) -> None:
        self.at(self.now + delay_s, fn, *args)

    def holds(self, fns: tuple) -> bool:
        """Whether any event still due calls one of `fns`."""
        return any(fn in fns for _, _, fn, _ in self._heap)

    def run_next(self) -> bool:
        """Advance the clock to the next event and run it; False when none is left."""
        if not self._heap:
            return False
        self.now, _, fn, args = heapq.heappop(self._heap)
        self.processed += 1
        fn(*args)
        return True


def speed_factor(node: NodeConfig, t: float) -> float:
    """The node's slowdown at virtual time `t` (its `schedule` counts from the first plan)."""
    current = node.slowdown
    for change in sorted(node.schedule, key=lambda c: c.at_s):
        if change.at_s <= t:
            current = change.slowdown
    return current


@dataclass
class Link:
    """One node's network link, each direction a queue: a message of n bytes
    holds it n / rate seconds after the messages before it (store and
    forward), and every message pays both ends' one-way latency once."""

    mbps: float = 0.0  # 0: unlimited
    latency_s: float = 0.0
    up_free: float = 0.0
    down_free: float = 0.0

    @classmethod
    def of(cls, node: NodeConfig) -> "Link":
        return cls(node.link_mbps, node.latency_ms / 1000.0)

    def serialize_s(self, nbytes: int) -> float:
        return nbytes * 8 / (self.mbps * 1e6) if self.mbps > 0 else 0.0


def transfer(src: Link, dst: Link, nbytes: int, now: float) -> float:
    """Virtual time a message of `nbytes` sent at `now` from `src` to `dst`
    has fully arrived; both links' queues move on."""
    src.up_free = max(now, src.up_free) + src.serialize_s(nbytes)
    arrived = src.up_free + src.latency_s + dst.latency_s
    dst.down_free = max(arrived, dst.down_free) + dst.serialize_s(nbytes)
    return dst.down_free


@dataclass
class ServiceQueue:
    """A shard's service: messages handled one at a time, each taking
    (message_s + bytes / bytes_per_s) x slowdown seconds to receive (a fixed
    cost per message: receive, decode, dispatch, its reply; a cost per byte:
    copy, check, add into the open round's sum), and each optimizer step the
    message made the shard take holds it (apply_s + apply_bytes /
    apply_bytes_per_s) x slowdown seconds more (`apply_bytes`: the shard's
    parameter bytes, which the step updates). `busy_s` sums both."""

    bytes_per_s: float
    message_s: float = 0.0
    apply_bytes_per_s: float = math.inf
    apply_s: float = 0.0
    apply_bytes: int = 0
    free_at: float = 0.0
    busy_s: float = 0.0

    def finish(self, arrived: float, nbytes: int, slowdown: float) -> float:
        """When a message that arrived at `arrived` has been received."""
        service = (self.message_s + nbytes / self.bytes_per_s) * slowdown
        self.busy_s += service
        self.free_at = max(arrived, self.free_at) + service
        return self.free_at

    def apply(self, now: float, steps: int, slowdown: float) -> float:
        """When `steps` optimizer steps that began at `now` are done (`now`
        itself for none): the shard is held until then."""
        service = steps * (self.apply_s + self.apply_bytes / self.apply_bytes_per_s) * slowdown
        self.busy_s += service
        self.free_at = max(now, self.free_at) + service
        return self.free_at


@dataclass
class Inbox:
    """What a Service's simulated transport holds: the one request being
    dispatched and the replies the handler sent (peer, frames as bytes)."""

    pending: list = field(default_factory=list)
    sent: list = field(default_factory=list)


def nbytes_of(frames) -> int:
    return sum(memoryview(f).nbytes for f in frames)


def finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0
