"""The eager-SGD paper's load-imbalance model: every step, one worker drawn at
random takes `cluster.straggler` extra times its compute time.

The draw for step s is a pure function of (seed, s), so every worker makes
the same draw without talking to the others: in lockstep algorithms exactly
one worker per step is slow. Off (0.0) by default.
"""

from __future__ import annotations

import random
import time

from hetps.runconfig.schema import RunConfig


def straggler_of(seed: int, step: int, n_workers: int) -> int:
    """Index of the worker that straggles at `step`."""
    return random.Random(seed * 1_000_003 + step).randrange(n_workers)


def straggle(cfg: RunConfig, index: int, step: int, compute_s: float) -> float:
    """Sleep the extra time if worker `index` is the straggler of `step`;
    returns the seconds slept (blocking)."""
    extra, n = cfg.cluster.straggler, len(cfg.cluster.workers)
    if extra <= 0 or n < 2 or straggler_of(cfg.seed, step, n) != index:
        return 0.0
    time.sleep(compute_s * extra)
    return compute_s * extra
