"""eager-SGD on the PS: partial rounds that close on a quorum of fresh pushes.

Semantics (docs/algorithms.md, the eager line; eager-SGD, PPoPP 2020). Workers push plain gradients;
the shard divides every round's sum by P, so a worker that did not
contribute counts as a zero gradient. One round is open at a time; round k
is applied as shard version k+1.

- A push is *fresh* when it was computed on the current version
  (base_version == version), *late* otherwise. A late push is added to the
  open round (never to the round it missed), once: pushes are deduplicated by
  (worker, clock).
- Quorum (`quorum`): `solo` closes the round at the first fresh push;
  `majority` at ceil(P/2) fresh pushes; `random` when the round's initiator
  (drawn per round from a RNG seeded with `seed`, as the paper's
  implementation does) has pushed. Late pushes ride along but do not count
  toward solo/majority.
- Every `limiter`-th round (rounds limiter-1, 2*limiter-1, ...) is a full
  barrier: it closes only when every worker contributed to it (fresh or late).
  A worker's gradient can therefore be at most limiter-1 versions stale.
- A push staler than `max_staleness` versions (0: the limiter) is `fold`ed
  (added like any late push, and counted) or `drop`ped (`too_stale`).
- A pull after a push waits until the round the gradient was computed for
  has closed: a fresh pusher waits for its round's quorum, a late one is
  answered at once. Workers never wait for each other otherwise.

Buffers: a round moves the float buffers toward the mean of its pushes with
weight (workers in the round) / P; integer buffers take the max.
"""

from __future__ import annotations

import math
import random

from hetps.proto.messages import Push
from hetps.proto.plan import ClusterPlan
from hetps.ps.store import TensorStore
from hetps.ps.updater import Updater

from .base import ConsistencyPolicy, Round


class EagerPolicy(ConsistencyPolicy):
    name = "eager"

    def __init__(self, store: TensorStore, updater: Updater, plan: ClusterPlan, params):
        super().__init__(store, updater, plan, params)
        self.round = Round()
        self.fresh: set[int] = set()  # workers with a fresh push in the open round
        self.waits_for: dict[int, int] = {}  # worker -> version its next pull waits for
        self.rng = random.Random(params.seed)
        self.initiator = self._draw()
        self.counts.update(
            rounds=0, fresh=0, late=0, folded=0, dropped=0, barriers=0, contributions=0
        )

    def _draw(self) -> int:
        return self.rng.choice(self.workers)

    @property
    def bound(self) -> int:
        """Largest staleness (versions) taken without the `too_stale` treatment; 0 = none."""
        return self.params.max_staleness or self.params.limiter

    def is_barrier(self, index: int) -> bool:
        return self.params.limiter > 0 and (index + 1) % self.params.limiter == 0

    def on_push(self, worker: int, push: Push) -> int:
        got = self.accept(worker, push)
        staleness = got.staleness
        if got.duplicate:
            return staleness
        # (after a restore from a checkpoint, base versions can lie ahead of this shard's version)
        self.waits_for[worker] = min(push.base_version, self.store.version) + 1
        too_stale = self.bound > 0 and staleness > self.bound
        if too_stale and self.params.too_stale == "drop":
            self.counts["dropped"] += 1
            return staleness
        self.round.add(worker, got.tensors, got.buffers, samples=push.n_samples)
        self.counts["contributions"] += 1
        if staleness <= 0:
            self.fresh.add(worker)
            self.counts["fresh"] += 1
        else:
            self.counts["folded" if too_stale else "late"] += 1
        if self.quorum_reached():
            self.close()
        return staleness

    def quorum_reached(self) -> bool:
        if self.is_barrier(self.store.version):
            return self.round.members >= set(self.workers)
        quorum = self.params.quorum
        if quorum == "solo":
            return len(self.fresh) >= 1
        if quorum == "majority":
            return len(self.fresh) >= math.ceil(len(self.workers) / 2)
        return self.initiator in self.round.members  # random initiator

    def close(self) -> None:
        """Apply the open round: optimizer step on sum / P (missing = zero)."""
        rnd, p = self.round, len(self.workers)
        if self.is_barrier(self.store.version):
            self.counts["barriers"] += 1
        grads, buffers = rnd.means(over=p)
        self.apply_update(grads, buffers, len(rnd.members) / p, samples=rnd.samples)
        self.counts["rounds"] += 1
        self.round, self.fresh = Round(), set()
        self.initiator = self._draw()

    def adopt(self, plan: ClusterPlan) -> None:
        if self.round.members:
            self.close()  # flush: the open round is applied with the contributions it has
        super().adopt(plan)
        self.initiator = self._draw()

    def pull_ready(self, worker: int, clock: int) -> bool:
        return clock < 0 or self.store.version >= self.waits_for.get(worker, 0)

    def blockers(self, worker: int, clock: int) -> set[int]:
        """Who could close the open round: on a barrier round the workers
        missing from it; under `random` the initiator, until it pushed; else
        the workers without a fresh push in it (any of them may complete the quorum)."""
        if self.pull_ready(worker, clock):
            return set()
        if self.is_barrier(self.store.version):
            return set(self.workers) - self.round.members
        if self.params.quorum == "random":
            return {self.initiator} - self.round.members
        return set(self.workers) - self.fresh

    def stats(self) -> dict:
        c = self.counts
        return {
            **c,
            "mean_contributions": round(c["contributions"] / c["rounds"], 3)
            if c["rounds"]
            else 0.0,
        }


POLICIES = {EagerPolicy.name: EagerPolicy}
