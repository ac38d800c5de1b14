"""Sparse tables, measured: each section prints a table and its ratios, every
figure of a ratio measured in the same run of this script.

    .venv/bin/python bench/sparse.py [steps|memory|rows|ddp|all] [--quick]
                                     [--rows 100000,1000000,10000000] [--dims 32,64]
                                     [--workers 2] [--steps 60] [--warmup 10]

The model (bench/sparse_model.py): one nn.EmbeddingBag of R rows x D (mode
sum) over bags of 7 power-law ids, under a 2-layer MLP, batch 256; hetps
runs are `hetps run` (scheduler, 2 shards, workers as real processes, async,
no evaluator, no checkpoints while timing) with this folder on PYTHONPATH.

- `steps`: bytes and time per step, the table served sparse
  (`sparse.tables=[table]`: a worker pulls and pushes the rows its batch
  names) against the dense path (`sparse.tables=[]`: the whole table pulled
  and pushed each step). Bytes per step: the workers' bytes sent + received
  (summary.json) / their steps; time per step: the median interval between a
  worker's consecutive step records after `--warmup`. Dense cases whose
  table exceeds `--dense-max-mb` are skipped, with the reason printed.
- `memory`: a worker's resident memory (VmRSS, sampled from /proc while it
  trains; and its peak VmHWM, model build included) as the table grows 100x
  (1e5 -> 1e7 rows, D 32), against the same model with a 1000-row table.
- `rows`: rows/s a shard's SparseTables updates (adagrad, "each" mode, a
  1e6 x 32 table, pushes of 4096 unique ids), against the same update done
  by torch in one process (torch.optim.Adagrad on an nn.Embedding(sparse=True)
  gradient), and over the wire (a Shard in its own process over ZeroMQ ipc:
  PUSH_ROWS round trips from this process).
- `ddp`: time per step of torch DDP (gloo, P processes, the same model with
  nn.EmbeddingBag(sparse=True), SGD on the table and the MLP: DDP all-reduces
  the sparse gradient by all-gather) against hetps sync, P workers, 2 shards.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from sparse_model import status_kb  # bench/ is on sys.path when this script runs
from step import machine

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BATCH = 256
RUN_TIMEOUT_S = 900.0
CONFIG = """\
name: sparse-bench
seed: 0
model: {{name: "sparse_model:dlrm", kwargs: {{rows: {rows}, dim: {dim}}}}}
data: {{dataset: "sparse_model:clicks", kwargs: {{rows: {rows}}}, batch_size: 256}}
optimizer: {{name: sgd, lr: 0.05, momentum: 0.9}}
algorithm: {{name: {algorithm}}}
cluster: {{shards: 2, workers: {workers}, max_message_bytes: {max_bytes}}}
sparse: {{tables: {tables}, optimizer: {{name: {sparse_opt}, lr: 0.1}}}}
stop: {{max_steps: {max_steps}, max_seconds: 800}}
eval: {{enabled: false, keep_best: false}}
checkpoint: {{every_s: 0, every_updates: 0}}
"""


# ------------------------------------------------------------ hetps runs


def worker_pids(run_dir: Path) -> list[int]:
    """Training workers of the run in `run_dir` (not the check process)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ") + b" "
        except OSError:
            continue
        if str(run_dir).encode() in cmd and b"hetps.worker " in cmd:
            out.append(int(entry.name))
    return out


RUNS: dict[tuple, dict] = {}  # one run serves every section that asks for the same settings


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def too_big(rows: int, dim: int, sparse: bool) -> str | None:
    """Why a run of this table would not fit this machine's free memory now, or None.
    Sparse: the check process's dense dry step (table + its dense gradient), each
    worker's table at build, the shards' rows + adagrad state, copied again by the
    final checkpoint: about 4.5 tables. Dense: every worker holds table, gradient
    and the pulled copy, the shards table and momentum: about 8 tables."""
    table = rows * dim * 4
    need = (4.5 if sparse else 8) * table + (2 << 30)
    free = mem_available()
    if need > free:
        return f"needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available"
    return None


def hetps_run(tmp: Path, *, rows: int, dim: int, workers: int, steps: int, sparse: bool, **kw):
    """One `hetps run` (or the same settings' earlier result). Returns {"step_s",
    "bytes_per_step", "rss_kb", "peak_kb", "losses"}: the median step interval after
    the warm-up, the workers' bytes per step, each worker's largest VmRSS while
    training and its peak VmHWM (pid -> kB), the step losses."""
    key = (rows, dim, workers, steps, sparse, tuple(sorted(kw.items())))
    if key not in RUNS:
        RUNS[key] = one_run(
            tmp, rows=rows, dim=dim, workers=workers, steps=steps, sparse=sparse, **kw
        )
    return RUNS[key]


def one_run(tmp: Path, *, rows: int, dim: int, workers: int, steps: int, sparse: bool, **kw):
    run_dir = tmp / f"run-{len(list(tmp.iterdir()))}"
    config = run_dir.with_suffix(".yaml")
    table_bytes = rows * dim * 4
    config.write_text(
        CONFIG.format(
            rows=rows,
            dim=dim,
            workers=workers,
            algorithm=kw.get("algorithm", "async"),
            tables="[table]" if sparse else "[]",
            sparse_opt=kw.get("sparse_opt", "adagrad"),
            max_steps=workers * steps,
            # the dense path's whole-table messages (a pull carries a shard's half)
            max_bytes=max(1 << 30, table_bytes + (64 << 20)),
        )
    )
    rss: dict[int, int] = {}
    peak: dict[int, int] = {}
    done = threading.Event()

    def sample():
        while not done.wait(0.1):
            metrics = run_dir / "metrics.jsonl"
            stepping = metrics.exists() and '"kind": "step"' in metrics.read_text()
            for pid in worker_pids(run_dir):
                r, h = status_kb(pid, "VmRSS"), status_kb(pid, "VmHWM")
                if r is None or h is None:
                    continue
                peak[pid] = max(peak.get(pid, 0), h)
                if stepping and not (run_dir / "summary.json").exists():
                    rss[pid] = max(rss.get(pid, 0), r)

    cmd = [sys.executable, "-m", "hetps.frontend.cli", "run", str(config), "--out", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    proc = subprocess.Popen(
        [*cmd, "--quiet"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
        raise RuntimeError(f"{run_dir} ran past {RUN_TIMEOUT_S}s") from None
    finally:
        done.set()
        sampler.join(timeout=10)
    if proc.returncode != 0:
        raise RuntimeError(f"{run_dir} exited with {proc.returncode}:\n{err[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    workers_of = [v for k, v in summary["per_node"].items() if k.startswith("worker")]
    total_steps = sum(v["steps"] for v in workers_of)
    by_worker = defaultdict(list)
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "step":
            by_worker[r["worker"]].append(r)
    warmup = kw.get("warmup", 10)
    intervals, losses = [], []
    for records in by_worker.values():
        records.sort(key=lambda r: r["step"])
        losses += [r["loss"] for r in records]
        timed = [r for r in records if r["step"] > warmup]
        intervals += [
            b["t"] - a["t"] for a, b in zip(timed, timed[1:]) if b["step"] == a["step"] + 1
        ]
    return {
        "step_s": statistics.median(intervals) if intervals else float("nan"),
        "bytes_per_step": sum(v["sent"] + v["received"] for v in workers_of) / max(1, total_steps),
        "rss_kb": rss,
        "peak_kb": peak,
        "losses": losses,
    }


def section_steps(args, tmp: Path) -> None:
    print(f"\n## Per step: sparse against dense ({args.workers} workers, 2 shards, async)\n")
    print(
        "| rows | dim | table MB | sparse ms/step | dense ms/step | time ratio dense/sparse "
        "| sparse KB/step | dense KB/step | bytes ratio dense/sparse |"
    )
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for rows in args.rows:
        for dim in args.dims:
            mb = rows * dim * 4 / 1e6
            common = dict(rows=rows, dim=dim, workers=args.workers, warmup=args.warmup)
            why = too_big(rows, dim, sparse=True)
            if why:
                print(f"| {rows:.0e} | {dim} | {mb:.0f} | skipped: {why} |", flush=True)
                continue
            sp = hetps_run(tmp, steps=args.steps, sparse=True, **common)
            if too_big(rows, dim, sparse=False):
                dense = None
                why = f"dense skipped: {too_big(rows, dim, sparse=False)}"
            elif mb > args.dense_max_mb:
                dense = None
                why = (
                    f"dense skipped: a {mb:.0f} MB table pulled and pushed whole each step "
                    f"(over --dense-max-mb {args.dense_max_mb}; each worker also holds it and "
                    "its dense gradient)"
                )
            else:
                dense = hetps_run(tmp, steps=args.dense_steps, sparse=False, **common)
            cells = [f"{rows:.0e}", str(dim), f"{mb:.0f}", f"{sp['step_s'] * 1e3:.1f}"]
            if dense:
                cells += [f"{dense['step_s'] * 1e3:.1f}", f"{dense['step_s'] / sp['step_s']:.1f}"]
            else:
                cells += ["—", "—"]
            cells.append(f"{sp['bytes_per_step'] / 1e3:.0f}")
            if dense:
                cells += [
                    f"{dense['bytes_per_step'] / 1e3:.0f}",
                    f"{dense['bytes_per_step'] / sp['bytes_per_step']:.0f}",
                ]
            else:
                cells += ["—", "—"]
            print("| " + " | ".join(cells) + " |", flush=True)
            if not dense:
                print(f"<!-- {rows:.0e} x {dim}: {why} -->", flush=True)


def section_memory(args, tmp: Path) -> None:
    print(f"\n## Worker resident memory as the table grows ({args.workers} workers, D 32)\n")
    print(
        "| rows | table MB | worker VmRSS training MB | above 1000-row baseline MB "
        "| worker peak VmHWM MB | peak above baseline MB |"
    )
    print("|---|---|---|---|---|---|", flush=True)
    base = None
    for rows in [1000, *args.memory_rows]:
        why = too_big(rows, 32, sparse=True)
        if why:
            print(f"| {rows:.0e} | skipped: {why} |", flush=True)
            continue
        r = hetps_run(
            tmp,
            rows=rows,
            dim=32,
            workers=args.workers,
            steps=args.steps,
            sparse=True,
            warmup=args.warmup,
        )
        # nan: no sample caught a worker training (a run shorter than the 0.1 s sampling)
        rss = max(r["rss_kb"].values(), default=float("nan")) / 1024
        peak = max(r["peak_kb"].values(), default=float("nan")) / 1024
        if base is None:
            base = (rss, peak)
        print(
            f"| {rows:.0e} | {rows * 32 * 4 / 1e6:.1f} | {rss:.0f} | {rss - base[0]:+.0f} | "
            f"{peak:.0f} | {peak - base[1]:+.0f} |",
            flush=True,
        )


# ------------------------------------------------------------ rows/s


def adagrad_cfg():
    from hetps.runconfig.load import load_config

    return load_config(
        None,
        [
            "sparse.optimizer.name=adagrad",
            "sparse.optimizer.lr=0.05",
            "algorithm.name=async",
            "sparse.tables=[emb]",
        ],
    )


def batches(rows: int, ids_per_push: int, n: int, dim: int):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randperm(rows, generator=g)[:ids_per_push].sort().values
        out.append((ids, torch.randn(ids_per_push, dim, generator=g)))
    return out


def shard_process(address: str, rows: int, dim: int, ready, stop) -> None:
    """A real Shard serving one table over ZeroMQ until `stop` is set."""
    torch.set_num_threads(1)
    from hetps.proto.transport import make_server
    from hetps.ps.shard import Shard

    shard = Shard(make_server(address), 1, wire_plan(address, rows, dim), adagrad_cfg())
    ready.set()
    while not stop.is_set():
        shard.serve_once(0.01)


def wire_plan(address: str, rows: int, dim: int):
    from hetps.proto.plan import ClusterPlan, NodeEntry, TensorSpec

    return ClusterPlan(
        plan_id=1,
        algorithm="async",
        workers=[NodeEntry(11, 0)],
        shards=[NodeEntry(1, 0, address)],
        tensors=[],
        placement={},
        tables=[TensorSpec("emb.weight", "float32", (rows, dim), "table")],
        groups=[[11]],
    )


def section_rows(args, tmp: Path) -> None:
    from hetps.proto.messages import PushRows
    from hetps.proto.rpc import RpcClient
    from hetps.proto.sparse import TableSpec
    from hetps.ps.sparse_tables import SparseTables

    rows, dim, k, n = args.update_rows, 32, 4096, args.pushes
    data = batches(rows, k, n, dim)
    print(f"\n## Rows/s a shard updates (adagrad, {rows:.0e} x {dim}, pushes of {k} unique ids)\n")
    print("| path | rows/s | ratio to torch in one process |")
    print("|---|---|---|", flush=True)
    torch.set_num_threads(1)

    emb = torch.nn.Embedding(rows, dim, sparse=True)
    opt = torch.optim.Adagrad(emb.parameters(), lr=0.05)
    for ids, g in data[:3]:  # warm-up
        emb.weight.grad = torch.sparse_coo_tensor(
            ids[None], g, (rows, dim), check_invariants=False, is_coalesced=True
        )
        opt.step()
    t0 = time.perf_counter()
    for ids, g in data:
        emb.weight.grad = torch.sparse_coo_tensor(
            ids[None], g, (rows, dim), check_invariants=False, is_coalesced=True
        )
        opt.step()
    torch_rps = n * k / (time.perf_counter() - t0)
    del emb, opt

    tables = SparseTables(
        [TableSpec("emb.weight", rows, dim, "float32")], 0, 1, adagrad_cfg().sparse, 0, "each"
    )
    for ids, g in data[:3]:
        tables.push(11, [11], {"emb.weight": (ids, g)})
    t0 = time.perf_counter()
    for ids, g in data:
        tables.push(11, [11], {"emb.weight": (ids, g)})
    ours_rps = n * k / (time.perf_counter() - t0)
    del tables

    ctx = multiprocessing.get_context("spawn")
    address = f"ipc://{tmp}/rows-shard"
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=shard_process, args=(address, rows, dim, ready, stop))
    proc.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("the shard process did not start within 120 s")
        client = RpcClient(address, src=11, timeout_s=60)
        for clock, (ids, g) in enumerate(data[:3] + data):
            if clock == 3:
                t0 = time.perf_counter()
            client.call(
                PushRows(
                    plan_id=1,
                    clock=clock,
                    n_samples=BATCH,
                    tensors={"emb.weight:ids": ids, "emb.weight:rows": g},
                )
            )
        wire_rps = n * k / (time.perf_counter() - t0)
        client.close()
    finally:
        stop.set()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    for name, rps in [
        ("torch Adagrad, nn.Embedding(sparse=True), one process", torch_rps),
        ("SparseTables.push (the shard's update, in process)", ours_rps),
        ("a Shard process over ZeroMQ ipc (PUSH_ROWS round trips)", wire_rps),
    ]:
        print(f"| {name} | {rps:,.0f} | {rps / torch_rps:.2f} |", flush=True)


# ------------------------------------------------------------ DDP


def ddp_rank(rank, world, init_file, rows, dim, warmup, steps, results) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(HERE))
    from sparse_model import clicks, dlrm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        train, _ = clicks(rows=rows)
        torch.manual_seed(0)
        model = dlrm(None, 2, rows=rows, dim=dim)
        model.table = torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        model = DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(rank + 1)
        times = []
        for _ in range(warmup + steps):
            t0 = time.perf_counter()
            idx = torch.randint(len(train), (BATCH,), generator=g)
            x, y = train.tensors[0][idx], train.tensors[1][idx]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        results.put((rank, times[warmup:]))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def ddp_step_s(rows, dim, world, warmup, steps) -> float:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hetps-ddp-") as d:
        procs = [
            ctx.Process(
                target=ddp_rank, args=(r, world, f"{d}/store", rows, dim, warmup, steps, results)
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        try:
            times = [results.get(timeout=RUN_TIMEOUT_S)[1] for _ in procs]
            for p in procs:
                p.join(timeout=60)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
    return statistics.median(t for ts in times for t in ts)


def section_ddp(args, tmp: Path) -> None:
    world = args.workers
    print(f"\n## Against torch DDP (gloo, {world} processes, sparse embedding gradients)\n")
    print("| rows | dim | DDP ms/step | hetps sync ms/step (2 shards) | ratio hetps/DDP |")
    print("|---|---|---|---|---|", flush=True)
    for rows in args.ddp_rows:
        ddp = ddp_step_s(rows, 32, world, args.warmup, args.steps)
        # the same optimizer on the table as DDP's (plain SGD)
        ours = hetps_run(
            tmp,
            rows=rows,
            dim=32,
            workers=world,
            steps=args.steps,
            sparse=True,
            algorithm="sync",
            sparse_opt="sgd",
            warmup=args.warmup,
        )
        print(
            f"| {rows:.0e} | 32 | {ddp * 1e3:.1f} | {ours['step_s'] * 1e3:.1f} | "
            f"{ours['step_s'] / ddp:.2f} |",
            flush=True,
        )


# ------------------------------------------------------------ main


def ints(text: str) -> list[int]:
    return [int(float(v)) for v in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "section", nargs="?", default="all", choices=["steps", "memory", "rows", "ddp", "all"]
    )
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--rows", default="100000,1000000,10000000", help="steps: table rows")
    parser.add_argument("--dims", default="32,64", help="steps: table dims")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60, help="steps per worker (sparse runs)")
    parser.add_argument("--dense-steps", type=int, default=20, help="steps per worker (dense runs)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--dense-max-mb", type=float, default=300.0)
    args = parser.parse_args()
    args.rows, args.dims = ints(args.rows), ints(args.dims)
    args.memory_rows = [100000, 1000000, 10000000]
    args.update_rows, args.pushes = 1000000, 200
    args.ddp_rows = [100000, 1000000, 10000000]
    if args.quick:
        # memory's 1e4 row run is the steps section's
        args.rows, args.dims, args.memory_rows = [10000], [32], [10000]
        args.update_rows, args.pushes, args.ddp_rows = 100000, 20, [10000]
        args.steps, args.dense_steps, args.warmup = 20, 15, 5
    os.environ["OMP_NUM_THREADS"] = "1"
    # torch.optim.Adagrad builds its sparse tensors unchecked, and says so on each run
    warnings.filterwarnings("ignore", "Sparse invariant checks")
    print(f"machine: {machine()}; batch {BATCH}")
    sections = {
        "steps": section_steps,
        "memory": section_memory,
        "rows": section_rows,
        "ddp": section_ddp,
    }
    with tempfile.TemporaryDirectory(prefix="hetps-sparse-") as tmp:
        for name, run in sections.items():
            if args.section in (name, "all"):
                run(args, Path(tmp))


if __name__ == "__main__":
    main()
