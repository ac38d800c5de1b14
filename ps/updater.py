"""The shard-side optimizer: a real torch.optim optimizer over the shard's
parameter tensors, with a learning-rate schedule from torch.optim.lr_scheduler.

Because SGD/Adam act on each tensor independently, one optimizer per shard
gives exactly the update a single optimizer over the whole model would.
"""
from __future__ import annotations

from typing import Mapping

import torch

from hetps.proto.config import OptimizerConfig
from hetps.proto.optim import build_lr_scheduler, build_optimizer


class Updater:
    """Applies gradients to the store's parameters with the optimizer, one
    scheduler step per update. `lr_scale` lets a policy damp an update."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], names: list[str], cfg: OptimizerConfig):
        self.params = {n: tensors[n] for n in names}
        self.optimizer = build_optimizer(list(self.params.values()), cfg) if names else None
        self.scheduler = (build_lr_scheduler(self.optimizer, cfg.schedule)
                          if self.optimizer else None)
        self.updates = 0

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"] if self.optimizer else 0.0

    def state_dict(self) -> dict:
        return {"updates": self.updates,
                "optimizer": self.optimizer.state_dict() if self.optimizer else None,
                "scheduler": self.scheduler.state_dict() if self.scheduler else None}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])

    def apply(self, grads: Mapping[str, torch.Tensor], lr_scale: float = 1.0) -> None:
        """One optimizer step. `grads` must hold every parameter; they are only read."""
        if self.optimizer is None:
            return
        for name, p in self.params.items():
            p.grad = grads[name]
        if lr_scale != 1.0:
            base = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] *= lr_scale
        self.optimizer.step()
        if lr_scale != 1.0:
            for g, lr in zip(self.optimizer.param_groups, base):
                g["lr"] = lr
        for p in self.params.values():
            p.grad = None  # never keep a reference to a peer's frame
        self.scheduler.step()
        self.updates += 1
