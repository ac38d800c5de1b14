"""The experiment configuration's schema: one frozen dataclass per section,
typed, strict, every default named here (docs/configuration.md is generated
from these classes by reference.py).

Loading a file with overrides, building these classes from plain data and
checking every value is load.py's (`load_config`); the checks of values and
cross-field rules are checks.py's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hetps.proto.errors import ConfigError  # noqa: F401  (re-exported: callers catch hetps.runconfig.schema.ConfigError)

from .algorithm_params import SyncParams

BUILTIN_MODELS = ("mlp", "lenet5", "resnet20")
DATASETS = ("mnist-5k", "mnist", "cifar10", "cifar100", "imagefolder", "synthetic")
TASKS = ("classification", "regression", "binary", "language_model")
SCHEDULES = ("constant", "step", "cosine")


@dataclass(frozen=True)
class ModelConfig:
    name: str = "lenet5"       # mlp | lenet5 | resnet20 | a torchvision.models name | pkg.module:factory
    kwargs: dict = field(default_factory=dict)  # passed to the model's constructor
    autocast: str = "none"     # train forward passes under torch.autocast: none | bfloat16 | float16 (loss scaling; the rest stays float32)


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
    num_classes: int | None = None  # classification: the class count (else the dataset's num_classes or classes)
    num_workers: int = 0       # DataLoader processes per worker (0: batches are read in the worker's own process)
    accumulate: int = 1        # gradient accumulation: batches whose gradients are averaged into each push or local step (one batch of batch_size x accumulate)


@dataclass(frozen=True)
class TaskConfig:
    name: str = "classification"  # classification | regression | language_model | binary | pkg.module:factory (docs/own-model.md)
    kwargs: dict = field(default_factory=dict)  # pkg.module:factory tasks: passed to the factory


@dataclass(frozen=True)
class ScheduleConfig:
    name: str = "constant"     # constant | step | cosine | pkg.module:factory (factory(optimizer, **kwargs) -> an LR scheduler)
    kwargs: dict = field(default_factory=dict)  # pkg.module:factory schedules: passed to the factory
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
    at_s: float | None = None  # seconds after training began (the first plan); this or at_step
    at_step: int | None = None  # once the workers' steps recorded in RUN_DIR/metrics.jsonl (all workers, this launch) number this many
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
    max_message_bytes: int = 1 << 30       # largest frame a socket takes (>= 1 MiB); each worker checks its model's need
    chunk_bytes: int | str = "auto"        # tensors larger than this are cut into parts placed apart; auto = model bytes / (8 x shards), >= 4096; 0 = never
    faults: MessageFaults = field(default_factory=MessageFaults)
    retry_s: float = 2.0                   # a worker re-sends an unanswered push/pull after this (doubling)
    nonfinite: str = "reject"              # NaN/Inf in a push: reject (NONFINITE) | skip (ack, not applied) | clip
    clip_value: float = 1.0                # nonfinite=clip: NaN -> 0, +-Inf -> +-clip_value
    replicas: int = 0                      # backups of each shard's state on the next shard process (0 | 1)
    spare_shards: int = 0                  # idle shard processes that become new backups after a failover
    shard_processes: int = 0               # hetps run: serve the shard ranks from this many processes (0: one each)


@dataclass(frozen=True)
class TargetConfig:
    metric: str                # a metric of the task: accuracy, perplexity, r2, mse, loss, ...
    value: float               # reached at >= for a higher-is-better metric, <= for a lower-is-better one


@dataclass(frozen=True)
class StopConfig:
    target: TargetConfig | None = None     # stop at a value of any metric of the task, in its direction (>= accuracy, <= perplexity): {metric: perplexity, value: 3.0}; not with target_accuracy
    target_accuracy: float | None = 0.95   # classification shorthand for target {metric: accuracy, value: X}; null = never; the default applies to classification and pkg.module:factory tasks with an accuracy metric
    target_patience: int = 1               # stop at this many evaluations in a row at the target (1: the first)
    max_seconds: float = 300.0             # wall-clock limit of training (of a resumed run: of its new segment)
    max_steps: int = 0                     # limit on the sum of all workers' steps (a resumed run's included); 0 = none
    diverged_after: int = 5                # stop as diverged after this many evaluations in a row at
                                           # chance accuracy or a test loss over 10x the first one
                                           # (after diverge_warmup_s); 0 = never
    diverge_warmup_s: float = 20.0         # evaluations in the first seconds of training do not count


@dataclass(frozen=True)
class EvalConfig:
    enabled: bool = True
    every_s: float = 2.0
    keep_best: bool = True     # also write the best-evaluated model (best.safetensors beside model.safetensors)
    metric: str | None = None  # the watched metric (best model, progress, plots); null = the stop target's metric, else the task's primary one


@dataclass(frozen=True)
class LogConfig:
    tensorboard: bool = False  # TensorBoard event files in RUN_DIR/tensorboard (needs hetps[tensorboard])


@dataclass(frozen=True)
class MlflowConfig:
    tracking_uri: str = ""     # MLflow tracking URI (file:///path/mlruns, http://host:5000, ...); "" = off. Needs hetps[mlflow]
    experiment: str = "hetps"  # experiment the run is logged under (created when missing)
    run_name: str = ""         # "" = NAME-RUN_ID (the config's name, the run's id); W&B's run takes the same name


@dataclass(frozen=True)
class WandbConfig:
    project: str = ""          # Weights & Biases project; "" = off. Needs hetps[wandb]
    entity: str = ""           # team or user; "" = the logged-in user's default
    mode: str = "online"       # online | offline (files only: `wandb sync` uploads them later) | disabled
    dir: str = ""              # where W&B writes its files; "" = RUN_DIR


@dataclass(frozen=True)
class TrackingConfig:
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)  # the scheduler logs params, every evaluation and the summary
    wandb: WandbConfig = field(default_factory=WandbConfig)     # the same, to Weights & Biases


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
    shard_bytes_per_s: float = 5e9     # bytes a slowdown-1 shard takes in per second (receive, check, add into the round's sum)
    shard_message_s: float = 0.00013   # a slowdown-1 shard's service time per message (decode, dispatch, its reply), on top of its bytes
    shard_apply_bytes_per_s: float = 2.5e9  # parameter bytes a slowdown-1 shard's optimizer step updates per second
    shard_apply_s: float = 0.0001      # a slowdown-1 shard's time per optimizer step, on top of its parameter bytes
    eval_s: float = 0.0                # virtual seconds an evaluation takes (the evaluator's pull is free)


@dataclass(frozen=True)
class SparseOptimizerConfig:
    """The row-wise optimizer the shards apply to sparse tables' touched rows (docs/sparse.md)."""
    name: str = "adagrad"      # sgd | adagrad | rowwise_adagrad | adam (lazy: moments of touched rows only, as torch.optim.SparseAdam)
    lr: float = 0.05           # the tables' learning rate (constant: optimizer.schedule acts on the dense parameters)
    eps: float | None = None   # null: the optimizer's default (adagrad 1e-10 and adam 1e-8 as torch, rowwise_adagrad 1e-8 as FBGEMM)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adam
    initial_accumulator_value: float = 0.0  # adagrad, rowwise_adagrad


@dataclass(frozen=True)
class SparseConfig:
    """Embedding tables served row by row by every shard (docs/sparse.md)."""
    tables: Any = "auto"       # auto (every nn.Embedding / nn.EmbeddingBag with at least min_rows rows) | a list of module names | [] (none)
    min_rows: int = 100000     # auto: the smallest table served sparse
    init_std: float = 0.01     # rows start as normal(0, init_std), drawn by the shards
    max_ids: int = 1000000     # most ids one request may name per table
    optimizer: SparseOptimizerConfig = field(default_factory=SparseOptimizerConfig)


@dataclass(frozen=True)
class RunConfig:
    name: str = "default"
    seed: int = 0
    out_dir: str = "runs"
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
    "sparse.optimizer.name": ("sgd", "adagrad", "rowwise_adagrad", "adam"),
    "cluster.nonfinite": ("reject", "skip", "clip"),
    "comm.compression": ("none", "fp16", "topk"),
    "comm.local_transport": ("ipc", "tcp"),
}
