"""Optimizers from the config, shared by the shards (server-side updates)
and the model-averaging workers (local steps): a torch.optim optimizer and
the multiplier of its lr under the configured schedule.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from hetps.runconfig.factories import FactoryError, load_factory
from hetps.runconfig.schema import OptimizerConfig, ScheduleConfig


def build_optimizer(
    params: list[torch.Tensor], cfg: OptimizerConfig, foreach: bool | None = None
) -> torch.optim.Optimizer:
    """`foreach`: torch.optim's multi-tensor implementation (None: torch's default for the device)."""
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            weight_decay=cfg.weight_decay,
            foreach=foreach,
        )
    if cfg.name == "adam":
        return torch.optim.Adam(
            params,
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            weight_decay=cfg.weight_decay,
            foreach=foreach,
        )
    if cfg.name == "adamw":  # decoupled weight decay (DiLoCo's inner optimizer)
        return torch.optim.AdamW(
            params,
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            weight_decay=cfg.weight_decay,
            foreach=foreach,
        )
    raise ValueError(f"optimizer.name: unknown value {cfg.name!r}; allowed: sgd, adam, adamw")


def lr_factor(cfg: ScheduleConfig) -> Callable[[int], float]:
    """Multiplier of the base lr after `step` updates: linear warm-up, then the schedule."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        after = step - cfg.warmup_steps
        if cfg.name == "step":
            return cfg.gamma ** (after // cfg.step_size)
        if cfg.name == "cosine":
            span = max(1, cfg.total_steps - cfg.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(after, span) / span))
        return 1.0

    return factor


def schedule_batch(cfg) -> int:
    """Samples per schedule step under `optimizer.schedule.clock: samples` (0: the schedule
    steps once per update, `clock: updates`): the global batch of a sync round of the
    configured workers, data.batch_size x data.accumulate x workers (balanced: its
    global_batch x data.accumulate)."""
    if cfg.optimizer.schedule.clock != "samples":
        return 0
    global_batch = getattr(cfg.algorithm.params, "global_batch", 0)
    per_round = global_batch or cfg.data.batch_size * max(1, len(cfg.cluster.workers))
    return per_round * cfg.data.accumulate


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig):
    """The schedule of `optimizer`'s lr: call .step() once per schedule step. A
    builtin name: a LambdaLR stepping `lr_factor(cfg)`; `package.module:factory`:
    `factory(optimizer, **cfg.kwargs)`, any object with `step()`, `state_dict()`
    and `load_state_dict()` (a torch.optim.lr_scheduler scheduler other than
    ReduceLROnPlateau; warmup_steps and the other builtin
    keys do not apply). Raises ValueError naming optimizer.schedule.name, also for
    whatever the factory raised."""
    if ":" not in cfg.name:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))
    where = f"optimizer.schedule.name {cfg.name!r}"
    try:
        factory = load_factory(cfg.name, "optimizer.schedule.name")
    except FactoryError as exc:
        raise ValueError(f"{where}: {exc.reason}") from None
    try:
        scheduler = factory(optimizer, **cfg.kwargs)
    except Exception as exc:  # the user's factory may raise anything
        raise ValueError(f"{where}: {type(exc).__name__}: {exc}") from None
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(
            f"{where}: ReduceLROnPlateau steps on a metric, but the shards step the schedule "
            "once per update without one; use a schedule of the update count"
        )
    # the shards checkpoint and replicate the schedule with the optimizer
    needed = ("step", "state_dict", "load_state_dict")
    missing = [m for m in needed if not callable(getattr(scheduler, m, None))]
    if missing:
        raise ValueError(
            f"{where}: factory(optimizer, **kwargs) must return an LR scheduler (with step(), "
            f"state_dict() and load_state_dict()), got {type(scheduler).__name__} without "
            f"{', '.join(missing)}"
        )
    return scheduler


def check_optimizer(cfg: OptimizerConfig) -> None:
    """Build the optimizer and lr schedule `cfg` names over a stand-in parameter, as a shard
    builds them over its tensors (ps/updater.py), so that a factory that cannot build the
    schedule fails before training, not in a shard serving its first INIT. Raises ValueError
    naming the key (`optimizer.name`, `optimizer.schedule.name`)."""
    optimizer = build_optimizer([torch.zeros(1, requires_grad=True)], cfg)
    build_lr_scheduler(optimizer, cfg.schedule)
