"""Value checks of a built RunConfig: allowed names, the range of every
number, cross-field constraints, and (where models and datasets will be
built) that `pkg.module:factory` names import. Each check returns its
problems as `key: what is wrong` lines, so that all are reported at once.
"""

from __future__ import annotations

import inspect
import math
import re
import sys
from typing import Any, Callable

from .algorithms import ALGORITHMS, aggregation_off_because
from .factories import FACTORY, FactoryError, closest, load_factory
from .schema import BUILTIN_MODELS, CHOICES, DATASETS, SCHEDULES, TASKS, RunConfig

DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")  # as runtime/devices.py
# one path component, not hidden, not `..`
RUN_NAME = re.compile(r"([A-Za-z0-9_-][A-Za-z0-9._-]*)?")

# a rule: (test, allowed range as a user reads it)
Rule = tuple[Callable[[Any], bool], str]
POSITIVE: Rule = (lambda v: 0 < v < math.inf, "must be > 0 (and finite)")
NON_NEGATIVE: Rule = (lambda v: 0 <= v < math.inf, "must be >= 0 (and finite)")
AT_LEAST_1: Rule = (lambda v: 1 <= v < math.inf, "must be >= 1 (and finite)")
FRACTION: Rule = (lambda v: 0 <= v <= 1, "must be in [0, 1]")
# cluster.max_message_bytes bounds every frame a socket takes, headers too: never below the largest
# header a peer may send (proto/codec.py MAX_HEADER_BYTES; not imported: it loads numpy)
MIN_MESSAGE_BYTES = 1 << 20

# every number of the config (algorithm parameters check themselves, algorithm_params.py)
NUMBER_RULES: dict[str, Rule] = {
    "seed": NON_NEGATIVE,
    "data.batch_size": AT_LEAST_1,
    "data.eval_batch_size": AT_LEAST_1,
    "data.num_workers": NON_NEGATIVE,
    "data.accumulate": AT_LEAST_1,
    "data.synthetic.classes": (lambda v: v >= 2, "must be >= 2"),
    "data.synthetic.train_size": AT_LEAST_1,
    "data.synthetic.test_size": AT_LEAST_1,
    "optimizer.lr": POSITIVE,
    "optimizer.momentum": NON_NEGATIVE,
    "optimizer.weight_decay": NON_NEGATIVE,
    "optimizer.schedule.warmup_steps": NON_NEGATIVE,
    "optimizer.schedule.step_size": AT_LEAST_1,
    "optimizer.schedule.gamma": POSITIVE,
    "optimizer.schedule.total_steps": NON_NEGATIVE,
    "sparse.tables": (
        lambda v: v == "auto" or (isinstance(v, list) and all(isinstance(t, str) for t in v)),
        "must be 'auto' or a list of module names",
    ),
    "sparse.min_rows": AT_LEAST_1,
    "sparse.init_std": NON_NEGATIVE,
    "sparse.max_ids": AT_LEAST_1,
    "sparse.optimizer.lr": POSITIVE,
    "sparse.optimizer.eps": (lambda v: v is None or v >= 0, "must be >= 0 or null"),
    "sparse.optimizer.betas": (
        lambda v: isinstance(v, list) and len(v) == 2 and all(0 <= b < 1 for b in v),
        "must be two numbers in [0, 1)",
    ),
    "sparse.optimizer.initial_accumulator_value": NON_NEGATIVE,
    "cluster.heartbeat_s": POSITIVE,
    "cluster.dead_after_s": POSITIVE,
    "cluster.straggler": NON_NEGATIVE,
    "cluster.profile_steps": AT_LEAST_1,
    "cluster.request_timeout_s": POSITIVE,
    "cluster.scheduler_grace_s": POSITIVE,
    "cluster.startup_timeout_s": POSITIVE,
    "cluster.max_message_bytes": (
        lambda v: MIN_MESSAGE_BYTES <= v < math.inf,
        f"must be >= {MIN_MESSAGE_BYTES} (1 MiB, the largest message header the protocol takes: a "
        "heartbeat's queued step records or a plan can fill hundreds of KB whatever the model; the "
        "workers check the model's own need before they register)",
    ),
    "cluster.chunk_bytes": (
        lambda v: v == "auto" or (isinstance(v, int) and v >= 0),
        "must be auto or an int >= 0 (0 = never cut)",
    ),
    "cluster.retry_s": (lambda v: v >= 0, "must be >= 0 (0 = never re-send)"),
    "cluster.clip_value": POSITIVE,
    "cluster.faults.drop": FRACTION,
    "cluster.faults.delay": FRACTION,
    "cluster.faults.delay_s": NON_NEGATIVE,
    "stop.target_accuracy": (
        lambda v: v is None or 0 < v <= 1,
        "must be in (0, 1] (a fraction: 0.95, not 95) or null",
    ),
    "stop.target_patience": (
        lambda v: v >= 1,
        "must be >= 1 (1: stop at the first evaluation that reaches it)",
    ),
    "stop.max_seconds": POSITIVE,
    "stop.max_steps": (lambda v: v >= 0, "must be >= 0 (0 = no limit)"),
    "stop.diverged_after": (lambda v: v >= 0, "must be >= 0 (0 = no chance-level check)"),
    "stop.diverge_warmup_s": NON_NEGATIVE,
    "eval.every_s": POSITIVE,
    "checkpoint.every_updates": NON_NEGATIVE,
    "checkpoint.every_s": NON_NEGATIVE,
    "checkpoint.keep": AT_LEAST_1,
    "comm.topk_ratio": FRACTION,
    "tracking.wandb.mode": (
        lambda v: v in ("online", "offline", "disabled"),
        "must be online, offline or disabled",
    ),
    "optimizer.clip_grad_norm": (lambda v: v >= 0, "must be >= 0 (0 = no clipping)"),
    "comm.shm_bytes": (lambda v: v == 0 or v >= 4096, "must be 0 (off) or >= 4096 (bytes)"),
    "sim.sample_s": POSITIVE,
    "sim.shard_bytes_per_s": POSITIVE,
    "sim.shard_message_s": NON_NEGATIVE,
    "sim.shard_apply_bytes_per_s": POSITIVE,
    "sim.shard_apply_s": NON_NEGATIVE,
    "sim.eval_s": NON_NEGATIVE,
}
NODE_RULES: dict[str, Rule] = {
    "slowdown": (lambda v: v >= 1.0, "must be >= 1.0"),
    "link_mbps": (lambda v: v >= 0, "must be >= 0 (0 = no cap)"),
    "latency_ms": NON_NEGATIVE,
    "step_s": (lambda v: v >= 0, "must be >= 0 (0 = from slowdown and sim.sample_s)"),
    "threads": AT_LEAST_1,
}


def value_at(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _apply(rules: dict[str, Rule], obj: Any, prefix: str, out: list[str]) -> None:
    for key, (ok, allowed) in rules.items():
        value = value_at(obj, key)
        if not ok(value):
            out.append(f"{prefix}{key}: {allowed}, got {value!r}")


def check_values(cfg: RunConfig) -> list[str]:
    """Every problem of a built config's values (empty: none)."""
    out: list[str] = []
    for path, allowed in CHOICES.items():
        if value_at(cfg, path) not in allowed:
            out.append(
                f"{path}: unknown value {value_at(cfg, path)!r}; allowed: {', '.join(allowed)}"
            )
    out += _check_names(cfg)
    _apply(NUMBER_RULES, cfg, "", out)
    out += _check_nodes(cfg)
    out += _check_cross_fields(cfg)
    return out


def _check_names(cfg: RunConfig) -> list[str]:
    out = []
    dataset = cfg.data.dataset
    if dataset not in DATASETS and not FACTORY.fullmatch(dataset):
        out.append(
            f"data.dataset: unknown value {dataset!r}; allowed: {', '.join(DATASETS)}, "
            "or package.module:factory"
        )
    if cfg.data.kwargs and not FACTORY.fullmatch(dataset):
        out.append(
            f"data.kwargs: only for a package.module:factory dataset (data.dataset is {dataset!r})"
        )
    for path, builtin, kwargs_path in (
        ("task.name", TASKS, "task.kwargs"),
        ("optimizer.schedule.name", SCHEDULES, "optimizer.schedule.kwargs"),
    ):
        value = value_at(cfg, path)
        if value not in builtin and not FACTORY.fullmatch(value):
            out.append(
                f"{path}: unknown value {value!r}; allowed: {', '.join(builtin)}, "
                "or package.module:factory"
            )
        elif value_at(cfg, kwargs_path) and not FACTORY.fullmatch(value):
            out.append(f"{kwargs_path}: only for a package.module:factory (it is {value!r})")
    classes = cfg.data.num_classes
    if classes is not None and classes < 2:
        out.append(f"data.num_classes: must be >= 2 or null, got {classes!r}")
    name = cfg.model.name
    if name not in BUILTIN_MODELS and not FACTORY.fullmatch(name):
        import torchvision  # deferred: only needed for non-builtin names

        if name not in torchvision.models.list_models():
            out.append(
                f"model.name: unknown value {name!r}; allowed: {', '.join(BUILTIN_MODELS)}, "
                "a torchvision.models name, or package.module:factory"
            )
    if not RUN_NAME.fullmatch(cfg.name):
        out.append(
            f"name: must be letters, digits, '.', '_' or '-' (it names the run directory), got {cfg.name!r}"
        )
    resize = cfg.data.resize
    if resize is not None and (len(resize) != 2 or min(resize) < 1):
        out.append(f"data.resize: must be [height, width] with both >= 1, or null, got {resize!r}")
    return out


def _check_nodes(cfg: RunConfig) -> list[str]:
    out = []
    for kind in ("shards", "workers"):
        nodes = getattr(cfg.cluster, kind)
        if not nodes:
            out.append(f"cluster.{kind}: needs at least 1 node, got an empty list")
        for i, node in enumerate(nodes):
            _apply(NODE_RULES, node, f"cluster.{kind}.{i}.", out)
            if not DEVICE.fullmatch(node.device):
                out.append(
                    f"cluster.{kind}.{i}.device: unknown value {node.device!r}; "
                    "allowed: auto, cpu, cuda, cuda:N"
                )
            for j, change in enumerate(node.schedule):
                if not (change.slowdown >= 1.0 and 0 <= change.at_s < math.inf):  # NaN fails too
                    out.append(
                        f"cluster.{kind}.{i}.schedule.{j}: needs at_s >= 0 and slowdown >= 1.0, "
                        f"got at_s {change.at_s}, slowdown {change.slowdown}"
                    )
    names = (
        ["scheduler"]
        + [f"ps{i}" for i in range(len(cfg.cluster.shards))]
        + [f"worker{i}" for i in range(len(cfg.cluster.workers))]
        + (["evaluator"] if cfg.eval.enabled else [])
    )
    for i, kill in enumerate(cfg.cluster.kill):
        if kill.node not in names:
            out.append(
                f"cluster.kill.{i}.node: no process {kill.node!r} in this run; allowed: {', '.join(names)}"
            )
        if (kill.at_s is None) == (kill.at_step is None):
            out.append(
                f"cluster.kill.{i}: needs exactly one of at_s (seconds after training began) and "
                f"at_step (workers' steps), got {'both' if kill.at_s is not None else 'neither'}"
            )
        if kill.at_s is not None and not 0 <= kill.at_s < math.inf:  # NaN fails too
            out.append(f"cluster.kill.{i}.at_s: must be >= 0 (and finite), got {kill.at_s}")
        if kill.at_step is not None and kill.at_step < 0:
            out.append(f"cluster.kill.{i}.at_step: must be >= 0, got {kill.at_step}")
        if kill.restart_after_s is not None and kill.restart_after_s < 0:
            out.append(
                f"cluster.kill.{i}.restart_after_s: must be >= 0 or null, got {kill.restart_after_s}"
            )
    return out


def _check_cross_fields(cfg: RunConfig) -> list[str]:
    out = []
    cluster, optimizer = cfg.cluster, cfg.optimizer
    if 0 < cluster.dead_after_s <= cluster.heartbeat_s:
        out.append(
            f"cluster.heartbeat_s: must be < cluster.dead_after_s ({cluster.dead_after_s}), "
            f"got {cluster.heartbeat_s}; a node would be declared dead between two heartbeats"
        )
    if 0 < cluster.scheduler_grace_s <= cluster.heartbeat_s:
        out.append(
            f"cluster.scheduler_grace_s: must be > cluster.heartbeat_s ({cluster.heartbeat_s}), "
            f"got {cluster.scheduler_grace_s}; a node would give up on the scheduler between two heartbeats"
        )
    if cluster.replicas not in (0, 1):
        out.append(
            f"cluster.replicas: allowed values 0 (no backups) and 1 (one backup per shard), "
            f"got {cluster.replicas!r}"
        )
    elif cluster.replicas == 1 and len(cluster.shards) < 2:
        out.append(
            f"cluster.replicas: 1 needs at least 2 shards (a backup lives on another shard process), "
            f"got {len(cluster.shards)}"
        )
    if cluster.spare_shards < 0:
        out.append(
            f"cluster.spare_shards: must be >= 0 (idle shard processes), got {cluster.spare_shards!r}"
        )
    elif cluster.spare_shards and cluster.replicas != 1:
        out.append(
            f"cluster.spare_shards: {cluster.spare_shards} needs cluster.replicas: 1 (a spare becomes a "
            f"backup after a failover), got replicas {cluster.replicas!r}"
        )
    if cfg.comm.shm_bytes and cfg.security.curve:
        out.append(
            "comm.shm_bytes: shared-memory frames bypass CurveZMQ; allowed with security.curve: false only"
        )
    out += _check_shard_processes(cluster)
    if isinstance(cfg.sparse.tables, list) and cfg.sparse.tables:
        out += [p for p in [sparse_tables_problem(cfg)] if p]
    out += _check_schedule_keys(cfg)
    if cfg.comm.aggregate == "on" and aggregation_off_because(cfg):
        out.append(
            f"comm.aggregate: on needs a synchronous group reducing whole gradients (sync, "
            f"balanced, grouping); here {aggregation_off_because(cfg)} (use auto or off)"
        )
    if cfg.comm.collective_timeout_s is not None and not cfg.comm.collective_timeout_s > 0:
        out.append(
            f"comm.collective_timeout_s: must be > 0 seconds or null, got {cfg.comm.collective_timeout_s!r}"
        )
    if cfg.comm.aggregate_min_group < 2:
        out.append(
            f"comm.aggregate_min_group: must be >= 2 (a group of one has nothing to reduce), "
            f"got {cfg.comm.aggregate_min_group!r}"
        )
    if not 0 <= cfg.comm.collective_port <= 65535:
        out.append(f"comm.collective_port: must be 0-65535, got {cfg.comm.collective_port!r}")
    if cfg.comm.compression == "topk" and cfg.comm.topk_ratio <= 0.0:
        out.append("comm.topk_ratio: must be > 0 with comm.compression: topk")
    if optimizer.schedule.name == "cosine" and optimizer.schedule.total_steps <= 0:
        out.append("optimizer.schedule.total_steps: must be > 0 for the cosine schedule")
    loop = getattr(ALGORITHMS.get(cfg.algorithm.name), "worker_loop", None)
    if optimizer.clip_grad_norm and cfg.comm.overlap and loop == "gradients":
        out.append(
            "optimizer.clip_grad_norm: needs the whole gradient before the push; not with comm.overlap: true "
            "(which pushes each layer's gradient during the backward)"
        )
    if cfg.comm.overlap and loop == "gradients":
        if cfg.data.accumulate > 1:
            out.append(
                "data.accumulate: needs the whole gradient of several batches before the push; "
                "not with comm.overlap: true (which pushes each layer's gradient during the backward)"
            )
        if cfg.model.autocast == "float16":
            out.append(
                "model.autocast: float16 checks the whole gradient for overflow before the push; "
                "not with comm.overlap: true (use bfloat16, which needs no loss scaling)"
            )
    if optimizer.nesterov and optimizer.momentum <= 0:
        out.append("optimizer.nesterov: needs optimizer.momentum > 0")
    if len(optimizer.betas) != 2 or not all(0 <= b < 1 for b in optimizer.betas):
        out.append(f"optimizer.betas: must be two numbers in [0, 1), got {optimizer.betas!r}")
    if not cfg.data.synthetic.shape or min(cfg.data.synthetic.shape) < 1:
        out.append(
            f"data.synthetic.shape: must be a non-empty list of sizes >= 1, got {cfg.data.synthetic.shape!r}"
        )
    return out


def sparse_tables_problem(cfg: RunConfig) -> str | None:
    """Why this run cannot serve any table row by row (the algorithm, the autocast), or None;
    asked when sparse.tables selects one (a list here; `auto` once the model is built:
    training/sparse.py `selected`)."""
    if getattr(ALGORITHMS.get(cfg.algorithm.name), "worker_loop", None) != "gradients":
        return (
            f"sparse.tables: algorithm {cfg.algorithm.name!r} takes local steps (model "
            "averaging, DiLoCo), which sparse tables do not support; use sync, async, ssp, "
            "grouping, eager or balanced, or sparse.tables=[]"
        )
    if cfg.model.autocast == "float16":
        return (
            "sparse.tables: model.autocast float16 (loss scaling) is not supported with "
            "sparse tables; use bfloat16 or none"
        )
    return None


# the keys of the built-in schedules (runtime/optim.py lr_factor): a factory builds the whole schedule
BUILTIN_SCHEDULE_KEYS = ("warmup_steps", "step_size", "gamma", "total_steps")


def _check_schedule_keys(cfg: RunConfig) -> list[str]:
    """A built-in schedule's key set beside a `package.module:factory` schedule is refused, not
    ignored: the factory builds the whole schedule (its own keywords go in kwargs)."""
    schedule = cfg.optimizer.schedule
    if not FACTORY.fullmatch(schedule.name):
        return []
    default = type(schedule)()
    return [
        f"optimizer.schedule.{key}: for the built-in schedules ({', '.join(SCHEDULES)}), which "
        f"{schedule.name} replaces (a factory builds the whole schedule, warm-up included); drop "
        f"it, or pass it in optimizer.schedule.kwargs if the factory takes it "
        f"(optimizer.schedule.kwargs={{{key}: {value_at(schedule, key)!r}}})"
        for key in BUILTIN_SCHEDULE_KEYS
        if value_at(schedule, key) != value_at(default, key)
    ]


def _check_shard_processes(cluster) -> list[str]:
    """cluster.shard_processes: a count of processes, never more than shards;
    co-located ranks die together, so neither backups nor per-shard kills apply."""
    n = cluster.shard_processes
    if not isinstance(n, int) or not 0 <= n <= len(cluster.shards):
        return [
            f"cluster.shard_processes: must be 0 (one process per shard) up to the number of shards "
            f"({len(cluster.shards)}), got {n!r}"
        ]
    if not n or n == len(cluster.shards):
        return []
    out = []
    if cluster.replicas:
        out.append(
            f"cluster.shard_processes: {n} puts several shards in one process, which cannot hold "
            "backups for each other; use 0 with cluster.replicas: 1"
        )
    for i, kill in enumerate(cluster.kill):
        if kill.node.startswith("ps"):
            out.append(
                f"cluster.kill.{i}.node: {kill.node} shares its process with other shards under "
                f"cluster.shard_processes: {n}; use 0 to kill one shard"
            )
    return out


def check_targets(cfg: RunConfig) -> list[str]:
    """Import every `package.module:factory` model, dataset, task and schedule name; a
    module that does not import, or has no such callable, is a problem here rather than
    in a process started later. Each factory must also take its kwargs the way it is
    called (`CALLS`: a keyword it does not take names the close one it does)."""
    out = []
    unimported: dict[str, list[FactoryError]] = {}  # module -> the keys that could not import it
    for path, (key, leading, offered) in CALLS.items():
        spec = value_at(cfg, path)
        if FACTORY.fullmatch(spec):
            try:
                factory = load_factory(spec, path)
            except FactoryError as exc:
                if exc.module in unimported:  # the same import failed again: one line says it
                    unimported[exc.module].append(exc)
                    continue
                if exc.module not in sys.modules:
                    unimported[exc.module] = [exc]
                out.append(str(exc))
                continue
            out += _check_call(factory, spec, key, value_at(cfg, key), leading, offered)
    for errors in unimported.values():
        if len(errors) > 1:
            first = out.index(str(errors[0]))
            out[first] = f"{', '.join(e.key for e in errors)}: {errors[0].reason}"
    return out


# how each process calls a factory: name -> (its kwargs' key, the positional arguments before
# them, the keywords it is also given when it takes them: training/models.py `_offered`)
CALLS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "model.name": ("model.kwargs", (), ("num_classes", "input_shape")),
    "data.dataset": ("data.kwargs", (), ()),
    "task.name": ("task.kwargs", (), ()),
    "optimizer.schedule.name": ("optimizer.schedule.kwargs", ("optimizer",), ()),
}


def _check_call(
    factory: Callable,
    spec: str,
    key: str,
    kwargs: dict,
    leading: tuple[str, ...] = ("optimizer",),
    offered: tuple[str, ...] = (),
) -> list[str]:
    """`key: ...` when `factory(*leading, **offered, **kwargs)` cannot bind its arguments (a
    keyword it does not take, with the close name it does take; one it needs and lacks),
    naming its parameters; nothing when they bind or its signature cannot be read (a
    builtin)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return []
    called = f"{spec}{signature}"
    params = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    given = {n: None for n in offered if takes_any or n in params}
    if not takes_any:
        # the leading parameters take the positional arguments
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        names = [n for n, p in list(params.items())[len(leading) :] if p.kind in kinds]
        for word in kwargs:
            if word not in names:
                close = closest(word, names)
                hint = f"; did you mean {close!r}?" if close else ""
                return [f"{key}: {called} takes no keyword {word!r}{hint}"]
    try:
        signature.bind(*[None] * len(leading), **{**given, **kwargs})
    except TypeError as exc:
        call = ", ".join([*leading, *(f"{n}=..." for n in given), f"**{kwargs!r}"])
        return [f"{key}: {called} cannot be called as factory({call}): {exc}"]
    return []


def factory_task_metrics(cfg: RunConfig) -> tuple[list[str] | None, list[str]]:
    """The metric names of a `package.module:factory` task, primary first, and the problems
    of making it: the factory is called with task.kwargs, as every worker calls it (run
    after `check_targets` found it). Names are read from `metrics` (Metric records or
    (name, higher_is_better) pairs, training/task.py; none listed: Task's `loss`); None
    when they cannot be read (the check before training says what is wrong with them)."""
    factory = load_factory(cfg.task.name, "task.name")
    try:
        made = factory(**cfg.task.kwargs)
    except Exception as exc:  # the user's factory may raise anything
        where = f"task.name {cfg.task.name!r}"
        return None, [
            f"{where}: calling it with task.kwargs {cfg.task.kwargs} fails "
            f"({type(exc).__name__}: {exc})"
        ]
    names = []
    for metric in getattr(made, "metrics", None) or [("loss", False)]:
        pair = isinstance(metric, (tuple, list)) and len(metric) == 2
        name = metric[0] if pair else getattr(metric, "name", None)
        if not isinstance(name, str):
            return None, []
        names.append(name)
    return names, []
