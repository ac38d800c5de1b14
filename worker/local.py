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
weight_decay and period. Blocking; returns when the scheduler asks the
cluster to stop.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hetps.runconfig.algorithms import algorithm
from hetps.runconfig.schema import NodeConfig, RunConfig
from hetps.runtime.optim import build_lr_scheduler, build_optimizer
from hetps.runtime.emulation import work_clock
from hetps.runtime.membership import Membership
from hetps.proto.plan import ClusterPlan
from hetps.proto.rpc import Aborted, RemoteError, RequestTimeout

from .client import PSClient
from .data import Datasets
from .state import ModelState
from .straggler import straggle
from .trainer import Trainer

log = logging.getLogger(__name__)


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


class LocalSgdTrainer(Trainer):
    FLAT = False  # per-tensor gradients (see Trainer.FLAT)

    def __init__(self, cfg: RunConfig, node: NodeConfig, member: Membership, plan: ClusterPlan,
                 state: ModelState, data: Datasets):
        super().__init__(cfg, node, member, plan, state, data)
        self.now = time.monotonic  # seconds for time-based periods; virtual under `hetps simulate`
        self.init_local()

    def init_local(self) -> None:
        """The local optimizer and the round bookkeeping (reads cfg, state, now;
        the simulated worker calls it too)."""
        self.optimizer = build_optimizer(list(self.state.model.parameters()), self.cfg.optimizer)
        self.scheduler = build_lr_scheduler(self.optimizer, self.cfg.optimizer.schedule)
        period = PERIODS[algorithm(self.cfg.algorithm.name).period](self.cfg.algorithm.params)
        self.period_s = period.seconds   # time-based periods
        self.period = period.steps       # step-based periods
        self.final_average = period.final_average
        self.round = 0            # averages this worker took part in (= its push clock)
        self.steps_in_round = 0
        self.round_started = self.now()
        self.in_flight = False    # a push was sent whose mean has not come back

    def stats(self) -> dict:
        return {**super().stats(), "rounds": self.round, "period": self.period}

    def model_values(self) -> dict[str, torch.Tensor]:
        """Copies (CPU) of every parameter and buffer: what an average needs."""
        return {n: t.detach().to("cpu", copy=True) for n, (t, _) in self.state.tensors.items()}

    def due(self) -> bool:
        if self.period_s is not None:
            return self.period_s > 0 and self.now() - self.round_started >= self.period_s
        return self.steps_in_round >= self.period

    def info(self) -> dict:
        return {"steps": self.steps_in_round, "period": self.steps_in_round,
                "lr": self.optimizer.param_groups[0]["lr"], "weight_decay": self.cfg.optimizer.weight_decay}

    def local_step(self) -> tuple[float, float]:
        """One local optimizer step; returns (loss, compute seconds incl. emulated slowness)."""
        work_started = work_clock(self.device)
        loss = self.optimizer_step()
        compute_s = self.slowdown.stretch(work_clock(self.device) - work_started)
        compute_s += straggle(self.cfg, self.index, self.clock - 1, compute_s)
        return loss, compute_s

    def optimizer_step(self) -> float:
        """Forward, backward and a step of the local optimizer and its lr
        schedule; counts the step. Returns the loss."""
        loss = self.compute()
        self.optimizer.step()
        self.scheduler.step()
        self.clock += 1
        self.steps_in_round += 1
        return loss

    def average(self) -> dict:
        """Push the model, load the mean; returns fields for the step record."""
        self.in_flight = True
        acks, values = self.client.push_pull(*self.average_request())
        return self.take_average(acks, values)

    def average_request(self) -> tuple[dict, int, int, dict]:
        """What this round's push carries: (model, clock, n_samples, info)."""
        return self.model_values(), self.round, self.steps_in_round * self.cfg.data.batch_size, self.info()

    def take_average(self, acks: list, values: dict) -> dict:
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
        if "variance" in acks[0].info:  # V of the last closed round, summed over the shards' tensors
            out["variance"] = round(sum(float(a.info.get("variance", 0.0)) for a in acks), 8)
        if "weights" in acks[0].info:
            out.update(weights=acks[0].info["weights"], weights_round=acks[0].info["round"])
        return out

    def run(self) -> None:
        self.client.init(self.state.values())
        self.state.load(self.client.pull(0))
        self.slowdown.start()
        self.round_started = self.now()
        with contextlib.suppress(Aborted):  # stop came while an average was waiting
            while not self.member.stop_requested.is_set():
                started = time.perf_counter()
                loss, compute_s = self.local_step()
                record = {"worker": self.member.rank, "step": self.clock, "loss": round(loss, 5), "staleness": 0,
                          "compute_s": round(compute_s, 5), **self.norm_record()}
                if self.due():
                    record.update(self.average())
                self.timer.update(compute_s, 0.0, time.perf_counter() - started)
                record["step_s"] = round(time.perf_counter() - started, 5)
                self.member.add_record(record)
        if self.final_average and not self.in_flight and self.steps_in_round:
            self.push_final()

    def push_final(self) -> None:
        """Push the model for the last round without waiting for its mean
        (a client that ignores the stop flag; every wait still has a deadline)."""
        client = PSClient(self.client.plan, self.member.node_id, self.cfg.cluster)
        client.versions = list(self.client.versions)
        try:
            client.push(self.model_values(), self.round, self.steps_in_round * self.cfg.data.batch_size,
                        {**self.info(), "final": True})
            log.info("pushed the final model for round %d", self.round)
        except (RequestTimeout, RemoteError) as exc:
            log.warning("final average skipped: %s", exc)
        finally:
            client.close()
