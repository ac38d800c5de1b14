"""The algorithm table: one frozen record per algorithm, saying what it is
made of in words every role understands. Each role maps these traits to its
own classes through one registry (scheduler: `scheduler/grouping.py`
FORMATIONS; shard: `ps/policies` POLICIES and `ps/shard.py` NEUTRAL_PUSH;
worker: `worker/lifecycle.py` WORKER_LOOPS and `worker/local.py` PERIODS), so
no role ever branches on an algorithm's name. A new algorithm is one line
here, its parameter dataclass (`algorithm_params.py`), its shard policy (one
file under `ps/policies/`) and a config; `tests/inproc/test_algorithm_table.py`
checks that every line resolves in every role.

The plan carries the algorithm's name and resolved parameters
(`resolved_params`); every shard, worker and the evaluator compares them with
its own config when the plan arrives (`check_plan_algorithm`) and refuses to
run on a mismatch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hetps.proto.errors import ConfigError

from .algorithm_params import (
    AdpsgdParams,
    AsyncParams,
    BalancedParams,
    CpsgdParams,
    DilocoParams,
    EagerParams,
    GroupingParams,
    SimuParallelParams,
    SspParams,
    SyncParams,
    WpsgdParams,
)

# one group of all | each alone | k-means on speed |
GROUPS = ("all", "each", "by_speed", "balanced")
#                                                one group, batch sizes proportional to speed
# push a gradient per step | local optimizer
WORKER_LOOPS = ("gradients", "local_steps", "pseudo_gradients")
#                          steps, then the model | local steps, then start - end (diloco)
PUSHES = ("gradients", "model")
# local_steps, pseudo_gradients: how a worker counts its period
PERIODS = ("", "steps", "shard", "seconds")
# how a group's members reduce before the shards (comm.aggregate)
AGGREGATES = ("", "mean", "by_samples")


@dataclass(frozen=True)
class Algorithm:
    name: str
    params: type  # frozen dataclass of its parameters (algorithm_params.py)
    groups: str  # GROUPS: how the scheduler forms the synchronous groups
    worker_loop: str  # WORKER_LOOPS
    # PUSHES: what a push carries (gradients are compressed, models travel exact)
    pushes: str
    policy: str  # the shard's consistency policy, by name (ps/policies POLICIES)
    fuses_pull: bool = True  # a push may ask for the next values in itself (`comm.fuse_pull`)
    # PERIODS: steps (`period`), shard (the shards' ACKs decide), seconds (`period_s`)
    period: str = ""
    # AGGREGATES: rounds of every member of a group, which may reduce before the shards
    # (comm.aggregate): their mean, or their mean weighted by samples (balanced); "": no rounds
    aggregates: str = ""

    def __post_init__(self):
        for key, allowed in (
            ("groups", GROUPS),
            ("worker_loop", WORKER_LOOPS),
            ("pushes", PUSHES),
            ("period", PERIODS),
            ("aggregates", AGGREGATES),
        ):
            if getattr(self, key) not in allowed:
                raise ValueError(
                    f"algorithm {self.name}: {key} {getattr(self, key)!r} not in {allowed}"
                )


_GRADIENTS = dict(worker_loop="gradients", pushes="gradients")
# averaging pushes wait for whole rounds: unfused, the model is acked at once and only the small
# PULL waits (and is re-sent after cluster.retry_s), not the whole model
_MODELS = dict(worker_loop="local_steps", pushes="model", fuses_pull=False)

# One line per algorithm (docs/algorithms.md describes each; docs/adding-an-algorithm.md the columns).
ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("sync", SyncParams, groups="all", policy="sync", aggregates="mean", **_GRADIENTS),
        Algorithm("async", AsyncParams, groups="each", policy="async", **_GRADIENTS),
        Algorithm("ssp", SspParams, groups="each", policy="ssp", **_GRADIENTS),
        Algorithm(
            "grouping",
            GroupingParams,
            groups="by_speed",
            policy="grouping",
            aggregates="mean",
            **_GRADIENTS,
        ),
        Algorithm("eager", EagerParams, groups="all", policy="eager", **_GRADIENTS),
        Algorithm("cpsgd", CpsgdParams, groups="all", policy="cpsgd", period="steps", **_MODELS),
        Algorithm("adpsgd", AdpsgdParams, groups="all", policy="adpsgd", period="shard", **_MODELS),
        Algorithm("wpsgd", WpsgdParams, groups="all", policy="wpsgd", period="seconds", **_MODELS),
        Algorithm(
            "simuparallel",
            SimuParallelParams,
            groups="all",
            policy="wpsgd",
            period="seconds",
            **_MODELS,
        ),
        Algorithm(
            "balanced",
            BalancedParams,
            groups="balanced",
            policy="balanced",
            aggregates="by_samples",
            **_GRADIENTS,
        ),
        # pseudo-gradients are gradients to the shard (compressed, zeros when neutral), applied at once
        Algorithm(
            "diloco",
            DilocoParams,
            groups="each",
            policy="diloco",
            worker_loop="pseudo_gradients",
            pushes="gradients",
            period="steps",
        ),
    )
}

# Algorithm name -> its parameter dataclass (what config loading needs).
ALGORITHM_PARAMS: dict[str, type] = {name: a.params for name, a in ALGORITHMS.items()}


def aggregation_off_because(cfg) -> str:
    """Why a run's synchronous groups do not reduce before the shards (comm.aggregate), or ""
    when they do: the algorithm has no rounds of whole groups, comm.overlap pushes layer by
    layer, or security.curve is on and comm.collective_trusted is not (gloo is not CurveZMQ)."""
    algo = ALGORITHMS.get(cfg.algorithm.name)
    if cfg.comm.aggregate == "off":
        return "comm.aggregate: off"
    if algo is None or not algo.aggregates or algo.worker_loop != "gradients":
        return f"algorithm.name: {cfg.algorithm.name} has no rounds of whole groups"
    if cfg.comm.overlap:
        return "comm.overlap: true pushes each layer as backward produces it"
    if cfg.security.curve and not cfg.comm.collective_trusted:
        return "security.curve: true and comm.collective_trusted: false (gloo is not CurveZMQ)"
    return ""


def min_aggregated_group(cfg) -> int:
    """The smallest group that reduces before the shards: 2 with comm.aggregate on,
    comm.aggregate_min_group with auto (0: none, when aggregation is off or cannot apply)."""
    if aggregation_off_because(cfg):
        return 0
    return 2 if cfg.comm.aggregate == "on" else max(2, cfg.comm.aggregate_min_group)


def algorithm(name: str) -> Algorithm:
    """The table's record for `name`; raises ConfigError naming the allowed names."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(
            f"algorithm.name: unknown value {name!r}; allowed: {', '.join(ALGORITHMS)}"
        ) from None


class AlgorithmMismatch(ConfigError):
    """This node's config names another algorithm, or other parameters, than the plan."""


def resolved_params(cfg_algorithm) -> dict:
    """The resolved parameters of `cfg_algorithm` (an AlgorithmConfig) as the
    plan carries them: plain data, every field present."""
    return dataclasses.asdict(cfg_algorithm.params)


def check_plan_algorithm(cfg_algorithm, plan) -> None:
    """Refuse to run when this node's config disagrees with the plan's
    algorithm: name, or (when the plan carries them) any resolved parameter.
    Raises AlgorithmMismatch naming both values."""
    mine = {"name": cfg_algorithm.name, **resolved_params(cfg_algorithm)}
    theirs = {"name": plan.algorithm, **plan.algorithm_params}
    if plan.algorithm != cfg_algorithm.name or (plan.algorithm_params and theirs != mine):
        # another algorithm: its parameters differ by nature, the name says it all
        differ = (
            ["name"]
            if plan.algorithm != cfg_algorithm.name
            else sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        )
        raise AlgorithmMismatch(
            f"algorithm mismatch in {', '.join(differ)}: this node's config says {_brief(mine, differ)}, "
            f"the plan (the scheduler's config) says {_brief(theirs, differ)}; start every node with the "
            f"same algorithm block"
        )


def _brief(values: dict, keys: list[str]) -> str:
    return "{" + ", ".join(f"{k}: {values.get(k, '<unset>')!r}" for k in keys) + "}"
