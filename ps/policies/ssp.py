"""Pushes applied one by one, as they come: Async-SGD (ASP) and stale
synchronous parallel (SSP), which bounds how far ahead a reader may be."""

from __future__ import annotations

from hetps.proto.messages import Push
from hetps.proto.plan import ClusterPlan

from .base import ConsistencyPolicy


class AsyncPolicy(ConsistencyPolicy):
    """ASP: every push is applied at once; pulls are never held."""

    name = "async"

    def __init__(self, *args):
        super().__init__(*args)
        self.pushed = {w: 0 for w in self.workers}

    def adopt(self, plan: ClusterPlan) -> None:
        super().adopt(plan)
        # a joining worker starts at the slowest clock, so it does not hold ssp readers back
        self.pushed = {
            w: self.pushed.get(w, min(self.pushed.values(), default=0)) for w in self.workers
        }

    def on_push(self, worker: int, push: Push) -> int:
        got = self.accept(worker, push)
        if not got.duplicate:
            self.apply_update(
                self.compensated(worker, got.tensors),
                got.buffers,
                1.0 / len(self.workers),
                self.staleness_scale(got.staleness),
                samples=push.n_samples,
            )
            self.remember_served(worker)
        return got.staleness

    def staleness_scale(self, staleness: int) -> float:
        """1 / staleness with `scale_lr` (Zhang et al. 2016, staleness-aware
        async SGD: a gradient computed k updates ago moves the model 1/k as
        far), else 1; times 1 / P with `lr_share` (one push of a round of P)."""
        share = 1.0 / len(self.workers) if self.params.lr_share else 1.0
        return share / max(1, staleness) if self.params.scale_lr else share

    def pull_ready(self, worker: int, clock: int) -> bool:
        return True


class SspPolicy(AsyncPolicy):
    """Stale synchronous parallel: applied like async, but a worker that has
    made `clock` pushes may only read once the slowest worker has made at
    least clock - staleness."""

    name = "ssp"

    def pull_ready(self, worker: int, clock: int) -> bool:
        return clock < 0 or min(self.pushed.values()) >= clock - self.params.staleness

    def blockers(self, worker: int, clock: int) -> set[int]:
        """The workers whose clocks are below the reader's bound."""
        if clock < 0:
            return set()
        return {w for w, c in list(self.pushed.items()) if c < clock - self.params.staleness}
