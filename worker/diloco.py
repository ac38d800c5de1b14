"""The worker's loop for diloco: H_i local steps of the inner optimizer (the
`optimizer:` block, e.g. AdamW-like `adam` with weight decay, or SGD), then a
push of the pseudo-gradient, start - end of the round's parameters (and the
current buffers), and a pull of the new global model, which the next round
starts from. The inner optimizer's state is kept across rounds (DiLoCo).

H_i: `algorithm.period` for the fastest worker of the plan and, with
`steps_by_speed`, period x speed_i / fastest for the others (at least
`min_period`), from the speeds the plan carries, so every worker's round
takes about the same time (Dynamic Local Updates, arXiv 2401.09135).
Pseudo-gradients are compressed like gradients (`comm.compression`).

Blocking; returns when the scheduler asks the cluster to stop.
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch

from hetps.proto.plan import ClusterPlan
from hetps.proto.rpc import Aborted
from hetps.runtime.speed_shares import local_steps

from .local import LocalSgdTrainer
from .trainer import Trainer

log = logging.getLogger(__name__)


class DilocoTrainer(LocalSgdTrainer):
    def __init__(self, *args):
        super().__init__(*args)
        self.period = self.period_for(self.client.plan)
        self.start_values: dict[str, torch.Tensor] = {}

    def period_for(self, plan: ClusterPlan) -> int:
        """This worker's local steps per round under `plan`."""
        p = self.cfg.algorithm.params
        if not p.steps_by_speed:
            return p.period
        speeds = [plan.speeds.get(str(w), 0.0) for w in plan.worker_ids()]
        return local_steps(plan.speeds.get(str(self.member.node_id), 0.0), max(speeds, default=0.0),
                           p.period, p.min_period)

    def use_plan(self, plan: ClusterPlan) -> None:
        Trainer.use_plan(self, plan)  # not super(): the simulated worker borrows this method
        if hasattr(self, "start_values"):  # not while constructing: __init__ sets the period
            self.period = self.period_for(plan)

    def params(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().to("cpu", copy=True) for n, (t, kind) in self.state.tensors.items() if kind == "param"}

    def pseudo_gradient(self) -> dict[str, torch.Tensor]:
        """start - end for every parameter, current values for every buffer (CPU)."""
        out = {}
        for n, (t, kind) in self.state.tensors.items():
            now = t.detach().to("cpu", copy=True)
            out[n] = self.start_values[n] - now if kind == "param" else now
        return out

    def due(self) -> bool:
        return self.steps_in_round >= self.period

    def round_request(self) -> tuple[dict, int, int, dict]:
        """What this round's push carries: (pseudo-gradient, clock, n_samples, info)."""
        return self.pseudo_gradient(), self.round, self.steps_in_round * self.batch_size, self.info()

    def sync_round(self) -> dict:
        """Push the pseudo-gradient, load the new global model; fields for the step record."""
        acks, values = self.client.push_pull(*self.round_request())
        return self.take_round(acks, values)

    def take_round(self, acks: list, values: dict) -> dict:
        """Load the new global model, start the next round from it; fields for the step record."""
        self.state.load(values)
        self.start_values = self.params()
        self.round += 1
        self.steps_in_round = 0
        if acks:
            self.staleness = max(a.staleness for a in acks)
            self.member.note_plan(max(a.plan_id for a in acks))
        return {"round": self.round, "period": self.period, "staleness": self.staleness}

    def run(self) -> None:
        self.start()
        self.start_values = self.params()
        with contextlib.suppress(Aborted):  # stop came while a push was waiting
            while not self.member.stop_requested.is_set():
                newer = self.member.newer_plan(self.client.plan.plan_id)
                if newer is not None and self.member.node_id not in newer.worker_ids():
                    log.warning("not a worker of plan %d any more: stopping", newer.plan_id)
                    break
                if newer is not None:  # between rounds' steps: the next push goes out under it
                    self.use_plan(newer)
                started = time.perf_counter()
                loss, compute_s = self.local_step()
                record = {"worker": self.member.rank, "step": self.clock, "loss": round(loss, 5),
                          "staleness": self.staleness, "compute_s": round(compute_s, 5), **self.norm_record()}
                push_s = 0.0
                if self.due():
                    record.update(self.sync_round())
                    push_s = self.client.last_push_s
                self.timer.update(compute_s, push_s, time.perf_counter() - started)
                record["step_s"] = round(time.perf_counter() - started, 5)
                self.member.add_record(record)
