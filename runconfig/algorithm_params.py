"""The parameters of each algorithm, one frozen dataclass per algorithm,
found by name through the algorithm table (algorithms.py). In YAML they sit beside the name:
`algorithm: {name: ssp, staleness: 3}`. Each rejects a bad value at load
with a ConfigError naming `algorithm.<key>` and the allowed values.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hetps.proto.errors import ConfigError

from .setting import setting


def _fail(path: str, message: str) -> None:
    raise ConfigError(f"{path}: {message}")


def _check_params(prefix: str, params, choices: dict, at_least: dict) -> None:
    """Reject bad algorithm parameters at load, naming each key (all of them at once)."""
    problems = []
    for key, allowed in choices.items():
        if getattr(params, key) not in allowed:
            problems.append(
                f"{prefix}.{key}: unknown value {getattr(params, key)!r}; allowed: {', '.join(allowed)}"
            )
    for key, low in at_least.items():
        if not getattr(params, key) >= low:  # `not >=`: NaN fails too
            problems.append(f"{prefix}.{key}: must be >= {low}, got {getattr(params, key)}")
    if problems:
        raise ConfigError(problems)


# the settings async, ssp and grouping share (a new field object for each class)
def push_scale_lr():
    return setting(
        False, help="staleness-aware: a push computed k updates ago is applied with lr / max(1, k)"
    )


def push_lr_share():
    return setting(
        False,
        help="the lr in the config is sync's: a push is applied with lr / P (its share of a "
        "round of P workers; linear scaling)",
    )


def delay_compensation():
    return setting(
        0.0,
        help="DC-ASGD's lambda (Zheng et al. 2017): an update's gradient g becomes "
        "g + lambda * g * g * (w_now - w_stale), w_stale the values the shard served "
        "after its sender's previous update; 0 = off",
    )


@dataclass(frozen=True)
class SyncParams:
    """Sync-SGD has no parameters."""


@dataclass(frozen=True)
class AsyncParams:
    scale_lr: bool = push_scale_lr()
    lr_share: bool = push_lr_share()
    delay_compensation: float = delay_compensation()

    def __post_init__(self):
        _check_params("algorithm", self, {}, {"delay_compensation": 0.0})


@dataclass(frozen=True)
class SspParams:
    staleness: int = setting(
        2, help="a worker may be at most this many clocks ahead of the slowest"
    )
    scale_lr: bool = push_scale_lr()
    lr_share: bool = push_lr_share()
    delay_compensation: float = delay_compensation()

    def __post_init__(self):
        _check_params("algorithm", self, {}, {"staleness": 0, "delay_compensation": 0.0})


@dataclass(frozen=True)
class GroupingParams:
    groups: int = setting(0, help="number of groups; 0 = chosen automatically (choose_k)")
    max_groups: int = setting(4, help="upper bound when choosing automatically")
    choose_k: str = setting(
        "ratio",
        help='auto k: "ratio" (smallest k with homogeneous groups) | "ch" (Calinski-Harabasz)',
    )
    scale_lr: bool = setting(True, help="a group's update uses lr / staleness")
    momentum_correction: bool = setting(
        False,
        help="a group's update uses momentum max(0, m - (1 - 1/G)) for G groups: explicit plus "
        "the asynchrony's implicit momentum stays at the configured m (Adam: its first beta)",
    )
    lr_share: bool = setting(
        False,
        help="the lr in the config is sync's: a group's update uses lr x members / P (its share "
        "of a round of all P workers; linear scaling), times 1 / staleness with scale_lr",
    )
    optimizer_state: str = setting(
        "per_group",
        help="per_group: each group steps its own optimizer state (momentum, Adam's moments), "
        "the parameters shared | shared: one state for every group's updates",
    )
    delay_compensation: float = delay_compensation()
    regroup: bool = setting(True, help="re-form groups while training when speeds drift")
    hysteresis: float = setting(0.3, help="relative speed change that may trigger re-grouping")
    regroup_every_s: float = setting(
        2.0, help="seconds between the scheduler's checks for drifted speeds"
    )
    confirm_checks: int = setting(
        2, help="a new grouping must come out of this many checks in a row"
    )
    equal_ratio: float = setting(1.5, help="auto mode: fastest/slowest below this means one group")

    def __post_init__(self):
        _check_params(
            "algorithm",
            self,
            {"choose_k": ("ratio", "ch"), "optimizer_state": ("shared", "per_group")},
            {
                "groups": 0,
                "delay_compensation": 0.0,
                "max_groups": 1,
                "hysteresis": 0.0,
                "regroup_every_s": 0.0,
                "confirm_checks": 1,
                "equal_ratio": 1.0,
            },
        )


@dataclass(frozen=True)
class EagerParams:
    quorum: str = setting(
        "majority",
        help="solo: first fresh push closes a round | majority: ceil(P/2) | random initiator",
    )
    limiter: int = setting(
        8, help="every limiter-th round is a full barrier (bounds staleness); 0 = never"
    )
    max_staleness: int = setting(
        0, help="versions; staler pushes are folded or dropped; 0 = the limiter"
    )
    too_stale: str = setting(
        "fold", help="fold: added to the open round like any late push | drop: discarded"
    )
    seed: int = setting(0, help="quorum=random: seeds the per-round initiator draw")

    def __post_init__(self):
        _check_params(
            "algorithm",
            self,
            {"quorum": ("solo", "majority", "random"), "too_stale": ("fold", "drop")},
            {"limiter": 0, "max_staleness": 0},
        )


@dataclass(frozen=True)
class CpsgdParams:
    period: int = setting(8, help="local steps between model averages")

    def __post_init__(self):
        _check_params("algorithm", self, {}, {"period": 1})


@dataclass(frozen=True)
class AdpsgdParams:
    rule: str = setting("variance", help="period rule (ps/averaging_rules.py PERIOD_RULES)")
    warmup_rounds: int = setting(4, help="rounds at period 1 before the rule decides")
    base_period: float = setting(
        1.0, help="period = base_period x peak spread / current spread, never shorter ..."
    )
    max_period: int = setting(32, help="... and at most this")
    budget_rounds: int = setting(0, help="at most this many averages end within the first ...")
    horizon_steps: int = setting(0, help="... horizon_steps local steps of a worker; 0 = no budget")
    smoothing: float = setting(
        0.3, help="weight of the newest round in the spread's moving average; 1 = none"
    )

    def __post_init__(self):
        _check_params(
            "algorithm",
            self,
            {"rule": ("variance",)},
            {
                "warmup_rounds": 2,
                "base_period": 1e-9,
                "max_period": 1,
                "budget_rounds": 0,
                "horizon_steps": 0,
                "smoothing": 1e-9,
            },
        )
        if self.smoothing > 1:
            _fail("algorithm.smoothing", f"must be <= 1, got {self.smoothing}")
        if (
            self.budget_rounds and self.horizon_steps
        ):  # warm-up, then the rest at max_period must fit
            need = self.warmup_rounds + -(
                -(self.horizon_steps - self.warmup_rounds) // self.max_period
            )
            if self.budget_rounds < need:
                _fail(
                    "algorithm.budget_rounds",
                    f"must be >= {need} (warm-up, then the horizon at max_period)",
                )


@dataclass(frozen=True)
class WpsgdParams:
    period_s: float = setting(
        2.0, help="seconds of local SGD between averages; 0 = only the final average"
    )
    weights: str = setting(
        "wpsgd", help="wpsgd: 1-(1-lr*wd)^T_i (T_i if wd is 0) | steps: T_i | equal"
    )
    final_average: bool = setting(True, help="one more average when the run stops")

    def __post_init__(self):
        _check_params(
            "algorithm", self, {"weights": ("wpsgd", "steps", "equal")}, {"period_s": 0.0}
        )


@dataclass(frozen=True)
class SimuParallelParams(WpsgdParams):
    weights: str = "equal"


@dataclass(frozen=True)
class BalancedParams:
    """Sync with speed-proportional batches: worker i's batch b_i is
    proportional to its measured samples/s, within [min_batch, max_batch],
    summing to global_batch; re-sized while training when speeds drift."""

    global_batch: int = setting(
        0, help="samples per round, all workers together; 0 = data.batch_size x cluster.workers"
    )
    min_batch: int = setting(8, help="no worker's batch is smaller ...")
    max_batch: int = setting(0, help="... or larger (0 = global_batch)")
    regroup: bool = setting(True, help="re-size the batches while training when speeds drift")
    hysteresis: float = setting(0.3, help="relative speed change that may trigger re-sizing")
    regroup_every_s: float = setting(
        2.0, help="seconds between the scheduler's checks for drifted speeds"
    )
    confirm_checks: int = setting(
        2, help="a new set of batch sizes must come out of this many checks in a row"
    )

    def __post_init__(self):
        _check_params(
            "algorithm",
            self,
            {},
            {
                "global_batch": 0,
                "min_batch": 1,
                "max_batch": 0,
                "hysteresis": 1e-6,
                "regroup_every_s": 0.0,
                "confirm_checks": 1,
            },
        )
        if self.max_batch and self.max_batch < self.min_batch:
            _fail(
                "algorithm.max_batch",
                f"must be 0 or >= algorithm.min_batch ({self.min_batch}), got {self.max_batch}",
            )

    def resolve(self, cfg) -> "BalancedParams":
        """global_batch 0 -> data.batch_size x the configured workers; raises
        ConfigError when the workers cannot share it within the bounds."""
        workers = max(1, len(cfg.cluster.workers))
        total = self.global_batch or cfg.data.batch_size * workers
        if self.min_batch * workers > total:
            _fail(
                "algorithm.min_batch",
                f"{workers} workers x min_batch {self.min_batch} exceed the global "
                f"batch {total}; lower min_batch or raise algorithm.global_batch",
            )
        if self.max_batch and self.max_batch * workers < total:
            _fail(
                "algorithm.max_batch",
                f"{workers} workers x max_batch {self.max_batch} fall short of the "
                f"global batch {total}; raise max_batch or lower algorithm.global_batch",
            )
        return replace(self, global_batch=total)


@dataclass(frozen=True)
class DilocoParams:
    """Asynchronous DiLoCo: H_i local steps of the inner optimizer (the
    `optimizer:` block) per round, then a push of the pseudo-gradient
    (start - end), applied at once by the shard's outer optimizer
    (SGD with Nesterov momentum)."""

    period: int = setting(
        16, help="H: local steps per round of the fastest worker (of every worker if not by speed)"
    )
    steps_by_speed: bool = setting(
        True, help="H_i = H x speed_i / fastest speed (rounds take about equal time)"
    )
    min_period: int = setting(1, help="no worker takes fewer local steps per round")
    outer_lr: float = setting(0.7, help="DiLoCo's outer learning rate")
    outer_momentum: float = setting(0.9, help="DiLoCo's outer Nesterov momentum")
    per_worker_lr: bool = setting(
        True,
        help="each push uses outer_lr / P: P asynchronous pushes move as far as one DiLoCo round",
    )
    delay: int = setting(
        0,
        help="delayed Nesterov (arXiv 2401.09135): momentum updated every `delay` pushes; 0 = every P pushes (P: the plan's workers); 1 = plain Nesterov on every push",
    )

    def __post_init__(self):
        _check_params(
            "algorithm",
            self,
            {},
            {"period": 1, "min_period": 1, "outer_lr": 1e-12, "outer_momentum": 0.0, "delay": 0},
        )
        if not self.outer_momentum < 1:
            _fail("algorithm.outer_momentum", f"must be < 1, got {self.outer_momentum}")
        if self.min_period > self.period:
            _fail(
                "algorithm.min_period",
                f"must be <= algorithm.period ({self.period}), got {self.min_period}",
            )
