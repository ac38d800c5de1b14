"""Emulated heterogeneity and faults: a node's slowdown factor, optionally
changing on a time schedule (`slowdown: 1, schedule: [{at_s: 30, slowdown: 4}]`),
and dropped or delayed messages (`cluster.faults`), and a capped link
(`link_mbps`) for every ZeroMQ socket of a process (transport.py calls
`carry` on each message).

A slowed node sleeps (factor - 1) x the time it measured for its own work
(`work_clock`), so a step or an update takes factor x its real compute time.
"""
from __future__ import annotations

import random
import threading
import time
from typing import Sequence

from hetps.runconfig.schema import MessageFaults, NodeConfig


class Slowdown:
    def __init__(self, node: NodeConfig):
        self.base = node.slowdown
        self.schedule = sorted(node.schedule, key=lambda c: c.at_s)
        self.started = time.monotonic()

    def start(self) -> None:
        """Schedule times count from now."""
        self.started = time.monotonic()

    def factor(self) -> float:
        elapsed = time.monotonic() - self.started
        current = self.base
        for change in self.schedule:
            if change.at_s <= elapsed:
                current = change.slowdown
        return current

    def stretch(self, busy_s: float) -> float:
        """Sleep so that work which took `busy_s` seems to take factor x as long;
        returns the stretched duration in seconds."""
        f = self.factor()
        if f > 1.0:
            time.sleep(busy_s * (f - 1.0))
        return busy_s * f


def work_clock(device: str = "cpu") -> float:
    """A clock for measuring a node's own work, in seconds. On the CPU it is
    this thread's CPU time, so time spent waiting for a core that other
    processes hold (several nodes on one machine) does not count as work; on
    CUDA it is wall time after a synchronize."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)  # this worker's GPU (cuda:1 is not the current device by default)
        return time.perf_counter()
    return time.thread_time()


class WireFaults:
    """Fault injection on a node's outgoing requests (`cluster.faults`): each
    transmission is dropped with probability `drop`, else held back
    `delay_s` with probability `delay`. Seeded, so a run is repeatable."""

    def __init__(self, faults: MessageFaults, seed: int):
        self.faults = faults
        self.rng = random.Random(seed)
        self.dropped = 0
        self.delayed = 0

    @property
    def active(self) -> bool:
        return self.faults.drop > 0 or self.faults.delay > 0

    def admit(self) -> bool:
        """False: drop this message. May sleep first (a delayed message)."""
        if self.rng.random() < self.faults.drop:
            self.dropped += 1
            return False
        if self.rng.random() < self.faults.delay:
            self.delayed += 1
            time.sleep(self.faults.delay_s)
        return True


def frames_nbytes(frames: Sequence) -> int:
    return sum(memoryview(f).nbytes for f in frames)


class LinkCap:
    """Emulates a node's link of `bytes_per_s` in one direction: a message of
    n bytes occupies the link for n / rate seconds after the previous one, and
    the caller sleeps until it has passed. Thread-safe."""

    def __init__(self, bytes_per_s: float):
        self.rate = bytes_per_s
        self.free_at = time.monotonic()
        self.lock = threading.Lock()

    def carry(self, nbytes: int) -> None:
        with self.lock:
            now = time.monotonic()
            self.free_at = max(now, self.free_at) + nbytes / self.rate
            wait = self.free_at - now
        if wait > 0:
            time.sleep(wait)


_LINK: dict[str, LinkCap] = {}  # "out"/"in" -> this process's emulated link, when capped


def set_link_cap(mbit_per_s: float) -> None:
    """Cap every ZeroMQ socket of this process at `mbit_per_s` megabits/s in
    each direction (0: no cap). Emulates a slow link on one machine."""
    _LINK.clear()
    if mbit_per_s > 0:
        _LINK.update(out=LinkCap(mbit_per_s * 1e6 / 8), inn=LinkCap(mbit_per_s * 1e6 / 8))


def carry(direction: str, frames: Sequence) -> None:
    """Sleep while the capped link ("out" or "inn") carries `frames` (no cap: at once)."""
    link = _LINK.get(direction)
    if link is not None:
        link.carry(frames_nbytes(frames))
