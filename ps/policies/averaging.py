"""Model-averaging algorithms on the PS: cpsgd, adpsgd, wpsgd, simuparallel.

Workers run a local torch optimizer and push their MODEL (parameters and
buffers) at the end of each local period; the push's `clock` is the worker's
round index and `info` carries `steps` (local steps since the last average),
`lr`, `weight_decay` and `period`. Round r closes when every worker of the
plan pushed round r; the shard then sets its tensors to the (weighted) mean
of the round's models and bumps its version once. A pull after r+1 pushes
waits for round r, so the pull that follows a push returns the mean.

The server optimizer is bypassed: no optimizer step runs on the shard (its
lr, reported in the shard stats, stays the configured base lr). Buffers
follow the same weights as parameters (float buffers: weighted mean over the
workers that sent them; integer buffers: the max).

Replies: a push's ACK carries `info` with the next period (cpsgd, adpsgd)
and, once a round has closed, the last round's weights (in plan worker
order) and spread V. Several shards: each decides on its own tensors; the
worker takes the smallest proposed period, so budgets still hold (every
shard's period is at least the same budget floor, computed from the steps
the workers report).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hetps.proto.codec import ProtocolError
from hetps.proto.messages import Push, Status
from hetps.proto.plan import ClusterPlan
from hetps.ps.averaging_rules import PERIOD_RULES, WEIGHT_RULES, ConstantPeriod
from hetps.ps.policy_state import storable
from hetps.ps.store import TensorStore
from hetps.ps.updater import Updater

from .base import ConsistencyPolicy


@storable
@dataclass
class ModelRound:
    """The models pushed for one round, by worker node id."""

    params: dict = field(default_factory=dict)
    buffers: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)


class ModelAveragingPolicy(ConsistencyPolicy):
    """Round r closes when every worker pushed round r; the shard then holds
    the weighted mean. Subclasses choose the weights (`weights`)."""

    name = "model-averaging"

    def __init__(self, store: TensorStore, updater: Updater, plan: ClusterPlan, params):
        super().__init__(store, updater, plan, params)
        # round index -> its models (pushed: round indexes)
        self.rounds: dict[int, ModelRound] = {}
        self.closed = 0
        self.last_weights: list[float] = []
        self.last_variance = 0.0

    # ------------------------------------------------------------ hooks
    def weights(self, rnd: ModelRound, order: list[int]) -> list[float]:
        return [1.0 / len(order)] * len(order)

    def on_first_push(self, index: int, info: dict) -> None:
        """Called once per round, at its first push, with that push's checked info."""

    def on_close(self, index: int, rnd: ModelRound, variance: float) -> None:
        """Called after round `index` was applied."""

    # ------------------------------------------------------------ policy
    def on_push(self, worker: int, push: Push) -> int:
        info = push.info.as_dict()  # checked at decode (records.PushInfo)
        got = self.accept(worker, push)
        if got.duplicate:
            return got.staleness
        if push.clock not in self.rounds:
            self.rounds[push.clock] = ModelRound()
            self.on_first_push(push.clock, info)
        rnd = self.rounds[push.clock]
        rnd.params[worker] = {n: t.clone() for n, t in got.tensors.items()}
        rnd.buffers[worker] = {n: t.clone() for n, t in got.buffers.items()}
        rnd.info[worker] = info
        while self.closed in self.rounds and set(self.rounds[self.closed].params) >= set(
            self.workers
        ):
            self.close(self.closed)
        return got.staleness

    def admit(self, worker: int, push: Push) -> None:
        if push.clock > self.closed and self.restored:
            # restored from a checkpoint: the workers are rounds ahead on a timeline this shard lost;
            # take up the round they are in
            self.rounds = {k: r for k, r in self.rounds.items() if k >= push.clock}
            self.closed = push.clock
        if push.clock > self.closed:  # a worker pushes round r only after it pulled the mean of r-1
            raise ProtocolError(
                Status.BAD_STATE, f"round {push.clock} is not open (open: {self.closed})"
            )

    def close(self, index: int) -> None:
        rnd = self.rounds.pop(index)
        order = [w for w in self.workers if w in rnd.params]
        weights = self.weights(rnd, order)
        variance = 0.0
        for name in self.store.param_names():
            models = [rnd.params[w][name].to(self.store.tensors[name].dtype) for w in order]
            mean = sum(wt * m for wt, m in zip(weights, models))
            variance += sum(float((m - mean).pow(2).sum()) for m in models) / len(models)
            self.store.tensors[name].copy_(mean)
        self._average_buffers(rnd, order, weights)
        self.store.mark_updated(self.store.param_names())
        self.closed += 1
        self.last_weights = [round(w, 6) for w in weights]
        self.last_variance = variance
        self.on_close(index, rnd, variance)

    def _average_buffers(self, rnd: ModelRound, order: list[int], weights: list[float]) -> None:
        for name in self.store.buffer_names():
            sent = [
                (wt, rnd.buffers[w][name])
                for w, wt in zip(order, weights)
                if name in rnd.buffers[w]
            ]
            if not sent:
                continue
            current = self.store.tensors[name]
            if current.is_floating_point():
                total = sum(wt for wt, _ in sent) or 1.0
                current.copy_(sum(wt * b.to(current.dtype) for wt, b in sent) / total)
            else:
                for _, b in sent:
                    torch.maximum(current, b, out=current)

    def adopt(self, plan: ClusterPlan) -> None:
        for index in sorted(self.rounds):
            if index == self.closed and self.rounds[index].params:
                self.close(index)  # flush: the open round is averaged over the models it has
        super().adopt(plan)

    def pull_ready(self, worker: int, clock: int) -> bool:
        return clock < 0 or self.closed >= clock

    def blockers(self, worker: int, clock: int) -> set[int]:
        """The workers whose models the open round still lacks."""
        if self.pull_ready(worker, clock):
            return set()
        rnd = self.rounds.get(self.closed)
        return set(self.workers) - (set(rnd.params) if rnd is not None else set())

    def reply_info(self, worker: int) -> dict:
        if not self.closed:
            return {}
        return {
            "round": self.closed - 1,
            "weights": self.last_weights,
            "variance": self.last_variance,
        }

    def stats(self) -> dict:
        return {
            **super().stats(),
            "rounds": self.closed,
            "variance": self.last_variance,
            "weights": self.last_weights,
        }


class CpsgdPolicy(ModelAveragingPolicy):
    """Constant-period averaging: equal weights, every round `period` local steps."""

    name = "cpsgd"

    def __init__(self, store: TensorStore, updater: Updater, plan: ClusterPlan, params):
        super().__init__(store, updater, plan, params)
        self.rule = self.make_rule(params)
        self.periods = {0: 1 if self.rule.warmup_rounds else self.rule.next_period(0, 0)}
        self.steps_after: dict[int, int] = {-1: 0}  # round -> local steps at its end

    def make_rule(self, params):
        return ConstantPeriod(params.period)

    def on_first_push(self, index: int, info: dict) -> None:
        # round `index` is running, rounds < index are closed: plan round index+1
        used = info.get("period", self.periods.get(index, 1))
        self.steps_after[index] = self.steps_after.get(index - 1, 0) + used
        nxt = index + 1
        self.periods[nxt] = (
            1
            if nxt < self.rule.warmup_rounds
            else self.rule.next_period(self.steps_after[index], nxt)
        )

    def on_close(self, index: int, rnd: ModelRound, variance: float) -> None:
        info = next(iter(rnd.info.values()), {})
        self.rule.observe(
            variance,
            info.get("period", self.periods.get(index, 1)),
            info.get("lr", self.updater.lr),
        )
        # only rounds from `index` on are asked for again
        for table in (self.periods, self.steps_after):
            for old in [k for k in table if k < index]:
                del table[old]

    def reply_info(self, worker: int) -> dict:
        nxt = self.pushed.get(worker, 0)
        return {**super().reply_info(worker), "period": self.periods.get(nxt, 1)}

    def stats(self) -> dict:
        return {**super().stats(), "period": self.periods[max(self.periods)]}


class AdpsgdPolicy(CpsgdPolicy):
    """Adaptive-period averaging: cpsgd whose next period comes from a period
    rule fed with the spread V of each round (`algorithm.rule`, default
    `variance`: see averaging_rules.VariancePeriod for the exact rule). The
    period of round r+1 is decided at the first push of round r from the
    rounds closed so far (so every worker, and the same push order on every
    shard, gets the same answer); hence V of round r-1 sets round r+1."""

    name = "adpsgd"

    def make_rule(self, params):
        return PERIOD_RULES[params.rule](params)


class WpsgdPolicy(ModelAveragingPolicy):
    """Weighted averaging of unequal amounts of local work: W_i from the
    weight rule `algorithm.weights` (wpsgd: 1 - (1 - lr*wd)^T_i, falling back
    to T_i when wd is 0; steps: T_i; equal), T_i = the worker's local steps
    since the last average, lr and wd as the worker reports them. Also runs
    simuparallel (SimuParallel SGD, Zinkevich et al. 2010), whose parameters
    default to equal weights."""

    name = "wpsgd"

    def weights(self, rnd: ModelRound, order: list[int]) -> list[float]:
        infos = [rnd.info[w] for w in order]
        steps = [i.get("steps", 1) for i in infos]
        lr = infos[0].get("lr", self.updater.lr)
        wd = infos[0].get("weight_decay", 0.0)
        return WEIGHT_RULES[self.params.weights](steps, lr, wd)


POLICIES = {p.name: p for p in (CpsgdPolicy, AdpsgdPolicy, WpsgdPolicy)}
