"""The shard-side optimizer: a real torch.optim optimizer over the shard's
parameter tensors, with a learning-rate schedule from torch.optim.lr_scheduler.

Because SGD/Adam act on each tensor independently, one optimizer per shard
gives exactly the update a single optimizer over the whole model would; for
the same reason it may act on the store's flat runs (arena.py) instead of
the separate tensors: one tensor per dtype, a few kernels per step whatever
the number of tensors, the same values. Its checkpoint state keeps the
per-tensor form (flat_state.py).
"""
from __future__ import annotations

from typing import Mapping

import torch

from hetps.proto.config import OptimizerConfig
from hetps.proto.optim import build_lr_scheduler, build_optimizer
from hetps.proto.runs import flat_runs

from .arena import Arena
from .flat_state import flat_state, per_tensor_state


class Updater:
    """Applies gradients to the store's parameters with the optimizer, one
    scheduler step per update. `lr_scale` lets a policy damp an update.
    `arena`: the tensors are its views; the optimizer updates its flat runs."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], names: list[str], cfg: OptimizerConfig,
                 arena: Arena | None = None):
        self.names = list(names)
        self.params = {n: tensors[n] for n in names}
        self.arena = arena if names and arena is not None and arena.flat else None
        if self.arena is not None:
            targets = list(self.arena.flat.values())
            self.flat_grads = [torch.zeros_like(f) for f in targets]  # padding entries stay zero
            self._grad_views = {}
            for dtype, grad in zip(self.arena.flat, self.flat_grads):
                for n in self.arena.run_names(dtype):
                    start, view = self.arena.offset_in_run(n), self.arena.views[n]
                    self._grad_views[n] = grad[start:start + view.numel()].view(view.shape)
        else:
            targets = list(self.params.values())
        # one flat run per dtype already makes a step a few kernels; not torch's foreach implementation,
        # which writes into the gradients (SGD's Nesterov term), and a flat gradient may be a peer's frame
        foreach = False if self.arena is not None else None
        self.optimizer = build_optimizer(targets, cfg, foreach) if names else None
        self.scheduler = (build_lr_scheduler(self.optimizer, cfg.schedule)
                          if self.optimizer else None)
        self.updates = 0

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"] if self.optimizer else 0.0

    def state_dict(self) -> dict:
        optimizer = self.optimizer.state_dict() if self.optimizer else None
        if self.arena is not None:
            optimizer = per_tensor_state(optimizer, self.arena, self.names)
        return {"updates": self.updates, "optimizer": optimizer,
                "scheduler": self.scheduler.state_dict() if self.scheduler else None}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
        if self.optimizer is not None:
            optimizer = state["optimizer"]
            if self.arena is not None:
                optimizer = flat_state(optimizer, self.arena, self.names)
                for group, live in zip(optimizer["param_groups"], self.optimizer.param_groups):
                    group["foreach"] = live["foreach"]  # how this layout steps, whoever wrote the state
            self.optimizer.load_state_dict(optimizer)
            self.scheduler.load_state_dict(state["scheduler"])

    def apply(self, grads: Mapping[str, torch.Tensor], lr_scale: float = 1.0) -> None:
        """One optimizer step. `grads` must hold every parameter; they are only read."""
        if self.optimizer is None:
            return
        if self.arena is None:
            targets = list(self.params.values())
            for name, p in self.params.items():
                p.grad = grads[name]
        else:
            targets = list(self.arena.flat.values())
            self._gather(grads)
        if lr_scale != 1.0:
            base = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] *= lr_scale
        self.optimizer.step()
        if lr_scale != 1.0:
            for g, lr in zip(self.optimizer.param_groups, base):
                g["lr"] = lr
        for p in targets:
            p.grad = None  # never keep a reference to a peer's frame
        self.scheduler.step()
        self.updates += 1

    def _gather(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Each flat run's gradient: the pushed memory itself when it already
        lies in the run's layout (a packed push, layout.py), else one foreach
        copy into the run's own gradient buffer."""
        for (dtype, flat), own in zip(self.arena.flat.items(), self.flat_grads):
            names = self.arena.run_names(dtype)
            ordered = {n: grads[n] for n in names}
            runs = flat_runs(ordered)
            if len(runs) == 1 and runs[0][1] == names and runs[0][0].dtype == dtype:
                pushed = _widened(runs[0][0], flat.numel())
                if pushed is not None:
                    flat.grad = pushed
                    continue
            torch._foreach_copy_([self._grad_views[n] for n in names], list(ordered.values()))
            flat.grad = own


def _widened(run: torch.Tensor, numel: int) -> torch.Tensor | None:
    """`run` extended to `numel` entries over the same memory (the padding
    after its last tensor, which a pack frame holds), or None if that memory
    is not there."""
    if run.numel() == numel:
        return run
    storage = run.untyped_storage()
    if run.numel() > numel or (run.storage_offset() + numel) * run.element_size() > storage.nbytes():
        return None
    return run.new_empty(0).set_(storage, run.storage_offset(), (numel,), (1,))
