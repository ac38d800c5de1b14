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

The local steps and the rounds' logic are step.py's `DilocoRounds` (the
simulator runs them too); this loop adds the I/O: PSClient, membership,
new plans, the wall clock. Blocking; returns when the scheduler asks the
cluster to stop.
"""

from __future__ import annotations

import contextlib
import logging
import time

from hetps.proto.plan import ClusterPlan
from hetps.proto.rpc import Aborted
from hetps.training.step import DilocoRounds

from .local import LocalSgdTrainer

log = logging.getLogger(__name__)


class DilocoTrainer(LocalSgdTrainer):
    rounds: DilocoRounds

    def make_rounds(self, plan: ClusterPlan) -> DilocoRounds:
        """The inner optimizer and diloco's rounds, H_i from `plan`."""
        return DilocoRounds(self.cfg, self.work, time.monotonic, plan)

    def use_plan(self, plan: ClusterPlan) -> None:
        """Switch to a newer `plan` between steps: share and batch, and H_i."""
        super().use_plan(plan)
        self.rounds.use_plan(plan)

    def sync_round(self) -> dict:
        """Push the pseudo-gradient, load the new global model; fields for the step record."""
        acks, values = self.client.push_pull(*self.rounds.request())
        fields = self.rounds.take(acks, values)
        if acks:
            self.staleness = max(a.staleness for a in acks)
            self.member.note_plan(max(a.plan_id for a in acks))
        return {**fields, "staleness": self.staleness}

    def run(self) -> None:
        self.start()
        self.rounds.begin()
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
                record = {
                    "worker": self.member.rank,
                    "step": self.clock,
                    "loss": round(loss, 5),
                    "staleness": self.staleness,
                    "compute_s": round(compute_s, 5),
                    **self.work.norm_record(),
                }
                push_s = 0.0
                if self.rounds.due():
                    record.update(self.sync_round())
                    push_s = self.client.last_push_s
                self.timer.update(compute_s, push_s, time.perf_counter() - started)
                record["step_s"] = round(time.perf_counter() - started, 5)
                self.member.add_record(record)
