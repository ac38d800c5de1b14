"""Emulated heterogeneity and faults: a node's slowdown factor, optionally
changing on a time schedule (`slowdown: 1, schedule: [{at_s: 30, slowdown: 4}]`),
and dropped or delayed messages (`cluster.faults`, `wire_faults`).

A slowed node sleeps (factor - 1) x the time it measured for its own work
(`work_clock`), so a step or an update takes factor x its real compute time.

A capped link (`link_mbps`) is a socket option, not a process setting: the
daemon makes one `proto.link.Link` for its node and passes it, in the
`TransportOptions` of runtime/daemon.py `transport_options`, to every socket
it makes.
"""

from __future__ import annotations

import time

from hetps.proto.faults import WireFaults
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

        # this worker's GPU (cuda:1 is not the current device by default)
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return time.thread_time()


def wire_faults(faults: MessageFaults, seed: int) -> WireFaults:
    """Fault injection on one connection's outgoing requests as `cluster.faults`
    says (proto/faults.py), seeded by `seed` (one stream per connection)."""
    return WireFaults(faults.drop, faults.delay, faults.delay_s, seed)
