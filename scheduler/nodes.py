"""What the scheduler keeps about each node of the cluster and about the
evaluations it was sent: plain records, saved with the scheduler's state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hetps.proto.records import NodeStats
from hetps.runtime.failures import Failure

ROLES = ("ps", "spare", "worker", "evaluator")  # what a node registers as


@dataclass
class Node:
    node_id: int
    role: str
    rank: int
    address: str
    last_seen: float
    profiled_speed: float = 0.0
    # from its latest heartbeat (checked at decode)
    stats: NodeStats = field(default_factory=NodeStats)
    left: bool = False  # said BYE
    dead: bool = False  # silent for longer than cluster.dead_after_s
    host: str = ""  # as the node reported it when it registered
    replica_address: str = ""  # a shard with cluster.replicas: where it serves the backup it holds
    spare_slots: list = field(default_factory=list)  # a spare: the addresses of its backup sockets
    # a worker: the highest step of its step records written to metrics.jsonl
    recorded_step: int = -1

    def __post_init__(self):
        self.stats = NodeStats.read(self.stats)  # a restored state holds the plain map

    @property
    def gone(self) -> bool:
        return self.left or self.dead

    def failure(self, what: str, t: float, **more) -> Failure:
        """A failure of this node, e.g. kind `worker_dead`, `shard_error`."""
        return Failure.of_node(self.role, self.rank, self.node_id, what, t, **more)

    @property
    def speed(self) -> float:
        """Latest measured speed: from heartbeats once training, else the profile."""
        return self.stats.speed or self.profiled_speed or 1.0


def free_rank(nodes: list[Node], role: str, configured: int) -> int | None:
    """The rank `--rank auto` claims for a node of `role`, given the `configured` count
    of that role in the config. A shard: the lowest of 0..configured-1 no live shard holds
    (None: every one is held), so it takes a missing shard's place and settings in the plan.
    A worker or evaluator: the lowest rank from `configured` up that no live node of its
    role holds; the configured ranks stay free for launchers that give indices."""
    held = {n.rank for n in nodes if n.role == role and not n.gone}
    start, stop = (0, configured) if role == "ps" else (configured, configured + len(held) + 1)
    return next((r for r in range(start, stop) if r not in held), None)


# the fields of a metrics.jsonl eval row beside the task's metrics (Coordinator._record_eval)
EVAL_ROW_FIELDS = frozenset(
    {
        "kind",
        "t",
        "watch",
        "higher_is_better",
        "global_steps",
        "global_samples",
        "final",
        "bytes",
        "versions",
    }
)
# metrics taken as lower-is-better when an evaluator's report gives no direction
LOWER_IS_BETTER = frozenset({"loss", "perplexity", "mse", "mae", "rmse", "error", "nll"})


@dataclass(frozen=True)
class EvalReading:
    """One evaluation report, read (`read_eval`): every metric of the task and its
    direction, the watched metric's name, the test loss and the class count."""

    metrics: dict[str, float]
    higher_is_better: dict[str, bool]
    watch: str
    loss: float | None  # the divergence guard's test loss; None when the task reports none
    num_classes: int | None  # classification only: enables the chance-level rule
    final: bool
    # each shard's version the evaluated model held (the evaluator's pull); None: not reported
    versions: tuple[int, ...] | None = None

    @property
    def value(self) -> float | None:
        """The watched metric's value."""
        return self.metrics.get(self.watch)


def _number(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok else None


def read_eval(values: dict) -> EvalReading:
    """An evaluator's REPORT values, either form: the task contract's (`metrics`,
    `higher_is_better`, `watch`, `loss`, `num_classes`) or the older classification one
    (`accuracy`, `loss`: watched accuracy, higher is better). Plain data from a peer: a
    value that is not a number is left out, a missing direction is taken from the name."""
    raw = values.get("metrics")
    if not isinstance(raw, dict) or not raw:
        raw = {k: values.get(k) for k in ("accuracy", "loss")}
    metrics = {str(k): _number(v) for k, v in raw.items() if _number(v) is not None}
    given = values.get("higher_is_better")
    given = given if isinstance(given, dict) else {}
    directions = {
        k: given[k] if isinstance(given.get(k), bool) else k not in LOWER_IS_BETTER for k in metrics
    }
    watch = values.get("watch")
    if not isinstance(watch, str) or watch not in metrics:
        watch = "accuracy" if "accuracy" in metrics else next(iter(metrics), "accuracy")
    loss = _number(values.get("loss"))
    classes = values.get("num_classes")
    versions = values.get("versions")
    ints = isinstance(versions, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in versions
    )
    return EvalReading(
        metrics=metrics,
        higher_is_better=directions,
        watch=watch,
        loss=loss if loss is not None else metrics.get("loss"),
        num_classes=classes if isinstance(classes, int) and not isinstance(classes, bool) else None,
        final=bool(values.get("final", False)),
        versions=tuple(versions) if ints else None,
    )


@dataclass
class EvalTrack:
    """The evaluations so far, on the watched metric (`metric`, its direction
    `higher_is_better`): the stop target's streak, the best and latest values."""

    target: float | None
    # evaluations in a row at the target that stop the run
    patience: int = 1
    # evaluations in a row at the target, up to the latest
    streak: int = 0
    best: float | None = None  # the watched metric's best value
    final: float | None = None  # the watched metric's latest value
    final_loss: float | None = None
    time_to_target_s: float | None = None
    # training examples computed by then (workers' latest heartbeats)
    samples_to_target: int | None = None
    count: int = 0
    target_metric: str = "accuracy"  # the metric `target` is a value of
    metric: str | None = None  # the watched metric, as the latest report named it
    higher_is_better: bool = True
    final_metrics: dict = field(default_factory=dict)  # every metric of the latest evaluation
    best_accuracy: float | None = None  # classification: the best accuracy (summary.json)

    def take(self, reading: EvalReading) -> None:
        """Count one evaluation (the target's streak is the coordinator's: `on_target`)."""
        self.count += 1
        if self.metric is not None and self.metric != reading.watch:
            self.best = None  # another metric is watched now (a resumed run's new target)
        self.metric, value = reading.watch, reading.value
        self.higher_is_better = reading.higher_is_better.get(reading.watch, True)
        self.final, self.final_loss = value, reading.loss
        self.final_metrics = dict(reading.metrics)
        if value is not None and math.isfinite(value):
            pick = max if self.higher_is_better else min
            self.best = value if self.best is None else pick(value, self.best)
        accuracy = reading.metrics.get("accuracy")
        if accuracy is not None and math.isfinite(accuracy):
            self.best_accuracy = max(accuracy, self.best_accuracy or accuracy)
