"""Asynchronous DiLoCo on the PS (DiLoCo, arXiv 2311.08105; asynchronous
local SGD with delayed Nesterov, arXiv 2401.09135).

Workers push a pseudo-gradient: the model they started the round from minus
the model after their local steps. The shard applies each push at once (as
async does) with the OUTER optimizer, a torch.optim SGD with Nesterov
momentum built from `algorithm.outer_lr` and `algorithm.outer_momentum`,
not from the `optimizer:` block (which is the workers' inner optimizer).
Staleness is the shard updates since the version the worker started from.
With `per_worker_lr` (default) each push uses outer_lr / P (P: the plan's
workers): synchronous DiLoCo steps once per round on the mean of P
pseudo-gradients; asynchronously the P pushes of a round each take their
share, so a round moves the model as far (with the full outer_lr, four
asynchronous workers on LeNet-5 diverge within seconds).

Delayed Nesterov (`algorithm.delay` N > 1; the default 0 means N = P, the
plan's workers): the momentum buffer m changes only on every N-th push,
with the mean of the last N pseudo-gradients;
push t moves the parameters by
    t % N == 0:  m <- beta m + mean(g_{t-N+1..t});  x <- x - lr (g_t + beta m)
    otherwise:   x <- x - lr g_t                    (m unchanged)
(lr: the outer lr, divided by P with `per_worker_lr`).
so momentum acts once per N pushes instead of once per push, which keeps
many asynchronous pushes from compounding it. N = 1 is plain Nesterov (with
DiLoCo's lr 0.7 and momentum 0.9 and four asynchronous LeNet-5 workers it
diverges; N = P reaches 95% on mnist-5k).
Buffers are moved toward each push's buffers with weight 1/P (as async).
"""

from __future__ import annotations

import torch

from hetps.proto.messages import Push
from hetps.proto.plan import ClusterPlan
from hetps.ps.store import TensorStore
from hetps.ps.updater import Updater
from hetps.runconfig.schema import OptimizerConfig

from .ssp import AsyncPolicy


def outer_optimizer(params) -> OptimizerConfig:
    """The outer optimizer's config: SGD, Nesterov when there is momentum."""
    return OptimizerConfig(
        name="sgd",
        lr=params.outer_lr,
        momentum=params.outer_momentum,
        nesterov=params.outer_momentum > 0,
    )


class DilocoPolicy(AsyncPolicy):
    name = "diloco"

    def __init__(self, store: TensorStore, updater: Updater, plan: ClusterPlan, params):
        # the shard built `updater` from the inner optimizer's config: the outer one replaces it (and is
        # what the shard checkpoints and reports as `lr`)
        super().__init__(
            store,
            Updater(store.tensors, store.param_names(), outer_optimizer(params)),
            plan,
            params,
        )
        # delayed Nesterov: sum of the pseudo-gradients since the last momentum update
        self.delayed: dict = {}
        self.delayed_count = 0

    def on_push(self, worker: int, push: Push) -> int:
        got = self.accept(worker, push)
        if not got.duplicate:
            weight = 1.0 / len(self.workers)
            if self.delay() > 1:
                self.delayed_step(got.tensors, self.lr_scale())
                self.store.mix_buffers(got.buffers, weight)
                self.store.mark_updated(got.tensors)
            else:
                self.apply_update(got.tensors, got.buffers, weight, self.lr_scale())
        return got.staleness

    def delay(self) -> int:
        """N of delayed Nesterov: `algorithm.delay`, 0 meaning the plan's workers."""
        return self.params.delay or len(self.workers)

    def lr_scale(self) -> float:
        """The outer lr's factor: 1/P with `per_worker_lr` (P: the plan's workers)."""
        return 1.0 / len(self.workers) if self.params.per_worker_lr else 1.0

    def delayed_step(self, grads: dict, lr_scale: float) -> None:
        """One push under delayed Nesterov (module docstring), lr times `lr_scale`."""
        for n, g in grads.items():
            if n in self.delayed:
                self.delayed[n].add_(g)
            else:
                self.delayed[n] = g.to(self.store.tensors[n].dtype).clone()
        self.delayed_count += 1
        lr = self.updater.lr * lr_scale
        if self.delayed_count < self.delay():
            with torch.no_grad():
                for n, g in grads.items():
                    self.store.tensors[n].sub_(g.to(self.store.tensors[n].dtype), alpha=lr)
            return
        mean = {n: s.div_(self.delayed_count) for n, s in self.delayed.items()}
        # torch's Nesterov step on `mean` moves x by -lr (mean + beta m_new); shift by -lr (g_t - mean)
        # first, so the push moves x by -lr (g_t + beta m_new)
        with torch.no_grad():
            for n, g in grads.items():
                self.store.tensors[n].sub_(g.to(mean[n].dtype) - mean[n], alpha=lr)
        self.updater.apply(mean, lr_scale=lr_scale)
        self.delayed, self.delayed_count = {}, 0

    def stats(self) -> dict:
        return {
            **super().stats(),
            "outer_lr": self.updater.lr,
            "delayed_pending": self.delayed_count,
        }


POLICIES = {DilocoPolicy.name: DilocoPolicy}
