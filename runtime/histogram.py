"""Durations as Prometheus histograms: counts per bucket, a sum and a count,
kept in the daemon and read by the /metrics collector at scrape time.

A moving average hides the slow tail an operator looks for (one step in ten
that waits 2 s for a straggler); bucket counts keep it, and Prometheus can
compute any quantile or rate from them over any window.
"""

from __future__ import annotations

import bisect
import math
import threading

# seconds: a sub-millisecond push on loopback up to a minute-long wait for a dead peer
DURATION_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class Histogram:
    """Observations (seconds) counted in fixed buckets. Thread-safe: the
    training thread observes while the metrics thread takes snapshots."""

    def __init__(self, bounds: tuple[float, ...] = DURATION_BUCKETS_S):
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError(f"histogram bounds must be increasing and distinct, got {bounds}")
        self.bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf only)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        """Count one duration; a negative or non-finite value is ignored (a clock step)."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        with self._lock:
            self._counts[bisect.bisect_left(self.bounds, seconds)] += 1
            self._sum += seconds

    def snapshot(self) -> dict:
        """{"buckets": [[upper bound, cumulative count], ..., ["+Inf", count]], "sum": s, "count": n}:
        Prometheus' cumulative `le` buckets, the last one holding every observation."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        buckets, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), counts):
            running += n
            buckets.append([bound, running])
        return {"buckets": buckets, "sum": total, "count": running}
