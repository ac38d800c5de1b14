"""An emulated network link: a token bucket per direction that ZeroMQ
sockets pass their messages through, to emulate a slow network on one
machine (a node's `link_mbps`).

A daemon makes one `Link` for its process and gives it to every socket it
makes (`TransportOptions.link`, transport.py), so all of the process's
traffic shares the same capacity each way, as it would share one network
interface. No link (None) costs nothing per message.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence


def frames_nbytes(frames: Sequence) -> int:
    """Total bytes of a message's frames (anything memoryview takes)."""
    return sum(memoryview(f).nbytes for f in frames)


class LinkCap:
    """One direction of a link of `bytes_per_s`: a message of n bytes
    occupies it for n / rate seconds after the previous one, and the caller
    sleeps until it has passed. Thread-safe."""

    def __init__(self, bytes_per_s: float):
        if bytes_per_s <= 0:
            raise ValueError(f"a link cap needs a positive rate, got {bytes_per_s}")
        self.rate = bytes_per_s
        self.free_at = time.monotonic()
        self.lock = threading.Lock()

    def carry(self, nbytes: int) -> None:
        """Block until the link has carried `nbytes` more bytes."""
        with self.lock:
            now = time.monotonic()
            self.free_at = max(now, self.free_at) + nbytes / self.rate
            wait = self.free_at - now
        if wait > 0:
            time.sleep(wait)


class Link:
    """A capped link, `mbit_per_s` megabits/s in each direction: `out` for
    what this process sends, `inn` for what it receives. Shared by every
    socket given it, from any thread (each direction is thread-safe)."""

    def __init__(self, mbit_per_s: float):
        self.mbit_per_s = mbit_per_s
        self.out = LinkCap(mbit_per_s * 1e6 / 8)
        self.inn = LinkCap(mbit_per_s * 1e6 / 8)

    @classmethod
    def capped(cls, mbit_per_s: float) -> Link | None:
        """A link of `mbit_per_s` megabits/s each way, or None for 0 (no cap)."""
        return cls(mbit_per_s) if mbit_per_s > 0 else None

    def send(self, frames: Sequence) -> None:
        """Block while the outgoing direction carries `frames`."""
        self.out.carry(frames_nbytes(frames))

    def receive(self, frames: Sequence) -> None:
        """Block while the incoming direction carries `frames`."""
        self.inn.carry(frames_nbytes(frames))

    def __repr__(self) -> str:
        return f"Link({self.mbit_per_s:g} Mbit/s each way)"
