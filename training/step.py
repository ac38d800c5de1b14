"""A worker's per-step work, one implementation for the real worker loops
(trainer.py, local.py, diloco.py: PSClient over ZeroMQ, membership,
heartbeats, the wall clock) and the simulated workers (sim/workers.py,
sim/local_workers.py: virtual time, simulated shards). Nothing here sends
or waits: it computes a step, says when a round is due and what its push
carries, and takes the round's result; the loops move the messages, keep
their clocks and handle the ACKs' staleness and plan ids.

- `GradientStep`: the worker's place, group, data share, batch size and
  batch stream under a plan; one forward/backward on the next batch (under
  `model.autocast`, clipped to `optimizer.clip_grad_norm`); the `grad_norm`
  of a step record. The gradient-pushing loops (sync, async, ssp, grouping,
  eager, balanced) push its gradient; the loops below step on it locally.
- `LocalRounds`: model averaging (cpsgd, adpsgd, wpsgd, simuparallel): the
  local optimizer and lr schedule, the period and when a round is due, what
  a round's push carries (the model) and how its mean is taken.
- `DilocoRounds`: diloco: H_i local steps from the plan's speeds, the
  pseudo-gradient a round pushes, the new global model it brings back.

Each gets what it reads in its constructor: the config, the worker's
`ModelState` and data, its node id, the plan, and (rounds) a clock.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ContextManager

import torch
from torch import nn

from hetps.proto.messages import Ack
from hetps.proto.plan import ClusterPlan
from hetps.runconfig.algorithms import algorithm
from hetps.runconfig.schema import RunConfig
from hetps.runtime.optim import build_lr_scheduler, build_optimizer
from hetps.runtime.speed_shares import local_steps

from .data import Datasets, stream_share
from .state import ModelState
from .task import Task, load_task

# What a round's push carries: (tensors, clock, n_samples, info), PSClient.push's arguments.
RoundRequest = tuple[dict[str, torch.Tensor], int, int, dict]


def autocast(kind: str, device: torch.device) -> ContextManager:
    """`model.autocast`: the context a training forward pass runs in (bfloat16
    needs no loss scaling: it has float32's range; float16 does: LossScale)."""
    if kind in ("bfloat16", "float16"):
        dtype = torch.bfloat16 if kind == "bfloat16" else torch.float16
        return torch.autocast(device_type=device.type, dtype=dtype)
    return contextlib.nullcontext()


def batch_loss(task: Task, model: nn.Module, batch) -> torch.Tensor:
    """The training loss of one batch: the task's (a scalar tensor)."""
    return task.loss(model, batch)


@functools.lru_cache(maxsize=None)
def _task(name: str, kwargs: str, data_classes: int | None, dataset_classes: int | None) -> Task:
    from hetps.runconfig.schema import DataConfig, TaskConfig

    cfg = RunConfig(
        task=TaskConfig(name=name, kwargs=json.loads(kwargs)),
        data=DataConfig(num_classes=data_classes),
    )
    return load_task(cfg, dataset_classes)


def task_for(cfg: RunConfig, num_classes: int | None) -> Task:
    """The configured task (worker/task.py load_task), built once per process
    for a config and class count: a factory task is called once, and every
    part of a worker shares the object. Raises TaskError."""
    kwargs = json.dumps(cfg.task.kwargs, sort_keys=True, default=str)
    return _task(cfg.task.name, kwargs, cfg.data.num_classes, num_classes)


class LossScale:
    """float16 loss scaling, torch.amp.GradScaler's rule on a worker: the
    loss is multiplied by `scale` before backward and the gradient divided by
    it after; a gradient with an Inf or NaN (float16 overflow) halves the
    scale, and `interval` finite steps in a row double it."""

    def __init__(self, init: float = 2.0**16, interval: int = 2000):
        self.scale = init
        self.interval = interval
        self.good = 0  # finite steps in a row

    def unscale(self, grads: list[torch.Tensor]) -> bool:
        """Divide `grads` by the scale; True when they are all finite (else
        the scale is halved: the step must be taken again)."""
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)
            finite = bool(torch.stack([g.isfinite().all() for g in grads]).all())
        else:
            finite = True
        if not finite:
            self.scale /= 2
            self.good = 0
            return False
        self.good += 1
        if self.good >= self.interval:
            self.scale *= 2
            self.good = 0
        return True


def clip_to_norm(grads: list[torch.Tensor], max_norm: float) -> float:
    """Scale `grads` in place so that their joint L2 norm is at most `max_norm`
    (as torch.nn.utils.clip_grad_norm_); returns the norm they had. A NaN or
    infinite norm leaves them as they are: scaling by max_norm / inf would zero
    every finite entry and make the infinite ones NaN, where the shard's
    `cluster.nonfinite` (reject, skip or clip) should decide."""
    if not grads:
        return 0.0
    norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
    if math.isfinite(norm) and norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm


def clipped_params(cfg: RunConfig, state: ModelState) -> list[torch.Tensor]:
    """With `optimizer.clip_grad_norm`, the parameters whose gradients are clipped
    together (a tied one once); else none."""
    if not cfg.optimizer.clip_grad_norm:
        return []
    return list({id(t): t for t, kind in state.tensors.values() if kind == "param"}.values())


class GradientStep:
    """One worker's gradient work on `state`'s model: forward/backward on the
    next batch of its data share under the current plan.

    Attributes the loops read: `node_id`; `index` (its place among the plan's
    workers), `group` and `batch_size` (the plan's; per worker under
    `balanced`), all set by `use_plan`; `step_samples` (samples a step's
    gradient stands for: `batch_size` x `data.accumulate`); `samples`
    (examples computed on, all plans together); `grad_norm` (the last
    gradient's L2 norm before clipping; None without
    `optimizer.clip_grad_norm`); `task`. Clipping covers the parameters
    `state` holds when this is built (build it before the loop lays them out
    flat).

    A step computes `data.accumulate` batches and leaves the mean of their
    gradients (each batch's loss divided by the count); under
    `model.autocast: float16` the loss is scaled (LossScale) and a step
    whose gradient overflowed is taken again on the next batches at a
    lower scale, so a push always carries a finite float16 gradient."""

    # a gradient still not finite after this many halvings is handed on as it is (a diverged model:
    # the shards' cluster.nonfinite and the divergence guard decide)
    OVERFLOW_RETRIES = 8

    def __init__(
        self,
        cfg: RunConfig,
        state: ModelState,
        data: Datasets,
        node_id: int,
        plan: ClusterPlan,
        task: Task | None = None,
    ):
        """Takes `plan`'s share at once (`use_plan`). `task`: default the configured one."""
        self.cfg = cfg
        self.state = state
        self.data = data
        self.task = task or task_for(cfg, data.num_classes)
        self.node_id = node_id
        self.samples = 0
        self.batch_size = 0
        self.accumulate = cfg.data.accumulate
        self.clipped = clipped_params(cfg, state)
        self.grad_norm: float | None = None
        self.scaler = LossScale() if cfg.model.autocast == "float16" else None
        self.overflows = 0  # steps taken again after a float16 overflow
        self.use_plan(plan)

    @property
    def step_samples(self) -> int:
        return self.batch_size * self.accumulate

    def use_plan(self, plan: ClusterPlan) -> float:
        """Take this worker's place, group, data share and batch size from
        `plan`, with a batch stream seeded by it. Returns the factor the batch
        size changed by (1.0 at the first plan or when it is unchanged): the
        loop rescales its step timer by it (StepTimer.rescale)."""
        self.index = plan.worker_ids().index(self.node_id)
        self.group = plan.group_of(self.node_id)
        old_batch = self.batch_size
        # balanced: per worker
        self.batch_size = plan.batch_of(self.node_id, self.cfg.data.batch_size)
        self.stream = stream_share(
            self.data.train,
            self.index,
            len(plan.workers),
            plan.share_weights(),
            self.batch_size,
            self.cfg.seed,
            self.cfg.seed + 1000 * self.index + plan.plan_id,
            self.task.collate,
            self.cfg.data.num_workers,
            self.state.device.type == "cuda",
        )
        if old_batch and old_batch != self.batch_size:
            return self.batch_size / old_batch
        return 1.0

    def compute(self) -> float:
        """Forward (under `model.autocast`) and backward on the next
        `data.accumulate` batches, the gradient clipped with
        `optimizer.clip_grad_norm`; returns the loss (the batches' mean).
        The gradient is left in the model (ModelState.outgoing hands it out)."""
        for _ in range(self.OVERFLOW_RETRIES):
            loss = self._accumulated()
            if self.scaler is None or self.scaler.unscale(self._grads()):
                break
            self.overflows += 1
        if self.clipped:
            self.clip_gradients()
        return loss

    def _accumulated(self) -> float:
        """Zero the gradient, then add each of `accumulate` batches' gradients
        of loss / accumulate (scaled under float16); the mean loss."""
        device = self.state.device
        model = self.state.model
        model.train()
        self.state.zero_grad()
        total = 0.0
        for _ in range(self.accumulate):
            batch = self.stream.next_batch()
            self.samples += self.task.batch_size(batch)
            batch = self.task.to_device(batch, device, non_blocking=True)
            with autocast(self.cfg.model.autocast, device):
                loss = batch_loss(self.task, model, batch)
            total += float(loss.detach())
            scaled = loss / self.accumulate
            if self.scaler is not None:
                scaled = scaled * self.scaler.scale
            scaled.backward()
        return total / self.accumulate

    def _grads(self) -> list[torch.Tensor]:
        """The gradients the model holds (a tied parameter once)."""
        params = {id(p): p for p in self.state.model.parameters()}.values()
        return [p.grad for p in params if p.grad is not None]

    def clip_gradients(self) -> None:
        """Scale the gradient to at most `optimizer.clip_grad_norm` (its L2 norm
        over every parameter); keep the norm it had for the step record. Each
        worker clips its own gradient, before a round averages it (DDP clips
        the average)."""
        self.grad_norm = clip_to_norm(
            [p.grad for p in self.clipped if p.grad is not None], self.cfg.optimizer.clip_grad_norm
        )

    def norm_record(self) -> dict:
        """`grad_norm` (before clipping) for a step record, when clipping is on;
        null when it was not finite."""
        if self.grad_norm is None:
            return {}
        return {"grad_norm": round(self.grad_norm, 6) if math.isfinite(self.grad_norm) else None}


@dataclass(frozen=True)
class Period:
    """When a worker averages: every `seconds` (None: count steps instead;
    0: never during the run) or every `steps` local steps; `final_average`:
    one more push when the run stops."""

    seconds: float | None = None
    steps: int = 1
    final_average: bool = False


# the table's `period` -> how this worker reads its period from the algorithm's parameters
PERIODS: dict[str, Callable[[object], Period]] = {
    "steps": lambda p: Period(steps=p.period),
    "shard": lambda p: Period(steps=1),  # starts at 1; the shards' ACKs propose the next ones
    "seconds": lambda p: Period(seconds=p.period_s, final_average=p.final_average),
}


class LocalRounds:
    """Model averaging's local SGD and rounds (cpsgd, adpsgd, wpsgd,
    simuparallel) on `work`'s model: a torch optimizer (`optimizer:`) and its
    lr schedule, kept across rounds; a round is due after `period` local
    steps, or `period_s` seconds of `now` (0: never during the run); its push
    carries the model, its reply the (weighted) mean that replaces it.

    `now`: seconds for time-based periods (time.monotonic in a real worker,
    the virtual clock in the simulator). Attributes the loops read: `round`
    (rounds taken = the push clock), `period`, `steps_in_round`,
    `final_average`, `optimizer`."""

    def __init__(self, cfg: RunConfig, work: GradientStep, now: Callable[[], float]):
        self.cfg = cfg
        self.work = work
        self.state = work.state
        self.now = now
        self.optimizer = build_optimizer(list(self.state.model.parameters()), cfg.optimizer)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.optimizer.schedule)
        period = PERIODS[algorithm(cfg.algorithm.name).period](cfg.algorithm.params)
        self.period_s = period.seconds  # time-based periods
        self.period = period.steps  # step-based periods
        self.final_average = period.final_average
        self.round = 0  # rounds this worker took part in (= its push clock)
        self.steps_in_round = 0
        self.round_started = now()
        self.in_flight = False  # a round was pushed whose result has not been taken

    def begin(self) -> None:
        """The shards' initial values are loaded: the first round starts now."""
        self.round_started = self.now()

    def step(self) -> float:
        """Forward, backward and a step of the local optimizer and its lr
        schedule; counts it in the round (the loop counts its own clock).
        Returns the loss."""
        loss = self.work.compute()
        self.optimizer.step()
        self.scheduler.step()
        self.steps_in_round += 1
        return loss

    def due(self) -> bool:
        """After a local step: whether this round ends now (its push goes out)."""
        if self.period_s is not None:
            return self.period_s > 0 and self.now() - self.round_started >= self.period_s
        return self.steps_in_round >= self.period

    def info(self) -> dict:
        """A push's `info`: steps (local steps in the round), period, lr, weight_decay."""
        return {
            "steps": self.steps_in_round,
            "period": self.steps_in_round,
            "lr": self.optimizer.param_groups[0]["lr"],
            "weight_decay": self.cfg.optimizer.weight_decay,
        }

    def model_values(self) -> dict[str, torch.Tensor]:
        """Copies (CPU) of every parameter and buffer: what an average needs."""
        return {n: t.detach().to("cpu", copy=True) for n, (t, _) in self.state.tensors.items()}

    def n_samples(self) -> int:
        """Examples the round's push stands for (the configured batch per step)."""
        return self.steps_in_round * self.cfg.data.batch_size * self.cfg.data.accumulate

    def request(self) -> RoundRequest:
        """This round's push (the model); the round is in flight until `take`."""
        self.in_flight = True
        return self.model_values(), self.round, self.n_samples(), self.info()

    def take(self, acks: list[Ack], values: dict[str, torch.Tensor]) -> dict:
        """Load the round's mean and take the next period from the ACKs (in
        shard order); returns fields for the step record."""
        self.in_flight = False
        self.state.load(values)
        self.round += 1
        self.steps_in_round = 0
        self.round_started = self.now()
        periods = [int(a.info["period"]) for a in acks if "period" in a.info]
        if periods:
            self.period = min(periods)  # shards decide on their own tensors: the most frequent wins
        out = {"round": self.round, "period": self.period}
        # V of the last closed round, summed over the shards' tensors
        if "variance" in acks[0].info:
            out["variance"] = round(sum(float(a.info.get("variance", 0.0)) for a in acks), 8)
        if "weights" in acks[0].info:
            out.update(weights=acks[0].info["weights"], weights_round=acks[0].info["round"])
        return out

    def final_due(self) -> bool:
        """The run stopped: with `final_average`, between rounds and after local
        steps, the model is pushed once more (`final_request`)."""
        return bool(self.final_average and not self.in_flight and self.steps_in_round)

    def final_request(self) -> RoundRequest:
        """The last push, marked `final`, whose mean nobody waits for."""
        return self.model_values(), self.round, self.n_samples(), {**self.info(), "final": True}


class DilocoRounds(LocalRounds):
    """diloco's rounds: H_i local steps of the inner optimizer (`optimizer:`),
    then a push of the pseudo-gradient (start - end of the round's parameters,
    current buffers) and the new global model taken as the next round's start.

    H_i (`period`): `algorithm.period` for the plan's fastest worker and, with
    `steps_by_speed`, period x speed_i / fastest for the others (at least
    `min_period`), from the speeds `plan` carries; `use_plan` follows new plans."""

    def __init__(
        self, cfg: RunConfig, work: GradientStep, now: Callable[[], float], plan: ClusterPlan
    ):
        super().__init__(cfg, work, now)
        self.period = self.period_for(plan)
        self.start_values: dict[str, torch.Tensor] = {}

    def period_for(self, plan: ClusterPlan) -> int:
        """This worker's local steps per round under `plan`."""
        p = self.cfg.algorithm.params
        if not p.steps_by_speed:
            return p.period
        speeds = [plan.speeds.get(str(w), 0.0) for w in plan.worker_ids()]
        return local_steps(
            plan.speeds.get(str(self.work.node_id), 0.0),
            max(speeds, default=0.0),
            p.period,
            p.min_period,
        )

    def use_plan(self, plan: ClusterPlan) -> None:
        """The worker switched to `plan` (GradientStep.use_plan): its H_i."""
        self.period = self.period_for(plan)

    def begin(self) -> None:
        """The shards' initial values are loaded: the first round starts from them."""
        super().begin()
        self.start_values = self.params()

    def params(self) -> dict[str, torch.Tensor]:
        """Copies (CPU) of every parameter."""
        return {
            n: t.detach().to("cpu", copy=True)
            for n, (t, kind) in self.state.tensors.items()
            if kind == "param"
        }

    def pseudo_gradient(self) -> dict[str, torch.Tensor]:
        """start - end for every parameter, current values for every buffer (CPU)."""
        out = {}
        for n, (t, kind) in self.state.tensors.items():
            now = t.detach().to("cpu", copy=True)
            out[n] = self.start_values[n] - now if kind == "param" else now
        return out

    def due(self) -> bool:
        return self.steps_in_round >= self.period

    def n_samples(self) -> int:
        """Examples the round's push stands for (the plan's batch per step, times
        data.accumulate)."""
        return self.steps_in_round * self.work.step_samples

    def request(self) -> RoundRequest:
        """This round's push (the pseudo-gradient); in flight until `take`."""
        self.in_flight = True
        return self.pseudo_gradient(), self.round, self.n_samples(), self.info()

    def take(self, acks: list[Ack], values: dict[str, torch.Tensor]) -> dict:
        """Load the new global model and start the next round from it; returns
        fields for the step record (the loop adds the ACKs' staleness)."""
        self.in_flight = False
        self.state.load(values)
        self.start_values = self.params()
        self.round += 1
        self.steps_in_round = 0
        return {"round": self.round, "period": self.period}
