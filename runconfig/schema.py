"""The experiment configuration: typed, strict, every default named here.

`load_config(path, overrides)` reads YAML, applies `key=value` overrides
(dotted paths, list indices allowed: `cluster.workers.0.slowdown=3`), and
builds frozen dataclasses. Unknown keys, wrong types, unknown names and
numbers out of range (config_checks.py) raise one `ConfigError` listing every
problem, each naming the key path and the allowed values or range.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


from .algorithm_params import ALGORITHM_PARAMS, SyncParams
from .build import BAD, Problems, build_dataclass, fail, node_list
from hetps.proto.errors import ConfigError  # noqa: F401  (re-exported: callers catch hetps.runconfig.schema.ConfigError)

BUILTIN_MODELS = ("mlp", "lenet5", "resnet20")
DATASETS = ("mnist-5k", "mnist", "cifar10", "cifar100", "imagefolder", "synthetic")


@dataclass(frozen=True)
class ModelConfig:
    name: str = "lenet5"       # mlp | lenet5 | resnet20 | a torchvision.models name | pkg.module:factory
    kwargs: dict = field(default_factory=dict)  # passed to the model's constructor
    autocast: str = "none"     # train forward passes under torch.autocast: none | bfloat16 (the rest stays float32)


@dataclass(frozen=True)
class SyntheticConfig:
    shape: list[int] = field(default_factory=lambda: [1, 28, 28])
    classes: int = 10
    train_size: int = 4096
    test_size: int = 1024


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "mnist-5k"  # a builtin name (DATASETS) or pkg.module:factory (docs/own-model.md)
    kwargs: dict = field(default_factory=dict)  # pkg.module:factory datasets: passed to the factory
    batch_size: int = 32       # per worker
    eval_batch_size: int = 500
    root: str = "~/.cache/hetps/data"  # torchvision datasets and imagefolder
    download: bool = False
    resize: list[int] | None = None  # imagefolder: [H, W] to resize every image to; null = keep their size
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass(frozen=True)
class ScheduleConfig:
    name: str = "constant"     # constant | step | cosine
    warmup_steps: int = 0      # linear warm-up, in shard updates
    step_size: int = 1000      # step: multiply by gamma every step_size updates
    gamma: float = 0.1
    total_steps: int = 0       # cosine: updates over which lr decays to 0 (required)


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "sgd"          # sgd | adam | adamw  (runs on the shards; diloco: the workers' inner optimizer)
    lr: float = 0.05
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    clip_grad_norm: float = 0.0  # L2 norm a worker's gradient is scaled down to before its push or local step; 0 = off
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)


@dataclass(frozen=True)
class AlgorithmConfig:
    name: str = "sync"
    params: Any = field(default_factory=SyncParams)


@dataclass(frozen=True)
class SlowdownChange:
    at_s: float                # seconds after the node starts training (serving, for shards)
    slowdown: float


@dataclass(frozen=True)
class KillFault:
    node: str                  # a process of `hetps run`: scheduler, ps0, worker2, evaluator, ...
    at_s: float                # seconds after training began (the first plan)
    restart_after_s: float | None = None  # start it again this long after (same address; shards restore)


@dataclass(frozen=True)
class MessageFaults:
    """Fault injection on the wire: each message a worker sends is dropped or
    delayed with these probabilities (seeded per node); workers retry."""
    drop: float = 0.0          # fraction of a worker's requests that never leave it
    delay: float = 0.0         # fraction held back before sending
    delay_s: float = 0.05      # how long a delayed message waits


@dataclass(frozen=True)
class NodeConfig:
    slowdown: float = 1.0      # emulate a slower node: a step takes slowdown x its compute time
    schedule: list[SlowdownChange] = field(default_factory=list)  # later changes of slowdown
    link_mbps: float = 0.0     # emulate a slow link: cap this node's sockets at this many Mbit/s each way (0: none)
    latency_ms: float = 0.0    # simulate: one-way latency of this node's link, milliseconds
    step_s: float = 0.0        # simulate: compute seconds per step of this worker (0: slowdown x sim.sample_s x batch)
    threads: int = 1           # torch intra-op threads
    device: str = "auto"       # auto | cpu | cuda | cuda:N  (workers)


@dataclass(frozen=True)
class ClusterConfig:
    scheduler: str = "tcp://127.0.0.1:0"   # scheduler address; port 0 = random (local runs)
    host: str = "127.0.0.1"                # where local shards bind and advertise
    shards: list[NodeConfig] = field(default_factory=lambda: [NodeConfig(), NodeConfig()])
    workers: list[NodeConfig] = field(default_factory=lambda: [NodeConfig() for _ in range(4)])
    heartbeat_s: float = 0.5
    dead_after_s: float = 5.0              # a worker silent this long leaves the plan
    scheduler_grace_s: float = 30.0        # a shard/worker/evaluator whose scheduler is silent this long exits 3
    kill: list[KillFault] = field(default_factory=list)  # fault injection: SIGKILL these nodes at these times
    straggler: float = 0.0                 # every step one seeded-random worker computes 1+this x as long
    profile_steps: int = 20                # steps timed on the real model before joining (speed)
    request_timeout_s: float = 120.0       # longest wait for any single reply
    startup_timeout_s: float = 120.0       # longest wait for the cluster to form
    max_message_bytes: int = 1 << 30       # enforced by the sockets
    chunk_bytes: int = 0                   # tensors larger than this are cut into parts placed apart; 0 = never
    faults: MessageFaults = field(default_factory=MessageFaults)
    retry_s: float = 2.0                   # a worker re-sends an unanswered push/pull after this (doubling)
    nonfinite: str = "reject"              # NaN/Inf in a push: reject (NONFINITE) | skip (ack, not applied) | clip
    clip_value: float = 1.0                # nonfinite=clip: NaN -> 0, +-Inf -> +-clip_value
    replicas: int = 0                      # backups of each shard's state on the next shard process (0 | 1)
    spare_shards: int = 0                  # idle shard processes that become new backups after a failover
    shard_processes: int = 0               # hetps run: serve the shard ranks from this many processes (0: one each)


@dataclass(frozen=True)
class StopConfig:
    target_accuracy: float | None = 0.95   # stop when the evaluator reaches it; null = never
    target_patience: int = 1               # stop at this many evaluations in a row at the target (1: the first)
    max_seconds: float = 300.0             # wall-clock limit of training
    max_steps: int = 0                     # limit on the sum of all workers' steps; 0 = none
    diverged_after: int = 5                # stop as diverged after this many evaluations in a row at
                                           # chance accuracy (after diverge_warmup_s); 0 = never
    diverge_warmup_s: float = 20.0         # evaluations in the first seconds of training do not count


@dataclass(frozen=True)
class EvalConfig:
    enabled: bool = True
    every_s: float = 2.0
    keep_best: bool = True     # also write the best-evaluated model (best.safetensors beside model.safetensors)


@dataclass(frozen=True)
class LogConfig:
    tensorboard: bool = False  # TensorBoard event files in RUN_DIR/tensorboard (needs hetps[tensorboard])


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""              # shard checkpoints go here; "" = none (`hetps run`: RUN_DIR/checkpoints)
    every_updates: int = 0     # write after this many applied pushes; 0 = not by count
    every_s: float = 10.0      # or after this many seconds; 0 = not by time
    keep: int = 2              # checkpoints kept per shard


@dataclass(frozen=True)
class SecurityConfig:
    curve: bool = False        # CurveZMQ on every socket (encryption + client allow-list)
    keys_dir: str = ""         # made by `hetps keys DIR`; env HETPS_KEYS_DIR overrides


@dataclass(frozen=True)
class CommConfig:
    overlap: bool = False      # push each gradient as backward produces it; wait per layer for the pull
    compression: str = "none"  # none | fp16 | topk  (worker -> shard gradients)
    topk_ratio: float = 0.01   # topk: fraction of each tensor's entries sent (error feedback keeps the rest)
    fuse_pull: bool = True     # a push asks for the next values itself: one reply carries ACK and values
    shm_bytes: int = 0         # worker -> shard frames of >= this many bytes via shared memory (one host; 0: off)
    local_transport: str = "ipc"  # hetps run on one host: scheduler and shards bind ipc (unix sockets) | tcp (loopback)


@dataclass(frozen=True)
class SimConfig:
    """The cost model of `hetps simulate` (virtual time; docs/simulation.md)."""
    sample_s: float = 0.0002           # compute seconds per training sample of a slowdown-1 worker
    shard_bytes_per_s: float = 1e9     # bytes a slowdown-1 shard takes in per second (its service time)
    eval_s: float = 0.0                # virtual seconds an evaluation takes (the evaluator's pull is free)


@dataclass(frozen=True)
class RunConfig:
    name: str = "default"
    seed: int = 0
    out_dir: str = "runs"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    stop: StopConfig = field(default_factory=StopConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    log: LogConfig = field(default_factory=LogConfig)
    sim: SimConfig = field(default_factory=SimConfig)


CHOICES: dict[str, tuple[str, ...]] = {
    "model.autocast": ("none", "bfloat16"),
    "optimizer.name": ("sgd", "adam", "adamw"),
    "optimizer.schedule.name": ("constant", "step", "cosine"),
    "cluster.nonfinite": ("reject", "skip", "clip"),
    "comm.compression": ("none", "fp16", "topk"),
    "comm.local_transport": ("ipc", "tcp"),
}


# ------------------------------------------------------------ typed building

def _algorithm_fields(name: str) -> list[str]:
    return [f.name for f in dataclasses.fields(ALGORITHM_PARAMS[name])]


def _build_algorithm(value: Any, problems: Problems) -> AlgorithmConfig:
    """The algorithm's name and its own parameters. A key that belongs to
    another algorithm says which one."""
    if value is not None and not isinstance(value, dict):
        problems.add("algorithm", f"expected a mapping, got {type(value).__name__} {value!r}")
        return AlgorithmConfig()
    value = dict(value or {})
    name = value.pop("name", "sync")
    if not isinstance(name, str) or name not in ALGORITHM_PARAMS:
        problems.add("algorithm.name", f"unknown value {name!r}; allowed: {', '.join(ALGORITHM_PARAMS)}")
        return AlgorithmConfig()
    own = _algorithm_fields(name)
    for key in [k for k in value if k not in own]:
        owners = [a for a in ALGORITHM_PARAMS if key in _algorithm_fields(a)]
        where = (f"belongs to {' or '.join(owners)}, not to {name} (algorithm.name={owners[0]} takes it)"
                 if owners else "unknown key")
        problems.add(f"algorithm.{key}", f"{where}; allowed: {', '.join(own) or '(none)'}")
        del value[key]
    params = build_dataclass(ALGORITHM_PARAMS[name], value, "algorithm", problems)
    return AlgorithmConfig(name=name, params=ALGORITHM_PARAMS[name]() if params is BAD else params)


def _resolve_algorithm(cfg: RunConfig, problems: Problems) -> RunConfig:
    """Parameters whose default depends on the rest of the config (a params
    class with `resolve(cfg)`, e.g. balanced's global batch) take their value
    here, so the plan carries the number every node uses."""
    resolve = getattr(cfg.algorithm.params, "resolve", None)
    if resolve is None or problems:
        return cfg
    try:
        return dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, params=resolve(cfg)))
    except ConfigError as exc:
        problems.extend(exc.errors)
        return cfg


def config_from_dict(raw: dict, import_targets: bool = False) -> RunConfig:
    """Build and check a RunConfig from plain data. Raises ConfigError listing
    every problem found. `import_targets`: also import `pkg.module:factory`
    model and dataset names (where they will be built: `hetps run`, workers)."""
    return _config_from_dict(raw, import_targets, Problems())


def _config_from_dict(raw: Any, import_targets: bool, problems: Problems) -> RunConfig:
    from .checks import check_targets, check_values  # the checks need the dataclasses above

    if not isinstance(raw, dict):
        fail("", "the config file must hold a mapping")
    raw = dict(raw)
    algorithm = _build_algorithm(raw.pop("algorithm", None), problems)
    cluster = raw.get("cluster")
    if isinstance(cluster, dict):
        cluster = dict(cluster)
        for kind in ("shards", "workers"):
            if kind in cluster:
                try:
                    cluster[kind] = node_list(cluster[kind], f"cluster.{kind}")
                except ConfigError as exc:
                    problems.extend(exc.errors)
                    del cluster[kind]
        raw["cluster"] = cluster
    cfg = dataclasses.replace(build_dataclass(RunConfig, raw, "", problems), algorithm=algorithm)
    problems.extend(check_values(cfg))
    cfg = _resolve_algorithm(cfg, problems)
    if import_targets and not problems:  # a config with other errors is not worth importing code for
        problems.extend(check_targets(cfg))
    if problems:
        raise ConfigError(problems)
    return cfg


# ------------------------------------------------------------ overrides and files

def apply_override(raw: dict, assignment: str, keep_algorithm_keys: set[str] | None = None) -> None:
    """Apply one `dotted.key=value` (value parsed as YAML) to the raw mapping, in place.
    With `keep_algorithm_keys` (a set), `algorithm.name=X` first drops the
    previous algorithm's keys that X does not take, except those."""
    if "=" not in assignment:
        fail(assignment, "override must look like key=value")
    key, text = assignment.split("=", 1)
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError as exc:
        fail(key.strip(), f"value is not valid YAML ({str(exc).splitlines()[0]}): {text!r}")
    if keep_algorithm_keys is not None and key.strip() == "algorithm.name":
        switch_algorithm(raw, value, keep_algorithm_keys)
    parts = key.strip().split(".")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        here = ".".join(parts[: i + 1])
        if isinstance(node, list):
            node = node[_list_index(node, part, here)]
        elif isinstance(node, dict):
            child = node.get(part)
            if here in ("cluster.workers", "cluster.shards"):
                default = len(getattr(ClusterConfig(), part))
                child = node_list(default if child is None else child, here)
            node[part] = child = {} if child is None else child
            node = child
        else:
            fail(here, f"cannot set a key inside {type(node).__name__}")
    last = parts[-1]
    if isinstance(node, list):
        node[_list_index(node, last, key)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        fail(key, f"cannot set a key inside {type(node).__name__}")


def _list_index(node: list, part: str, path: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        fail(path, f"index must be 0..{len(node) - 1}")
    return int(part)


def load_raw(path: str | Path) -> dict:
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:  # missing, a directory, not UTF-8 text
        raise ConfigError(f"{path}: cannot read ({getattr(exc, 'strerror', None) or 'not UTF-8 text'})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    return {} if raw is None else raw  # an empty file: the defaults; any other non-mapping is refused


def load_config(path: str | Path | None, overrides: list[str] = (), import_targets: bool = False) -> RunConfig:
    """Load a YAML file (None: all defaults), apply overrides, validate.

    `algorithm.name=X` among the overrides drops the keys of the previous
    algorithm that X does not take (unless an override set them).
    `import_targets`: see `config_from_dict`. Raises ConfigError listing every
    problem found (an unreadable file: only that)."""
    raw = load_raw(path) if path else {}
    problems = Problems()
    typed: set[str] = set()  # algorithm keys the command line set: never dropped
    for assignment in overrides:
        key = assignment.split("=", 1)[0].strip()
        try:
            apply_override(raw, assignment, typed if key == "algorithm.name" else None)
        except ConfigError as exc:
            problems.extend(exc.errors)
        if key.startswith("algorithm."):
            typed.add(key.split(".", 1)[1])
    try:
        return _config_from_dict(raw, import_targets, problems)
    except ConfigError as exc:
        raise ConfigError(list(dict.fromkeys(exc.errors))) from None


def switch_algorithm(raw: dict, name: Any, keep: set[str] = frozenset()) -> None:
    """In place: the raw config's algorithm becomes `name`; the keys of the
    previous algorithm that `name` does not take are dropped (except `keep`).
    An unknown `name` changes nothing here (it is reported when building)."""
    algorithm = raw.get("algorithm")
    if (not isinstance(algorithm, dict) or not isinstance(name, str) or name not in ALGORITHM_PARAMS
            or algorithm.get("name", "sync") == name):
        return
    own = set(_algorithm_fields(name)) | set(keep) | {"name"}
    raw["algorithm"] = {k: v for k, v in algorithm.items() if k in own}


def config_to_dict(cfg: RunConfig) -> dict:
    """Plain data for the resolved config; algorithm params are flattened next to the name."""
    data = dataclasses.asdict(cfg)
    data["algorithm"] = {"name": cfg.algorithm.name, **dataclasses.asdict(cfg.algorithm.params)}
    return data


def dump_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
