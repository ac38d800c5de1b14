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

from collections import defaultdict
from typing import Mapping

import torch

from hetps.proto.runs import flat_runs
from hetps.proto.tensors import Tensors
from hetps.runconfig.schema import OptimizerConfig
from hetps.runtime.optim import build_lr_scheduler, build_optimizer

from .arena import Arena
from .flat_state import flat_state, per_tensor_state


class Updater:
    """Applies gradients to the store's parameters with the optimizer. The lr
    schedule steps once per `samples_per_step` samples applied (the global batch,
    `optimizer.schedule.clock: samples`: a sync round is one step, a grouping
    group's update of k of P workers k / P of one), or once per update
    (`samples_per_step` 0, or an update that names no samples). `lr_scale` lets a
    policy damp an update. `arena`: the tensors are its views; the optimizer
    updates its flat runs."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        names: list[str],
        cfg: OptimizerConfig,
        arena: Arena | None = None,
        samples_per_step: int = 0,
    ):
        self.samples_per_step = samples_per_step
        self.samples = 0  # applied, counted by the schedule's clock
        self.schedule_steps = 0
        self.names = list(names)
        self.params = {n: tensors[n] for n in names}
        self.arena = arena if names and arena is not None and arena.flat else None
        if self.arena is not None:
            targets = list(self.arena.flat.values())
            self.flat_grads = [torch.zeros_like(f) for f in targets]  # padding entries stay zero
            self._grad_views = {}
            self._run_names = {
                dtype: tuple(self.arena.run_names(dtype)) for dtype in self.arena.flat
            }
            for dtype, grad in zip(self.arena.flat, self.flat_grads):
                for n in self._run_names[dtype]:
                    start, view = self.arena.offset_in_run(n), self.arena.views[n]
                    self._grad_views[n] = grad[start : start + view.numel()].view(view.shape)
        else:
            targets = list(self.params.values())
        # one flat run per dtype already makes a step a few kernels; not torch's foreach implementation,
        # which writes into the gradients (SGD's Nesterov term), and a flat gradient may be a peer's frame
        foreach = False if self.arena is not None else None
        self.optimizer = build_optimizer(targets, cfg, foreach) if names else None
        self.scheduler = (
            build_lr_scheduler(self.optimizer, cfg.schedule) if self.optimizer else None
        )
        self.updates = 0
        # plain SGD over the flat runs steps through sgd_step (the same kernels, without torch.optim's
        # per-step wrappers) from its second step on: the first goes through optimizer.step(), which
        # the lr scheduler checks for
        self._direct = (
            self.arena is not None
            and type(self.optimizer) is torch.optim.SGD
            and len(self.optimizer.param_groups) == 1
        )
        self._stepped = False
        # per-group optimizer state (`algorithm.optimizer_state: per_group`): key -> the state
        # (torch.optim's `optimizer.state`) its updates step; the live one is `optimizer.state`
        self.states: dict[int, defaultdict] = {}
        self.state_key: int | None = None

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"] if self.optimizer else 0.0

    @property
    def momentum(self) -> float:
        """The configured momentum: SGD's `momentum`, Adam's first beta; 0 without either."""
        if self.optimizer is None:
            return 0.0
        group = self.optimizer.param_groups[0]
        return float(group["betas"][0] if "betas" in group else group.get("momentum", 0.0))

    def _set_momentum(self, momentum: float) -> list:
        """Every param group's momentum set to `momentum`; returns what each had."""
        kept = []
        for g in self.optimizer.param_groups:
            if "betas" in g:
                kept.append(g["betas"])
                g["betas"] = (momentum, g["betas"][1])
            else:
                kept.append(g["momentum"])
                g["momentum"] = momentum
        return kept

    # ------------------------------------------------------------ per-group optimizer state
    def use_state(self, key: int | None) -> None:
        """Step the optimizer state of `key` from now on (a new key starts empty, as a
        fresh optimizer); None: the one state every update shares."""
        if self.optimizer is None or key == self.state_key:
            return
        if key is None:
            self.optimizer.state = defaultdict(dict)
        else:
            self.optimizer.state = self.states.setdefault(key, defaultdict(dict))
        self.state_key = key

    def regroup_states(self, parts: Mapping[int, list[tuple[int, float]]]) -> None:
        """The per-group states for new groups: new key -> [(old key, weight), ...]; each new
        state is the weighted mean of the old ones (momentum buffers, Adam's moments and
        step count), so a group re-formed from others keeps their momentum; a key without
        parts (or only empty ones) starts empty."""
        if self.optimizer is None or not self.states:
            return
        merged: dict[int, defaultdict] = {}
        for key, weighted in parts.items():
            sources = [(self.states[o], w) for o, w in weighted if self.states.get(o) and w > 0]
            if not sources:
                continue
            state: defaultdict = defaultdict(dict)
            for param in {p for src, _ in sources for p in src}:
                having = [(src[param], w) for src, w in sources if param in src]
                weight = sum(w for _, w in having)
                state[param] = {
                    name: _weighted_mean([(e[name], w / weight) for e, w in having])
                    for name in having[0][0]
                }
            merged[key] = state
        self.states = merged
        self.state_key = None
        self.optimizer.state = defaultdict(dict)

    def _optimizer_state(self) -> dict:
        optimizer = self.optimizer.state_dict()
        if self.arena is not None:
            optimizer = per_tensor_state(optimizer, self.arena, self.names)
        return optimizer

    def state_dict(self) -> dict:
        optimizer = self._optimizer_state() if self.optimizer else None
        groups = {}
        if self.optimizer is not None and self.states:
            live = self.optimizer.state
            try:
                for key, state in self.states.items():
                    self.optimizer.state = state
                    groups[key] = self._optimizer_state()["state"]
            finally:
                self.optimizer.state = live
        return {
            "updates": self.updates,
            "samples": self.samples,
            "schedule_steps": self.schedule_steps,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            **({"group_states": groups} if groups else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
        # a checkpoint from before the schedule's clock: it stepped once per update
        self.samples = int(state.get("samples", 0))
        self.schedule_steps = int(state.get("schedule_steps", self.updates))
        if self.optimizer is not None:
            self.states, self.state_key = {}, None
            for key, entries in state.get("group_states", {}).items():
                self._load_optimizer({**state["optimizer"], "state": entries})
                self.states[int(key)] = self.optimizer.state
            self._load_optimizer(state["optimizer"])
            if self.states:  # the shared state is no group's: the next update picks its own
                self.optimizer.state = defaultdict(dict)
            self.scheduler.load_state_dict(state["scheduler"])

    def _load_optimizer(self, optimizer: dict) -> None:
        if self.arena is not None:
            optimizer = flat_state(optimizer, self.arena, self.names)
            for group, live in zip(optimizer["param_groups"], self.optimizer.param_groups):
                # how this layout steps, whoever wrote the state
                group["foreach"] = live["foreach"]
        self.optimizer.load_state_dict(optimizer)

    def apply(
        self,
        grads: Mapping[str, torch.Tensor],
        lr_scale: float = 1.0,
        momentum: float | None = None,
        state_key: int | None = None,
        samples: int = 0,
    ) -> None:
        """One optimizer step. `grads` must hold every parameter; they are only read.
        `momentum`: this step's momentum (SGD) or first beta (Adam) instead of the
        configured one, the buffers kept (None: as configured). `state_key`: step that
        group's optimizer state (`use_state`; None: the shared one). `samples`: the
        samples the update stands for, the schedule's clock."""
        if self.optimizer is None:
            return
        self.use_state(state_key)
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
        kept = self._set_momentum(momentum) if momentum is not None else None
        if self._direct and self._stepped:
            sgd_step(self.optimizer)
        else:
            self.optimizer.step()
            self._stepped = True
        if kept is not None:
            for g, value in zip(self.optimizer.param_groups, kept):
                g["betas" if "betas" in g else "momentum"] = value
        if lr_scale != 1.0:
            for g, lr in zip(self.optimizer.param_groups, base):
                g["lr"] = lr
        for p in targets:
            p.grad = None  # never keep a reference to a peer's frame
        self._advance_schedule(samples)
        self.updates += 1

    def _advance_schedule(self, samples: int) -> None:
        """Step the lr schedule for an update of `samples` samples: once per update without
        a samples clock, else once per `samples_per_step` applied in all."""
        if self.samples_per_step <= 0 or samples <= 0:
            self.scheduler.step()
            self.schedule_steps += 1
            return
        self.samples += samples
        while (self.schedule_steps + 1) * self.samples_per_step <= self.samples:
            self.scheduler.step()
            self.schedule_steps += 1

    def _gather(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Each flat run's gradient: the pushed memory itself when it already
        lies in the run's layout (a packed push, layout.py), else one foreach
        copy into the run's own gradient buffer."""
        # runs known already (a decoded pack frame, a round's sum: proto/tensors.py) are looked up,
        # not searched
        known = {names: run for run, names in grads.runs} if isinstance(grads, Tensors) else {}
        for (dtype, flat), own in zip(self.arena.flat.items(), self.flat_grads):
            names = self._run_names[dtype]
            run = known.get(names)
            if run is None:
                runs = flat_runs({n: grads[n] for n in names})
                run = runs[0].flat if len(runs) == 1 and runs[0].names == names else None
            if run is not None and run.dtype == dtype:
                pushed = _widened(run, flat.numel())
                if pushed is not None:
                    flat.grad = pushed
                    continue
            torch._foreach_copy_([self._grad_views[n] for n in names], [grads[n] for n in names])
            flat.grad = own


def _weighted_mean(parts: list[tuple[object, float]]):
    """sum(w * value) for tensors (weights summing to 1; floats kept in their dtype);
    anything else (an int, a flag) is taken from the first part."""
    first = parts[0][0]
    if not isinstance(first, torch.Tensor) or not first.is_floating_point():
        return first.clone() if isinstance(first, torch.Tensor) else first
    out = torch.zeros_like(first)
    for value, w in parts:
        out.add_(value, alpha=w)
    return out


def _widened(run: torch.Tensor, numel: int) -> torch.Tensor | None:
    """`run` extended to `numel` entries over the same memory (the padding
    after its last tensor, which a pack frame holds), or None if that memory
    is not there."""
    if run.numel() == numel:
        return run
    storage = run.untyped_storage()
    if (
        run.numel() > numel
        or (run.storage_offset() + numel) * run.element_size() > storage.nbytes()
    ):
        return None
    return run.new_empty(0).set_(storage, run.storage_offset(), (numel,), (1,))


def sgd_step(optimizer: torch.optim.SGD) -> None:
    """One step of `optimizer` (torch.optim.SGD, one param group, no hooks, parameters
    that need no grad) with the operations of torch's single-tensor SGD, in its order,
    so the values are bit-equal; the momentum buffers live in the optimizer's state as
    there. Saves torch.optim's per-step wrappers (profiler record, hooks, grad mode),
    which cost more than the kernels on a small model's flat run."""
    group = optimizer.param_groups[0]
    lr, weight_decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
    dampening, nesterov, maximize = group["dampening"], group["nesterov"], group["maximize"]
    for param in group["params"]:
        grad = param.grad
        if grad is None:
            continue
        if maximize:
            grad = -grad
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        if momentum != 0:
            state = optimizer.state[param]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = grad.detach().clone()
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            grad = grad.add(buf, alpha=momentum) if nesterov else buf
        param.add_(grad, alpha=-lr)
