"""Emulated heterogeneity and faults: a node's slowdown factor, optionally
changing on a time schedule (`slowdown: 1, schedule: [{at_s: 30, slowdown: 4}]`),
and dropped or delayed messages (`cluster.faults`).

A slowed node sleeps (factor - 1) x the time it measured for its own work
(`work_clock`), so a step or an update takes factor x its real compute time.
"""
from __future__ import annotations

import random
import time

from .config import MessageFaults, NodeConfig


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
