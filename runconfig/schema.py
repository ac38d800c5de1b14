"""The experiment configuration's schema: one frozen dataclass per section,
typed, strict, every default and its description (`setting(default, help=...)`)
named here (docs/configuration.md is generated from these classes by
reference.py).

Loading a file with overrides, building these classes from plain data and
checking every value is load.py's (`load_config`); the checks of values and
cross-field rules are checks.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hetps.proto.errors import ConfigError  # noqa: F401  (re-exported: callers catch hetps.runconfig.schema.ConfigError)

from .algorithm_params import SyncParams
from .setting import setting

BUILTIN_MODELS = ("mlp", "lenet5", "resnet20")
DATASETS = ("mnist-5k", "mnist", "cifar10", "cifar100", "imagefolder", "synthetic")
TASKS = ("classification", "regression", "binary", "language_model")
SCHEDULES = ("constant", "step", "cosine")


@dataclass(frozen=True)
class ModelConfig:
    name: str = setting(
        "lenet5", help="mlp | lenet5 | resnet20 | a torchvision.models name | pkg.module:factory"
    )
    kwargs: dict = setting(default_factory=dict, help="passed to the model's constructor")
    autocast: str = setting(
        "none",
        help="train forward passes under torch.autocast: none | bfloat16 | float16 (loss scaling; the rest stays float32)",
    )


@dataclass(frozen=True)
class SyntheticConfig:
    shape: list[int] = setting(
        default_factory=lambda: [1, 28, 28], help="shape of one synthetic sample"
    )
    classes: int = setting(10, help="number of synthetic classes")
    train_size: int = setting(4096, help="synthetic training samples")
    test_size: int = setting(1024, help="synthetic test samples")


@dataclass(frozen=True)
class DataConfig:
    dataset: str = setting(
        "mnist-5k", help="a builtin name (DATASETS) or pkg.module:factory (docs/own-model.md)"
    )
    kwargs: dict = setting(
        default_factory=dict, help="pkg.module:factory datasets: passed to the factory"
    )
    batch_size: int = setting(32, help="per worker")
    eval_batch_size: int = setting(500, help="the evaluator's batch size")
    root: str = setting("~/.cache/hetps/data", help="torchvision datasets and imagefolder")
    download: bool = setting(
        False, help="let torchvision download `mnist`, `cifar10` or `cifar100` into `data.root`"
    )
    resize: list[int] | None = setting(
        None, help="imagefolder: [H, W] to resize every image to; null = keep their size"
    )
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    num_classes: int | None = setting(
        None, help="classification: the class count (else the dataset's num_classes or classes)"
    )
    num_workers: int = setting(
        0, help="DataLoader processes per worker (0: batches are read in the worker's own process)"
    )
    accumulate: int = setting(
        1,
        help="gradient accumulation: batches whose gradients are averaged into each push or local step (one batch of batch_size x accumulate)",
    )


@dataclass(frozen=True)
class TaskConfig:
    name: str = setting(
        "classification",
        help="classification | regression | language_model | binary | pkg.module:factory (docs/own-model.md)",
    )
    kwargs: dict = setting(
        default_factory=dict, help="pkg.module:factory tasks: passed to the factory"
    )


@dataclass(frozen=True)
class ScheduleConfig:
    name: str = setting(
        "constant",
        help="constant | step | cosine | pkg.module:factory (factory(optimizer, **kwargs) -> an LR scheduler)",
    )
    kwargs: dict = setting(
        default_factory=dict, help="pkg.module:factory schedules: passed to the factory"
    )
    clock: str = setting(
        "samples",
        help="what a schedule step is: samples = one global batch (data.batch_size x "
        "data.accumulate x the configured workers; balanced: its global_batch) of samples the "
        "shards applied, a sync update, so one config is one schedule under every algorithm | "
        "updates = one shard update (grouping and async make many more)",
    )
    warmup_steps: int = setting(0, help="linear warm-up, in schedule steps (clock)")
    step_size: int = setting(1000, help="step: multiply by gamma every step_size schedule steps")
    gamma: float = setting(0.1, help="`step`: the factor applied every `step_size` steps")
    total_steps: int = setting(
        0, help="cosine: schedule steps over which lr decays to 0 (required)"
    )


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = setting(
        "sgd", help="sgd | adam | adamw  (runs on the shards; diloco: the workers' inner optimizer)"
    )
    lr: float = setting(0.05, help="learning rate of the shards' optimizer")
    momentum: float = setting(0.9, help="SGD momentum")
    nesterov: bool = setting(False, help="SGD with Nesterov momentum")
    weight_decay: float = setting(0.0, help="L2 weight decay")
    clip_grad_norm: float = setting(
        0.0,
        help="L2 norm a worker's gradient is scaled down to before its push or local step; 0 = off",
    )
    betas: list[float] = setting(default_factory=lambda: [0.9, 0.999], help="Adam's betas")
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)


@dataclass(frozen=True)
class AlgorithmConfig:
    name: str = setting(
        "sync", help="the training algorithm; its parameters sit beside the name (see below)"
    )
    params: Any = field(default_factory=SyncParams)


@dataclass(frozen=True)
class SlowdownChange:
    at_s: float = setting(help="seconds after the node starts training (serving, for shards)")
    slowdown: float = setting(help="the new slowdown from then on")


@dataclass(frozen=True)
class KillFault:
    node: str = setting(help="a process of `hetps run`: scheduler, ps0, worker2, evaluator, ...")
    at_s: float | None = setting(
        None, help="seconds after training began (the first plan); this or at_step"
    )
    at_step: int | None = setting(
        None,
        help="once the workers' steps recorded in RUN_DIR/metrics.jsonl (all workers, this launch) number this many",
    )
    restart_after_s: float | None = setting(
        None, help="start it again this long after (same address; shards restore)"
    )


@dataclass(frozen=True)
class MessageFaults:
    """Fault injection on the wire: each message a worker sends is dropped or
    delayed with these probabilities (seeded per node); workers retry."""

    drop: float = setting(0.0, help="fraction of a worker's requests that never leave it")
    delay: float = setting(0.0, help="fraction held back before sending")
    delay_s: float = setting(0.05, help="how long a delayed message waits")


@dataclass(frozen=True)
class NodeConfig:
    slowdown: float = setting(
        1.0, help="emulate a slower node: a step takes slowdown x its compute time"
    )
    schedule: list[SlowdownChange] = setting(default_factory=list, help="later changes of slowdown")
    link_mbps: float = setting(
        0.0,
        help="emulate a slow link: cap this node's sockets at this many Mbit/s each way (0: none)",
    )
    latency_ms: float = setting(
        0.0, help="simulate: one-way latency of this node's link, milliseconds"
    )
    step_s: float = setting(
        0.0,
        help="simulate: compute seconds per step of this worker (0: slowdown x sim.sample_s x batch)",
    )
    threads: int = setting(1, help="torch intra-op threads")
    device: str = setting("auto", help="auto | cpu | cuda | cuda:N  (workers)")


@dataclass(frozen=True)
class ClusterConfig:
    scheduler: str = setting(
        "tcp://127.0.0.1:0", help="scheduler address; port 0 = random (local runs)"
    )
    host: str = setting("127.0.0.1", help="where local shards bind and advertise")
    shards: list[NodeConfig] = setting(
        default_factory=lambda: [NodeConfig(), NodeConfig()],
        help="the shards: a count, or a list of nodes (keys below)",
    )
    workers: list[NodeConfig] = setting(
        default_factory=lambda: [NodeConfig() for _ in range(4)],
        help="the workers: a count, or a list of nodes (keys below)",
    )
    heartbeat_s: float = setting(0.5, help="seconds between a node's heartbeats")
    dead_after_s: float = setting(5.0, help="a worker silent this long leaves the plan")
    scheduler_grace_s: float = setting(
        30.0, help="a shard/worker/evaluator whose scheduler is silent this long exits 3"
    )
    kill: list[KillFault] = setting(
        default_factory=list, help="fault injection: SIGKILL these nodes at these times"
    )
    straggler: float = setting(
        0.0, help="every step one seeded-random worker computes 1+this x as long"
    )
    profile_steps: int = setting(20, help="steps timed on the real model before joining (speed)")
    request_timeout_s: float = setting(120.0, help="longest wait for any single reply")
    startup_timeout_s: float = setting(120.0, help="longest wait for the cluster to form")
    max_message_bytes: int = setting(
        1 << 30, help="largest frame a socket takes (>= 1 MiB); each worker checks its model's need"
    )
    chunk_bytes: int | str = setting(
        "auto",
        help="tensors larger than this are cut into parts placed apart; auto = model bytes / (8 x shards), >= 4096; 0 = never",
    )
    faults: MessageFaults = setting(
        default_factory=MessageFaults, help="fault injection on the wire (keys below)"
    )
    retry_s: float = setting(
        2.0,
        help="a node re-sends an unanswered request (push, pull, one to the scheduler) after this (doubling)",
    )
    nonfinite: str = setting(
        "reject", help="NaN/Inf in a push: reject (NONFINITE) | skip (ack, not applied) | clip"
    )
    clip_value: float = setting(1.0, help="nonfinite=clip: NaN -> 0, +-Inf -> +-clip_value")
    replicas: int = setting(
        0, help="backups of each shard's state on the next shard process (0 | 1)"
    )
    spare_shards: int = setting(
        0, help="idle shard processes that become new backups after a failover"
    )
    shard_processes: int = setting(
        0, help="hetps run: serve the shard ranks from this many processes (0: one each)"
    )


@dataclass(frozen=True)
class TargetConfig:
    metric: str = setting(help="a metric of the task: accuracy, perplexity, r2, mse, loss, ...")
    value: float = setting(
        help="reached at >= for a higher-is-better metric, <= for a lower-is-better one"
    )


@dataclass(frozen=True)
class StopConfig:
    target: TargetConfig | None = setting(
        None,
        help="stop at a value of any metric of the task, in its direction (>= accuracy, <= perplexity): {metric: perplexity, value: 3.0}; not with target_accuracy",
    )
    target_accuracy: float | None = setting(
        0.95,
        help="classification shorthand for target {metric: accuracy, value: X}; null = never; the default 0.95 applies only to tasks whose primary (first) metric is accuracy (classification, or a pkg.module:factory task's)",
    )
    target_patience: int = setting(
        1, help="stop at this many evaluations in a row at the target (1: the first)"
    )
    max_seconds: float = setting(
        300.0, help="wall-clock limit of training (of a resumed run: of its new segment)"
    )
    max_steps: int = setting(
        0, help="limit on the sum of all workers' steps (a resumed run's included); 0 = none"
    )
    diverged_after: int = setting(
        5,
        help="stop as diverged after this many evaluations in a row at chance accuracy or a test loss over 10x the first one (after diverge_warmup_s); 0 = never",
    )
    diverge_warmup_s: float = setting(
        20.0, help="evaluations in the first seconds of training do not count"
    )


@dataclass(frozen=True)
class EvalConfig:
    enabled: bool = setting(True, help="run the evaluator (`hetps run`)")
    every_s: float = setting(2.0, help="seconds between evaluations")
    keep_best: bool = setting(
        True, help="also write the best-evaluated model (best.safetensors beside model.safetensors)"
    )
    metric: str | None = setting(
        None,
        help="the watched metric (best model, progress, plots); null = the stop target's metric, else the task's primary one",
    )


@dataclass(frozen=True)
class LogConfig:
    tensorboard: bool = setting(
        False, help="TensorBoard event files in RUN_DIR/tensorboard (needs hetps[tensorboard])"
    )


@dataclass(frozen=True)
class MlflowConfig:
    tracking_uri: str = setting(
        "",
        help='MLflow tracking URI (file:///path/mlruns, http://host:5000, ...); "" = off. Needs hetps[mlflow]',
    )
    experiment: str = setting(
        "hetps", help="experiment the run is logged under (created when missing)"
    )
    run_name: str = setting(
        "",
        help="\"\" = NAME-RUN_ID (the config's name, the run's id); W&B's run takes the same name",
    )


@dataclass(frozen=True)
class WandbConfig:
    project: str = setting("", help='Weights & Biases project; "" = off. Needs hetps[wandb]')
    entity: str = setting("", help='team or user; "" = the logged-in user\'s default')
    mode: str = setting(
        "online", help="online | offline (files only: `wandb sync` uploads them later) | disabled"
    )
    dir: str = setting("", help='where W&B writes its files; "" = RUN_DIR')


@dataclass(frozen=True)
class TrackingConfig:
    mlflow: MlflowConfig = setting(
        default_factory=MlflowConfig,
        help="the scheduler logs params, every evaluation and the summary",
    )
    wandb: WandbConfig = setting(default_factory=WandbConfig, help="the same, to Weights & Biases")


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = setting(
        "", help='shard checkpoints go here; "" = none (`hetps run`: RUN_DIR/checkpoints)'
    )
    every_updates: int = setting(0, help="write after this many applied pushes; 0 = not by count")
    every_s: float = setting(10.0, help="or after this many seconds; 0 = not by time")
    keep: int = setting(2, help="checkpoints kept per shard")


@dataclass(frozen=True)
class SecurityConfig:
    curve: bool = setting(False, help="CurveZMQ on every socket (encryption + client allow-list)")
    keys_dir: str = setting("", help="made by `hetps keys DIR`; env HETPS_KEYS_DIR overrides")


@dataclass(frozen=True)
class CommConfig:
    overlap: bool = setting(
        False, help="push each gradient as backward produces it; wait per layer for the pull"
    )
    compression: str = setting("none", help="none | fp16 | topk  (worker -> shard gradients)")
    topk_ratio: float = setting(
        0.01, help="topk: fraction of each tensor's entries sent (error feedback keeps the rest)"
    )
    fuse_pull: bool = setting(
        True, help="a push asks for the next values itself: one reply carries ACK and values"
    )
    shm_bytes: int = setting(
        0, help="worker -> shard frames of >= this many bytes via shared memory (one host; 0: off)"
    )
    local_transport: str = setting(
        "ipc",
        help="hetps run on one host: scheduler and shards bind ipc (unix sockets) | tcp (loopback)",
    )
    aggregate: str = setting(
        "auto",
        help="auto | on | off: a synchronous group (sync, balanced, grouping) sums its gradients "
        "with a gloo all-reduce and pushes each shard one slice per round (on: every group of two "
        "or more; auto: groups of aggregate_min_group or more)",
    )
    aggregate_min_group: int = setting(
        8,
        help="comm.aggregate: auto reduces groups of at least this many members (smaller ones push "
        "per worker: docs/results.md, Group aggregation)",
    )
    collective_timeout_s: float | None = setting(
        None,
        help="longest wait of a group's collective (null: 20 of its slowest member's steps, >= 10 s)",
    )
    collective_port: int = setting(
        0,
        help="port of each worker's collective store (0: any free port; N: N + the worker's rank)",
    )
    collective_trusted: bool = setting(
        False,
        help="gloo traffic is not CurveZMQ: with security.curve, aggregate only when this says the "
        "workers' network is trusted",
    )


@dataclass(frozen=True)
class SimConfig:
    """The cost model of `hetps simulate` (virtual time; docs/simulation.md)."""

    sample_s: float = setting(
        0.0002, help="compute seconds per training sample of a slowdown-1 worker"
    )
    shard_bytes_per_s: float = setting(
        5e9,
        help="bytes a slowdown-1 shard takes in per second (receive, check, add into the round's sum)",
    )
    shard_message_s: float = setting(
        0.00013,
        help="a slowdown-1 shard's service time per message (decode, dispatch, its reply), on top of its bytes",
    )
    shard_apply_bytes_per_s: float = setting(
        2.5e9, help="parameter bytes a slowdown-1 shard's optimizer step updates per second"
    )
    shard_apply_s: float = setting(
        0.0001, help="a slowdown-1 shard's time per optimizer step, on top of its parameter bytes"
    )
    eval_s: float = setting(
        0.0, help="virtual seconds an evaluation takes (the evaluator's pull is free)"
    )


@dataclass(frozen=True)
class SparseOptimizerConfig:
    """The row-wise optimizer the shards apply to sparse tables' touched rows (docs/sparse.md)."""

    name: str = setting(
        "adagrad",
        help="sgd | adagrad | rowwise_adagrad | adam (lazy: moments of touched rows only, as torch.optim.SparseAdam)",
    )
    lr: float = setting(
        0.05,
        help="the tables' learning rate (constant: optimizer.schedule acts on the dense parameters)",
    )
    eps: float | None = setting(
        None,
        help="null: the optimizer's default (adagrad 1e-10 and adam 1e-8 as torch, rowwise_adagrad 1e-8 as FBGEMM)",
    )
    betas: list[float] = setting(default_factory=lambda: [0.9, 0.999], help="adam")
    initial_accumulator_value: float = setting(0.0, help="adagrad, rowwise_adagrad")


@dataclass(frozen=True)
class SparseConfig:
    """Embedding tables served row by row by every shard (docs/sparse.md)."""

    tables: Any = setting(
        "auto",
        help="auto (every nn.Embedding / nn.EmbeddingBag with at least min_rows rows) | a list of module names | [] (none)",
    )
    min_rows: int = setting(100000, help="auto: the smallest table served sparse")
    init_std: float = setting(0.01, help="rows start as normal(0, init_std), drawn by the shards")
    max_ids: int = setting(1000000, help="most ids one request may name per table")
    optimizer: SparseOptimizerConfig = field(default_factory=SparseOptimizerConfig)


@dataclass(frozen=True)
class RunConfig:
    name: str = setting("default", help="run name: names the run directory")
    seed: int = setting(0, help="seeds model initialization, data order and emulated faults")
    out_dir: str = setting("runs", help="where `hetps run` puts run directories")
    task: TaskConfig = field(default_factory=TaskConfig)
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
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    sim: SimConfig = field(default_factory=SimConfig)


CHOICES: dict[str, tuple[str, ...]] = {
    "model.autocast": ("none", "bfloat16", "float16"),
    "optimizer.name": ("sgd", "adam", "adamw"),
    "optimizer.schedule.clock": ("samples", "updates"),
    "sparse.optimizer.name": ("sgd", "adagrad", "rowwise_adagrad", "adam"),
    "cluster.nonfinite": ("reject", "skip", "clip"),
    "comm.compression": ("none", "fp16", "topk"),
    "comm.local_transport": ("ipc", "tcp"),
    "comm.aggregate": ("auto", "on", "off"),
}
