"""Rules of model averaging, as small pure classes and functions:

- period rules say how many local steps the next round runs (cpsgd, adpsgd);
- weight rules say how much each worker's model counts in a round's mean
  (wpsgd, simuparallel).

A period rule has `warmup_rounds` (rounds run at period 1 before it decides),
`observe(variance, period, lr)` (called when a round closes) and
`next_period(steps_done, rounds_done) -> int`. Not thread-safe.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from .policy_state import storable


@storable
class ConstantPeriod:
    """cpsgd: every round runs `period` local steps."""

    def __init__(self, period: int):
        self.period = period
        self.warmup_rounds = 0

    def observe(self, variance: float, period: int, lr: float) -> None:
        """A constant period ignores the models' spread."""

    def next_period(self, steps_done: int, rounds_done: int) -> int:
        return self.period


@storable
class VariancePeriod:
    """adpsgd: the period grows as the workers' models stop drifting apart.

    Signal: v = V / tau, the spread of the models per local step, where V is
    the round's mean squared distance of the models to their mean and tau the
    round's period (models start each round equal, so V grows with tau),
    smoothed by a moving average that gives the newest round weight
    `smoothing` (1 = none).

    Rule, in order:
    1. Warm-up: the first `warmup_rounds` rounds run at period 1 (the policy
       does not ask the rule before).
    2. Proposal: ceil(base_period * v_peak / v), v_peak the largest smoothed
       spread seen so far, capped at `max_period`: period 1 while the spread
       rises (early training), growing as it falls from its peak.
    3. The period never decreases: max(proposal, previous period).
    4. Budget: with `budget_rounds` R and `horizon_steps` H (both > 0), at
       most R rounds end within the first H local steps. Short periods are
       spent early, as long as the rest of the horizon could still be covered
       at `max_period` M: after s local steps and r rounds the period is at
       least H - s - (R - r - 1) * M (and H - s + 1, i.e. past the horizon,
       when no round is left). Past H the budget no longer binds. The config
       check makes the budget feasible: R >= warm-up + ceil((H - warm-up) / M).
    5. Learning-rate change: v scales with lr^2, so when the reported lr goes
       from a to b, the peak and the average are rescaled by (b / a)^2; a
       schedule's decay alone does not stretch the period.
    """

    def __init__(
        self,
        warmup_rounds: int = 4,
        base_period: float = 1.0,
        max_period: int = 32,
        budget_rounds: int = 0,
        horizon_steps: int = 0,
        smoothing: float = 1.0,
    ):
        self.warmup_rounds = warmup_rounds
        self.base_period = base_period
        self.max_period = max_period
        self.budget_rounds = budget_rounds
        self.horizon_steps = horizon_steps
        self.smoothing = smoothing
        self.spread: float | None = None  # smoothed v
        self.peak = 0.0
        self.lr: float | None = None
        self.last = 1

    @classmethod
    def from_params(cls, params) -> "VariancePeriod":
        return cls(
            params.warmup_rounds,
            params.base_period,
            params.max_period,
            params.budget_rounds,
            params.horizon_steps,
            params.smoothing,
        )

    def observe(self, variance: float, period: int, lr: float) -> None:
        v = variance / max(1, period)
        if self.lr and lr and lr != self.lr:
            scale = (lr / self.lr) ** 2
            self.peak *= scale
            self.spread = self.spread * scale if self.spread is not None else None
        self.lr = lr or self.lr
        self.spread = v if self.spread is None else self.spread + self.smoothing * (v - self.spread)
        self.peak = max(self.peak, self.spread)

    def budget_floor(self, steps_done: int, rounds_done: int) -> int:
        r, h = self.budget_rounds, self.horizon_steps
        if r <= 0 or h <= 0 or steps_done >= h:
            return 1
        after = r - rounds_done - 1  # rounds the budget still allows after this one
        if after < 0:
            return h - steps_done + 1  # no round may end within the horizon any more
        return max(1, h - steps_done - after * self.max_period)

    def next_period(self, steps_done: int, rounds_done: int) -> int:
        proposal = 1
        if self.spread is not None and self.peak > 0:
            ratio = self.peak / self.spread if self.spread > 0 else math.inf
            x = self.base_period * ratio
            # float noise: 2.0000001 is 2
            proposal = min(self.max_period, max(1, math.ceil(x - 1e-6 * x)))
        self.last = max(proposal, self.last, self.budget_floor(steps_done, rounds_done))
        return self.last


PERIOD_RULES: dict[str, Callable] = {"variance": VariancePeriod.from_params}


# ------------------------------------------------------------ weight rules


def equal_weights(steps: Sequence[int], lr: float, weight_decay: float) -> list[float]:
    """simuparallel: every model counts the same."""
    return [1.0 / len(steps)] * len(steps)


def step_weights(steps: Sequence[int], lr: float, weight_decay: float) -> list[float]:
    """W_i proportional to T_i, the local steps since the last average."""
    total = sum(steps)
    return [t / total for t in steps] if total > 0 else equal_weights(steps, lr, weight_decay)


def wpsgd_weights(steps: Sequence[int], lr: float, weight_decay: float) -> list[float]:
    """WP-SGD: W_i proportional to 1 - (1 - lr * weight_decay)^T_i: how far a
    model moved away from the shared start, which decays by (1 - lr * wd) per
    step. With weight_decay 0 (or lr * wd >= 1) this degenerates, and the
    weights fall back to W_i proportional to T_i."""
    decay = 1.0 - lr * weight_decay
    if not 0.0 < decay < 1.0:
        return step_weights(steps, lr, weight_decay)
    raw = [1.0 - decay**t for t in steps]
    total = sum(raw)
    return [w / total for w in raw] if total > 0 else equal_weights(steps, lr, weight_decay)


WEIGHT_RULES: dict[str, Callable[[Sequence[int], float, float], list[float]]] = {
    "wpsgd": wpsgd_weights,
    "steps": step_weights,
    "equal": equal_weights,
}
