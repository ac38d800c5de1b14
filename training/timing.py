"""A worker's step timings: moving averages of compute, push and whole-step
time (the speed the worker reports) and their histograms. The real loops and
the simulated workers keep the same."""

from __future__ import annotations

from hetps.runtime.histogram import Histogram


class StepTimer:
    """Exponential moving averages (seconds) of a worker's compute time, of
    the time its push takes to be acknowledged (its own link and the shards'
    service, not waiting for other workers), and of the whole step; and the
    same durations, with the round wait (the rest of the step), as histograms
    for /metrics (runtime/metrics.py HISTOGRAMS)."""

    def __init__(self, alpha: float = 0.05):
        self.alpha = alpha
        self.compute_s = 0.0
        self.push_s = 0.0
        self.step_s = 0.0
        self.durations = {
            key: Histogram() for key in ("step_s", "compute_s", "push_s", "round_wait_s")
        }

    def update(self, compute_s: float, push_s: float, step_s: float) -> None:
        a = self.alpha if self.step_s else 1.0
        self.compute_s += a * (compute_s - self.compute_s)
        self.push_s += a * (push_s - self.push_s)
        self.step_s += a * (step_s - self.step_s)
        observed = {
            "step_s": step_s,
            "compute_s": compute_s,
            "push_s": push_s,
            "round_wait_s": max(0.0, step_s - compute_s - push_s),
        }
        for key, seconds in observed.items():
            self.durations[key].observe(seconds)

    def histograms(self) -> dict:
        """Snapshots of the duration histograms (any thread)."""
        return {key: h.snapshot() for key, h in self.durations.items()}

    def rescale(self, factor: float) -> None:
        """The batch changed by `factor`: compute and step times are taken to
        scale with it, so the speed reported next is not the old batch's time
        over the new batch (which would ask for a bigger batch still)."""
        self.compute_s *= factor
        self.step_s *= factor

    def speed(self, batch_size: int) -> float:
        """Samples/s this worker could sustain alone: compute plus its push."""
        busy = self.compute_s + self.push_s
        return batch_size / busy if busy else 0.0
