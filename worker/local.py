"""The worker's loop for model-averaging algorithms (cpsgd, adpsgd, wpsgd,
simuparallel): local SGD with a torch optimizer on this worker's data share,
and every period a push of the MODEL (parameters and buffers) followed by a
pull of the shards' (weighted) mean, which replaces the local model. The
local optimizer's state (momentum) is kept across averages.

Periods: cpsgd and adpsgd count local steps (`algorithm.period`; adpsgd
starts at 1 and takes the smallest period the shards' ACKs propose); wpsgd
and simuparallel count seconds (`algorithm.period_s`; 0 = never during the
run). With `final_average`, a worker that stops between averages pushes its
model once more (not waiting for the mean), so the shards' last round
averages the final models; best effort: it completes only if every worker
gets to push.

Every push carries `info`: steps (local steps since the last average), lr,
weight_decay and period. The local steps and the rounds' logic are
step.py's `LocalRounds` (the simulator runs them too); this loop adds the
I/O: PSClient, membership, the wall clock. Blocking; returns when the
scheduler asks the cluster to stop.
"""

from __future__ import annotations

import contextlib
import logging
import time

from hetps.proto.plan import ClusterPlan
from hetps.proto.rpc import Aborted, RemoteError, RequestTimeout
from hetps.runconfig.schema import NodeConfig, RunConfig
from hetps.runtime.emulation import work_clock
from hetps.runtime.membership import Membership
from hetps.training.data import Datasets
from hetps.training.state import ModelState
from hetps.training.step import LocalRounds
from hetps.training.straggler import straggle

from .client import PSClient
from .trainer import Trainer

log = logging.getLogger(__name__)


class LocalSgdTrainer(Trainer):
    FLAT = False  # per-tensor gradients (see Trainer.FLAT)

    def __init__(
        self,
        cfg: RunConfig,
        node: NodeConfig,
        member: Membership,
        plan: ClusterPlan,
        state: ModelState,
        data: Datasets,
    ):
        super().__init__(cfg, node, member, plan, state, data)
        self.rounds = self.make_rounds(plan)

    def make_rounds(self, plan: ClusterPlan) -> LocalRounds:
        """The local optimizer and the rounds' logic this loop runs (periods in wall seconds)."""
        return LocalRounds(self.cfg, self.work, time.monotonic)

    def stats(self) -> dict:
        return {**super().stats(), "rounds": self.rounds.round, "period": self.rounds.period}

    def local_step(self) -> tuple[float, float]:
        """One local optimizer step; returns (loss, compute seconds incl. emulated slowness)."""
        work_started = work_clock(self.device)
        loss = self.rounds.step()
        self.clock += 1
        compute_s = self.slowdown.stretch(work_clock(self.device) - work_started)
        compute_s += straggle(self.cfg, self.work.index, self.clock - 1, compute_s)
        return loss, compute_s

    def average(self) -> dict:
        """Push the model, load the mean; returns fields for the step record."""
        acks, values = self.client.push_pull(*self.rounds.request())
        return self.rounds.take(acks, values)

    def run(self) -> None:
        self.start()
        self.rounds.begin()
        with contextlib.suppress(Aborted):  # stop came while an average was waiting
            while not self.member.stop_requested.is_set():
                started = time.perf_counter()
                loss, compute_s = self.local_step()
                record = {
                    "worker": self.member.rank,
                    "step": self.clock,
                    "loss": round(loss, 5),
                    "staleness": 0,
                    "compute_s": round(compute_s, 5),
                    **self.work.norm_record(),
                }
                if self.rounds.due():
                    record.update(self.average())
                self.timer.update(compute_s, 0.0, time.perf_counter() - started)
                record["step_s"] = round(time.perf_counter() - started, 5)
                self.member.add_record(record)
        if self.rounds.final_due():
            self.push_final()

    def push_final(self) -> None:
        """Push the model for the last round without waiting for its mean
        (a client that ignores the stop flag; every wait still has a deadline)."""
        client = PSClient(
            self.client.plan, self.member.node_id, self.cfg.cluster, transport=self.client.transport
        )
        client.versions = list(self.client.versions)
        try:
            client.push(*self.rounds.final_request())
            log.info("pushed the final model for round %d", self.rounds.round)
        except (RequestTimeout, RemoteError) as exc:
            log.warning("final average skipped: %s", exc)
        finally:
            client.close()
