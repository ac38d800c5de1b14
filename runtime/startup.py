"""Start-up phases of a daemon: how long its imports, model build and
profiling took, reported to the scheduler in REGISTER (`startup`) so that
`hetps run` can print where the seconds before the first step went.

Durations are seconds of wall time (time.monotonic), rounded to the millisecond.
A REGISTER carries at most MAX_PHASES phases of at most MAX_PHASE_S each
(proto/records.py, the wire record's limits).
"""

from __future__ import annotations

import os
import time


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere 0.0).
    At the top of main() it is the interpreter start plus the imports."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))


class Phases:
    """Consecutive phases of a start-up: `mark(name)` ends the phase that
    began at the previous mark (or at construction). Not thread-safe."""

    def __init__(self, imports_s: float | None = None):
        self.durations: dict[str, float] = {}
        if imports_s is not None:
            self.durations["imports"] = round(imports_s, 3)
        self._last = time.monotonic()

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.durations[name] = round(self.durations.get(name, 0.0) + now - self._last, 3)
        self._last = now

    def as_dict(self) -> dict[str, float]:
        return dict(self.durations)
