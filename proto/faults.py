"""Fault injection on a client's outgoing requests: each transmission is
dropped or held back, with seeded probabilities, so that the retry and
re-send paths of rpc.py can be exercised (`cluster.faults` in a run; the
runtime builds a `WireFaults` from it, runtime/emulation.py `wire_faults`).
"""

from __future__ import annotations

import random
import time


class WireFaults:
    """Each transmission is dropped with probability `drop`, else held back
    `delay_s` seconds with probability `delay`. Seeded by `seed`, so a run is
    repeatable. Not thread-safe: one per connection (one thread each)."""

    def __init__(self, drop: float = 0.0, delay: float = 0.0, delay_s: float = 0.05, seed: int = 0):
        if not (0.0 <= drop <= 1.0 and 0.0 <= delay <= 1.0 and delay_s >= 0.0):
            raise ValueError(
                f"want drop and delay in [0, 1] and delay_s >= 0, "
                f"got drop={drop} delay={delay} delay_s={delay_s}"
            )
        self.drop, self.delay, self.delay_s = drop, delay, delay_s
        self.rng = random.Random(seed)
        self.dropped = 0
        self.delayed = 0

    @property
    def active(self) -> bool:
        """False when nothing would ever be dropped or delayed (rpc then skips `admit`)."""
        return self.drop > 0 or self.delay > 0

    def admit(self) -> bool:
        """False: drop this message. May sleep `delay_s` first (a delayed message)."""
        if self.rng.random() < self.drop:
            self.dropped += 1
            return False
        if self.rng.random() < self.delay:
            self.delayed += 1
            time.sleep(self.delay_s)
        return True
