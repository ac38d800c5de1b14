"""The training worker's loop for gradient-pushing algorithms (sync, async,
ssp): compute a gradient on its data share, push it, pull fresh values.

Blocking; returns when the scheduler asks the cluster to stop.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from typing import ContextManager

import torch
import torch.nn.functional as F

from hetps.runconfig.algorithms import algorithm
from hetps.proto.compression import make_compressor
from hetps.runconfig.schema import NodeConfig, RunConfig
from hetps.runtime.emulation import Slowdown, work_clock
from hetps.runtime.histogram import Histogram
from hetps.runtime.membership import Membership
from hetps.proto.messages import Ack
from hetps.proto.plan import ClusterPlan

from .client import PSClient
from .data import BatchStream, Datasets, partition
from .state import ModelState
from .straggler import straggle

log = logging.getLogger(__name__)


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
        self.durations = {key: Histogram() for key in ("step_s", "compute_s", "push_s", "round_wait_s")}

    def update(self, compute_s: float, push_s: float, step_s: float) -> None:
        a = self.alpha if self.step_s else 1.0
        self.compute_s += a * (compute_s - self.compute_s)
        self.push_s += a * (push_s - self.push_s)
        self.step_s += a * (step_s - self.step_s)
        observed = {"step_s": step_s, "compute_s": compute_s, "push_s": push_s,
                    "round_wait_s": max(0.0, step_s - compute_s - push_s)}
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


def autocast(kind: str, device: torch.device) -> ContextManager:
    """`model.autocast`: the context a training forward pass runs in (bfloat16
    needs no loss scaling: it has float32's range)."""
    if kind == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


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


def profile_speed(state: ModelState, data: Datasets, batch_size: int, steps: int,
                  slowdown: Slowdown, precision: str = "none") -> float:
    """Samples per second of forward+backward on the real model and data,
    stretched by the emulated slowdown (on a copy: the model is untouched)."""
    model = copy.deepcopy(state.model).train()
    stream = BatchStream(data.train, torch.arange(len(data.train)), batch_size, seed=0)
    busy = 0.0
    device = str(state.device)
    for i in range(steps + 1):
        x, y = stream.next_batch()
        started = work_clock(device)
        model.zero_grad(set_to_none=True)
        with autocast(precision, state.device):
            loss = F.cross_entropy(model(x.to(state.device)), y.to(state.device))
        loss.backward()
        if i:  # the first step warms up allocators and kernels
            busy += work_clock(device) - started
    return steps * batch_size / max(busy * slowdown.factor(), 1e-9)


class Trainer:
    # keep each shard's parameters and gradients in one buffer in the wire's layout (flat_model.py);
    # loops that hand gradients out tensor by tensor (comm.overlap) or step a local optimizer do not
    FLAT = True

    def __init__(self, cfg: RunConfig, node: NodeConfig, member: Membership, plan: ClusterPlan,
                 state: ModelState, data: Datasets):
        self.cfg = cfg
        self.member = member
        self.state = state
        self.data = data
        self.slowdown = Slowdown(node)
        self.device = str(state.device)
        algo = algorithm(cfg.algorithm.name)
        # `comm.compression` applies to gradients; models travel exact
        compressor = make_compressor(cfg.comm.compression, cfg.comm.topk_ratio) if algo.pushes == "gradients" else None
        self.client = PSClient(plan, member.node_id, cfg.cluster, self.should_abort, compressor,
                               fuse_pull=cfg.comm.fuse_pull and algo.fuses_pull,
                               plans=member.newer_plan if cfg.cluster.replicas else None)
        self.timer = StepTimer()
        self.clock = 0
        self.staleness = 0   # the shards' staleness for our last push
        self.samples = 0     # training examples computed on, all plans together
        self.clipped = clipped_params(cfg, state)
        self.grad_norm: float | None = None  # the last gradient's L2 norm before clipping
        self.use_plan(plan)
        if self.FLAT and compressor is None:  # the placement never changes for a client (PSClient.adopt)
            state.lay_out_flat(self.client.names)

    def use_plan(self, plan: ClusterPlan) -> None:
        """Take this worker's group and data share from `plan`."""
        self.client.adopt(plan)
        self.index = plan.worker_ids().index(self.member.node_id)
        self.group = plan.group_of(self.member.node_id)
        share = partition(len(self.data.train), self.index, len(plan.workers), self.cfg.seed,
                          plan.share_weights())
        old_batch = getattr(self, "batch_size", 0)
        self.batch_size = plan.batch_of(self.member.node_id, self.cfg.data.batch_size)  # balanced: per worker
        if old_batch and old_batch != self.batch_size:
            self.timer.rescale(self.batch_size / old_batch)
        self.stream = BatchStream(self.data.train, share, self.batch_size,
                                  self.cfg.seed + 1000 * self.index + plan.plan_id)

    def stats(self) -> dict:
        return {"steps": self.clock, "bytes_sent": self.client.bytes_sent,
                "bytes_received": self.client.bytes_received, "step_time_s": self.timer.step_s,
                "compute_s": self.timer.compute_s, "plan_id": self.client.plan.plan_id, "group": self.group,
                "staleness": self.staleness,
                "speed": self.timer.speed(self.batch_size), "push_s": self.timer.push_s,
                "samples": self.samples,
                **self.client.fault_stats(), **self.client.compression_stats(),
                "samples_per_s": self.batch_size / self.timer.step_s if self.timer.step_s else 0.0}

    def compute(self) -> float:
        """Forward and backward on one batch; returns the loss."""
        x, y = self.stream.next_batch()
        self.samples += len(y)
        x, y = x.to(self.state.device, non_blocking=True), y.to(self.state.device, non_blocking=True)
        model = self.state.model
        model.train()
        self.state.zero_grad()
        with autocast(self.cfg.model.autocast, self.state.device):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        if self.clipped:
            self.clip_gradients()
        return float(loss.detach())

    def clip_gradients(self) -> None:
        """Scale the gradient to at most `optimizer.clip_grad_norm` (its L2 norm
        over every parameter); keep the norm it had for the step record. Each
        worker clips its own gradient, before a round averages it (DDP clips
        the average)."""
        self.grad_norm = clip_to_norm([p.grad for p in self.clipped if p.grad is not None],
                                      self.cfg.optimizer.clip_grad_norm)

    def should_abort(self) -> bool:
        """Checked by every wait on a shard: true once the run is stopping."""
        return self.member.stop_requested.is_set()

    def start(self) -> None:
        """Offer initial values, load the shards' (the first offer wins), start the clocks."""
        self.client.init(self.state.values())
        self.state.load(self.client.pull(0))
        self.slowdown.start()

    def exchange(self) -> tuple[list[Ack], float]:
        """Push this step's gradients and buffers, then load the values for the
        next step (blocking). Returns the push ACKs and the seconds until they came."""
        acks, values = self.client.push_pull(self.state.outgoing(), self.clock, self.batch_size)
        self.state.load(values)
        return acks, self.client.last_push_s

    def record(self, loss: float, compute_s: float, started: float) -> dict:
        """The step record sent to the scheduler."""
        return {"worker": self.member.rank, "step": self.clock, "loss": round(loss, 5),
                "staleness": self.staleness, "group": self.group, "compute_s": round(compute_s, 5),
                "step_s": round(time.perf_counter() - started, 5), **self.norm_record()}

    def norm_record(self) -> dict:
        """`grad_norm` (before clipping) for a step record, when clipping is on;
        null when it was not finite."""
        if self.grad_norm is None:
            return {}
        return {"grad_norm": round(self.grad_norm, 6) if math.isfinite(self.grad_norm) else None}

    def run(self) -> None:
        self.start()
        while not self.member.stop_requested.is_set():
            newer = self.member.newer_plan(self.client.plan.plan_id)
            if newer is not None and self.member.node_id not in newer.worker_ids():
                log.warning("not a worker of plan %d any more: stopping", newer.plan_id)
                break
            if newer is not None:  # between steps: our previous push is fully applied
                self.use_plan(newer)
                log.info("switched to plan %d: group %d", newer.plan_id, self.group)
            started, work_started = time.perf_counter(), work_clock(self.device)
            loss = self.compute()
            compute_s = self.slowdown.stretch(work_clock(self.device) - work_started)
            compute_s += straggle(self.cfg, self.index, self.clock, compute_s)
            acks, push_s = self.exchange()
            self.clock += 1
            if acks:
                self.staleness = max(a.staleness for a in acks)
                # a shard that adopted a newer plan says so in its ACK: switch before the next push
                # instead of at the next heartbeat (a push under the old plan is applied alone)
                self.member.note_plan(max(a.plan_id for a in acks))
            self.timer.update(compute_s, push_s, time.perf_counter() - started)
            self.member.add_record(self.record(loss, compute_s, started))

    def close(self) -> None:
        self.client.close()
