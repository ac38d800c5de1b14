"""Step time: hetps `sync` against torch DistributedDataParallel (gloo), the
same model, batch, optimizer, process count and threads, measured in the
same run.

    .venv/bin/python bench/step.py [--models lenet5,mlp10m] [--workers 2,4] [--steps 60]
                                   [--warmup 15] [--repeats 3] [--shards 2] [--overlap off,on]
                                   [--fuse-pull on,off] [--local-transport tcp,ipc] [--shard-processes 0,1]

For each model and worker count P:
- DDP: P processes (torch.multiprocessing, spawn), each with
  torch.set_num_threads(1), a gloo process group initialised through a file
  store in a temporary directory (no port is chosen by us), DDP over the
  model built by hetps' own `build_model`, the shards' optimizer (SGD with
  momentum, `build_optimizer`), and the same synthetic data share and batch
  stream a hetps worker gets. Step = batch, zero_grad, forward, backward
  (the all-reduce), optimizer step.
- hetps: `hetps run configs/sync.yaml` (scheduler, shards, P workers as real
  processes, no evaluator) stopped after P x (warmup + steps) worker steps.
  Step time = interval between a worker's consecutive step records (the
  records the workers already send, stamped when a step ends), so it counts
  everything a worker does per step.
Each figure is the median step over the timed steps of all workers, then the
median over the repeats. The ratio is hetps / DDP (1.0 = as fast as DDP).
`compute` is the hetps workers' median forward+backward thread CPU time.
`--overlap off,on` runs hetps both ways (`comm.overlap`), and
`--fuse-pull on,off` with and without the fused push+pull (`comm.fuse_pull`),
every combination against one DDP figure per model and P.
`--local-transport tcp,ipc` (comm.local_transport: loopback tcp or unix
sockets) and `--shard-processes 0,1` (cluster.shard_processes: one process
per shard, or all shards in one) multiply the settings the same way.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "sync.yaml")
# no checkpoint mid-timing
COMMON = ["data.dataset=synthetic", "data.batch_size=32", "seed=0", "checkpoint.every_s=0"]
MODELS = {
    "lenet5": ["model.name=lenet5"],
    "mlp10m": ["model.name=mlp", "model.kwargs.hidden=[2048,2048,2048]"],  # 10.0M parameters
    "mlp-deep": ["model.name=mlp", "model.kwargs.hidden=[1024,1024,1024,1024,1024,1024,1024,1024]"],
    "resnet20": ["model.name=resnet20", "data.synthetic.shape=[3,32,32]"],
}
RUN_TIMEOUT_S = 600.0  # one hetps run or one DDP group, start to end


# ------------------------------------------------------------ DDP (gloo)


def ddp_rank(
    rank: int, world: int, init_file: str, overrides: list[str], warmup: int, steps: int, results
) -> None:
    """One DDP process: time `steps` steps after `warmup`; puts (rank, seconds list)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from hetps.runconfig.load import load_config
    from hetps.runtime.optim import build_optimizer
    from hetps.training.data import BatchStream, load_datasets, partition
    from hetps.training.models import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = load_config(CONFIG, overrides)
        data = load_datasets(cfg.data, cfg.seed)
        torch.manual_seed(cfg.seed)
        model = DistributedDataParallel(build_model(cfg.model, data.in_shape, data.num_classes))
        optimizer = build_optimizer(list(model.parameters()), cfg.optimizer)
        share = partition(len(data.train), rank, world, cfg.seed)
        stream = BatchStream(data.train, share, cfg.data.batch_size, cfg.seed + 1000 * rank + 1)
        times = []
        for _ in range(warmup + steps):
            started = time.perf_counter()
            x, y = stream.next_batch()
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            times.append(time.perf_counter() - started)
        results.put((rank, times[warmup:]))
        dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()


def ddp_step_s(overrides: list[str], world: int, warmup: int, steps: int) -> float:
    """Median DDP step (seconds) over all ranks' timed steps. Every rank is reaped."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hetps-ddp-") as tmp:
        procs = [
            ctx.Process(
                target=ddp_rank, args=(r, world, f"{tmp}/store", overrides, warmup, steps, results)
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        try:
            times = collect(results, procs)
            for p in procs:
                p.join(timeout=60)  # let every rank leave the group cleanly
        finally:
            reap(procs)
    return statistics.median(t for ts in times for t in ts)


def collect(results, procs) -> list[list[float]]:
    """Every rank's step times; raises when a rank dies first or time runs out."""
    deadline, times = time.monotonic() + RUN_TIMEOUT_S, []
    while len(times) < len(procs):
        if time.monotonic() > deadline:
            raise RuntimeError(f"DDP ranks did not finish within {RUN_TIMEOUT_S}s")
        try:
            times.append(results.get(timeout=1.0)[1])
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a DDP rank exited with {dead[0]}") from None
    return times


def reap(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)


# ------------------------------------------------------------ hetps (real daemons)


def hetps_run(overrides: list[str], run_dir: Path) -> None:
    """`hetps run` to completion in its own session; killed whole past RUN_TIMEOUT_S."""
    cmd = [
        sys.executable,
        "-m",
        "hetps.frontend.cli",
        "run",
        CONFIG,
        *overrides,
        "--out",
        str(run_dir),
        "--quiet",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
        raise RuntimeError(f"hetps run {run_dir.name} ran past {RUN_TIMEOUT_S}s") from None
    if proc.returncode != 0:
        raise RuntimeError(
            f"hetps run {run_dir.name} exited with {proc.returncode}:\n{err[-3000:]}"
        )


def step_records(run_dir: Path) -> dict[int, list[dict]]:
    """worker rank -> its step records in step order."""
    by_worker: dict[int, list[dict]] = defaultdict(list)
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "step":
            by_worker[record["worker"]].append(record)
    return {w: sorted(rs, key=lambda r: r["step"]) for w, rs in by_worker.items()}


def hetps_step_s(
    overrides: list[str],
    world: int,
    shards: int,
    setting: list[str],
    warmup: int,
    steps: int,
    tmp: Path,
) -> tuple[float, float]:
    """(median step interval, median compute) in seconds over all workers' timed steps."""
    run_dir = tmp / f"run-{len(list(tmp.iterdir()))}"
    hetps_run(
        [
            *overrides,
            f"cluster.workers={world}",
            f"cluster.shards={shards}",
            "eval.enabled=false",
            "stop.target_accuracy=null",
            f"stop.max_steps={world * (warmup + steps)}",
            "stop.max_seconds=500",
            "cluster.profile_steps=2",
            *setting,
        ],
        run_dir,
    )
    intervals, compute = [], []
    for records in step_records(run_dir).values():
        timed = [r for r in records if r["step"] > warmup]
        intervals += [
            b["t"] - a["t"] for a, b in zip(timed, timed[1:]) if b["step"] == a["step"] + 1
        ]
        compute += [r["compute_s"] for r in timed]
    if len(intervals) < steps:
        raise RuntimeError(f"{run_dir}: only {len(intervals)} timed step intervals")
    return statistics.median(intervals), statistics.median(compute)


# ------------------------------------------------------------ report


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{os.cpu_count()} cores ({cpu}), {gpu}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, 1 torch thread per process"
    )


def bench_one(name: str, world: int, args, tmp: Path) -> list[str]:
    """Table rows for one model and worker count: one per comm setting.
    Repeats are interleaved (DDP, then each hetps setting, again), so a
    change in the machine's load hits every column alike; each repeat starts
    the settings one further along, so none always runs right after DDP."""
    overrides = [*COMMON, *MODELS[name]]
    ddp_runs, runs = [], {label: [] for label in args.settings}
    labels = list(args.settings)
    for repeat in range(args.repeats):
        ddp_runs.append(ddp_step_s(overrides, world, args.warmup, args.steps))
        for label in labels[repeat % len(labels) :] + labels[: repeat % len(labels)]:
            runs[label].append(
                hetps_step_s(
                    overrides,
                    world,
                    args.shards,
                    args.settings[label],
                    args.warmup,
                    args.steps,
                    tmp,
                )
            )
    ddp = statistics.median(ddp_runs)
    rows = []
    for label in args.settings:
        step = statistics.median(r[0] for r in runs[label])
        compute = statistics.median(r[1] for r in runs[label])
        rows.append(
            f"| {name} | {world} | {label} | {step * 1e3:.1f} | "
            f"{compute * 1e3:.1f} | {ddp * 1e3:.1f} | {step / ddp:.2f} |"
        )
        print(rows[-1], flush=True)
    return rows


def comm_settings(
    overlap: list[str],
    fuse: list[str],
    transports: list[str] = ("ipc",),
    shard_processes: list[str] = ("0",),
) -> dict[str, list[str]]:
    """Label ("overlap, fuse[, transport, N shard processes]") -> overrides, for each combination to time."""
    settings = {}
    for o, f, t, n in itertools.product(overlap, fuse, transports, shard_processes):
        label = f"{o}, {f}" + (
            f", {t}, {n} shard proc." if len(transports) > 1 or len(shard_processes) > 1 else ""
        )
        settings[label] = [
            f"comm.overlap={o == 'on'}".lower(),
            f"comm.fuse_pull={f == 'on'}".lower(),
            f"comm.local_transport={t}",
            f"cluster.shard_processes={n}",
        ]
    return settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="lenet5,mlp10m", help=f"from {', '.join(MODELS)}")
    parser.add_argument("--workers", default="2,4", help="worker (= DDP process) counts")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per worker")
    parser.add_argument("--warmup", type=int, default=15, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--shards", type=int, default=2, help="hetps shard processes (configs/sync.yaml: 2)"
    )
    parser.add_argument(
        "--overlap", default="off", help="comm.overlap settings to run: off | on | off,on"
    )
    parser.add_argument(
        "--fuse-pull", default="on", help="comm.fuse_pull settings to run: on | off | on,off"
    )
    parser.add_argument(
        "--local-transport",
        default="ipc",
        help="comm.local_transport settings: ipc | tcp | tcp,ipc",
    )
    parser.add_argument(
        "--shard-processes",
        default="0",
        help="cluster.shard_processes settings: 0 (one per shard) | 1 | 0,1",
    )
    args = parser.parse_args()
    args.settings = comm_settings(
        args.overlap.split(","),
        args.fuse_pull.split(","),
        args.local_transport.split(","),
        args.shard_processes.split(","),
    )
    os.environ["OMP_NUM_THREADS"] = "1"  # as `hetps run` gives its children
    print(f"machine: {machine()}; hetps: {args.shards} shard(s), scheduler, no evaluator")
    print(
        "| model | P | overlap, fused push+pull | hetps sync ms | hetps compute ms | DDP-gloo ms | ratio |"
    )
    print("|---|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory(prefix="hetps-step-") as tmp:
        for name in args.models.split(","):
            for world in map(int, args.workers.split(",")):
                bench_one(name, world, args, Path(tmp))


if __name__ == "__main__":
    main()
