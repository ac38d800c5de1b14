"""Heterogeneity efficiency: how well a run used the workers it had.

    efficiency = cluster samples/s ÷ Σ_i standalone samples/s of worker i

The numerator is the training examples all workers computed on, divided by
the training time (plan to stop); the denominator is the sum of the speeds
the workers measured when they profiled themselves alone before the run
(forward and backward on the real model, stretched by their emulated
slowdown). 1.0 means no worker ever waited; sync on workers [1, 1, 3, 3]
sits near 4 × (1/3) / (1 + 1 + 1/3 + 1/3) = 0.5.

Samples that do not help are not free: "useful" efficiency corrects for the
samples an algorithm needs to reach the target, against a sync reference:

    useful = efficiency × (sync's samples to target ÷ this run's samples to target)

Pure functions; `run_efficiency` reads the coordinator for summary.json.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .coordinator import Coordinator


def heterogeneity_efficiency(
    samples: float, train_s: float, standalone: list[float]
) -> float | None:
    """samples / train_s / sum(standalone); None when any input is missing or not positive."""
    total = sum(s for s in standalone if s > 0 and math.isfinite(s))
    if not (samples > 0 and train_s > 0 and total > 0):
        return None
    return samples / train_s / total


def useful_efficiency(
    efficiency: float | None, reference_samples: float | None, samples: float | None
) -> float | None:
    """efficiency x reference samples-to-target / this run's; None unless all are known and positive."""
    if (
        efficiency is None
        or not reference_samples
        or not samples
        or reference_samples <= 0
        or samples <= 0
    ):
        return None
    return efficiency * reference_samples / samples


def run_efficiency(coord: Coordinator) -> dict:
    """The efficiency block of summary.json (numbers rounded for reading)."""
    workers = coord.members("worker")
    samples = sum(int(n.stats.get("samples", 0)) for n in workers)
    end = coord.stop_since if coord.stop_reason is not None else None
    train_s = (
        (end - coord.started)
        if (end is not None and coord.started is not None)
        else coord.elapsed()
    )
    standalone = [n.profiled_speed for n in workers]
    eff = heterogeneity_efficiency(samples, train_s, standalone)
    return {
        "samples": samples,
        "train_s": round(train_s, 3),
        "cluster_samples_per_s": round(samples / train_s, 3) if train_s > 0 else None,
        "standalone_samples_per_s": round(sum(standalone), 3),
        "heterogeneity_efficiency": None if eff is None else round(eff, 4),
        "samples_to_target": coord.evals.samples_to_target,
    }
