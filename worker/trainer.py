"""The training worker's loop for gradient-pushing algorithms (sync, async,
ssp): compute a gradient on its data share, push it, pull fresh values.

Blocking; returns when the scheduler asks the cluster to stop.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from hetps.proto.config import NodeConfig, RunConfig
from hetps.proto.membership import Membership
from hetps.proto.plan import ClusterPlan

from .client import PSClient
from .data import BatchStream, Datasets, partition
from .state import ModelState

log = logging.getLogger(__name__)


class StepTimer:
    """Exponential moving averages of compute and step times (seconds)."""

    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self.compute_s = 0.0
        self.step_s = 0.0

    def update(self, compute_s: float, step_s: float) -> None:
        a = self.alpha if self.step_s else 1.0
        self.compute_s += a * (compute_s - self.compute_s)
        self.step_s += a * (step_s - self.step_s)


class Trainer:
    def __init__(self, cfg: RunConfig, node: NodeConfig, member: Membership, plan: ClusterPlan,
                 state: ModelState, data: Datasets):
        self.cfg = cfg
        self.node = node
        self.member = member
        self.state = state
        self.index = plan.worker_ids().index(member.node_id)
        shard_ids = partition(len(data.train), self.index, len(plan.workers), cfg.seed)
        self.stream = BatchStream(data.train, shard_ids, cfg.data.batch_size, cfg.seed + 1000 * self.index)
        self.client = PSClient(plan, member.node_id, cfg.cluster, member.stop_requested.is_set)
        self.timer = StepTimer()
        self.clock = 0

    def stats(self) -> dict:
        return {"steps": self.clock, "bytes_sent": self.client.bytes_sent,
                "bytes_received": self.client.bytes_received, "step_time_s": self.timer.step_s,
                "compute_s": self.timer.compute_s,
                "samples_per_s": self.cfg.data.batch_size / self.timer.step_s if self.timer.step_s else 0.0}

    def compute(self) -> float:
        """Forward and backward on one batch; returns the loss."""
        x, y = self.stream.next_batch()
        x, y = x.to(self.state.device, non_blocking=True), y.to(self.state.device, non_blocking=True)
        model = self.state.model
        model.train()
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return float(loss.detach())

    def run(self) -> None:
        self.client.init(self.state.values())
        self.state.load(self.client.pull(0))
        while not self.member.stop_requested.is_set():
            started = time.perf_counter()
            loss = self.compute()
            compute_s = time.perf_counter() - started
            if self.node.slowdown > 1.0:
                time.sleep(compute_s * (self.node.slowdown - 1.0))
            acks, values = self.client.push_pull(self.state.outgoing(), self.clock, self.cfg.data.batch_size)
            self.state.load(values)
            self.clock += 1
            self.timer.update(compute_s, time.perf_counter() - started)
            self.member.add_record({"worker": self.index, "step": self.clock, "loss": round(loss, 5),
                                    "staleness": max(a.staleness for a in acks),
                                    "compute_s": round(compute_s, 5),
                                    "step_s": round(time.perf_counter() - started, 5)})

    def close(self) -> None:
        self.client.close()
