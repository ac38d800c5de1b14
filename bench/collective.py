"""Gloo all-reduce against the PS push path, the same bytes, on this machine:
what a group that reduces before the shards (issue 40) pays for its
collective, beside one worker's push+reply to a real shard; and the fit of
the simulator's collective cost (sim/costs.py `allreduce_s`) to it.

    .venv/bin/python bench/collective.py [--sizes 4K,64K,1M,16M,64M] [--k 2,4,8]
                                         [--repeats 3] [--seconds 0.5] [--quick]

- all-reduce: k spawned processes (one torch thread each) join one gloo
  group (worker/collective_group.py: a TCPStore served by this process on a
  random port, a PrefixStore, ProcessGroupGloo; no init_process_group) and
  all-reduce (SUM) one float32 tensor of each size; rank 0 times each
  all-reduce from a barrier (every member starts together) to its own
  completion. Median over the loops (fewer for bigger sizes and groups).
- push+reply: bench/transport.py's hetps row: one PSClient pushes the
  tensor as a gradient to a real shard process (async, plain SGD) over tcp
  loopback and gets the fused PARAMS reply (the same bytes back); seconds per
  round trip, the median of `--repeats` runs. It does not depend on k.
- ratio: all-reduce / push+reply, both measured in this run.
- fit: weighted least squares (relative error) of the ring model
  t = 2(k-1)/k x bytes / bytes_per_s + 2(k-1) x hop_s, printed as
  sim/costs.py's constants, over the rows whose k is at most this machine's
  cores: with more members than cores they take turns on the CPUs, and every
  ring step waits for the next member to be scheduled, which is this
  machine's contention, not a link's (the simulator gives each member its own
  host). The fit over every row is printed beside it, and each row's
  measured time against the fit's.

`--quick`: sizes 4K,64K,1M, k 2,4, one repeat, short loops (a check that it runs).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import time

import torch
from transport import SIZES, bench_hetps, cpu_model  # bench/ is on sys.path when this runs

TIMEOUT_S = 120  # a group's rendezvous and each collective; a child's result
SPAWN_TIMEOUT_S = 300  # k children importing torch on a loaded 2-core machine


def loops_for(nbytes: int, k: int, quick: bool) -> int:
    """All-reduces timed per size: about 256 MiB moved per member at most, at least 5."""
    n = (256 << 20) // (nbytes * k)
    return max(2, min(6, n)) if quick else max(5, min(40, n))


def member(port: int, rank: int, k: int, sizes: list[int], quick: bool, results) -> None:
    """One spawned member of the k-group: times its all-reduces; rank 0 reports their medians."""
    torch.set_num_threads(1)
    from hetps.worker.collective_group import gloo_group

    try:
        group = gloo_group("127.0.0.1", port, f"bench/k{k}", rank, k, TIMEOUT_S)
    except Exception as e:  # the parent stops waiting at once instead of at its timeout
        results.put(("failed", rank, repr(e)))
        raise
    try:
        for nbytes in sizes:
            tensor = torch.zeros(nbytes // 4)  # zeros: repeated sums stay finite
            group.allreduce_sum(tensor)  # warm-up: the pairs' buffers for this size
            times = []
            for _ in range(loops_for(nbytes, k, quick)):
                group.barrier()
                started = time.perf_counter()
                group.allreduce_sum(tensor)
                times.append(time.perf_counter() - started)
            if rank == 0:
                results.put((nbytes, statistics.median(times), len(times)))
    except Exception as e:
        results.put(("failed", rank, repr(e)))
        raise
    finally:
        group.close()
    results.put(("done", rank))


def allreduce_medians(k: int, sizes: list[int], quick: bool) -> dict[int, tuple[float, int]]:
    """Per size, (median seconds of rank 0's all-reduces, loops) in a group of k spawned processes."""
    from hetps.worker.collective_group import open_store

    store = open_store("127.0.0.1", 0, is_owner=True, timeout_s=TIMEOUT_S)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=member, args=(store.port, r, k, sizes, quick, results), daemon=True)
        for r in range(k)
    ]
    for p in procs:
        p.start()
    medians: dict[int, tuple[float, int]] = {}
    try:
        done = 0
        while done < k:
            first, second, *rest = results.get(timeout=SPAWN_TIMEOUT_S)
            if first == "done":
                done += 1
            elif first == "failed":
                raise RuntimeError(f"k={k}: member {second} failed: {rest[0]}")
            else:
                medians[first] = (second, rest[0])
        for p in procs:
            p.join(timeout=TIMEOUT_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"k={k}: members exited {failed}")
    return medians


def push_medians(rows: list[str], repeats: int, seconds: float) -> dict[int, float]:
    """Per size, the median over `repeats` of seconds per push+reply to a real shard."""
    return {
        SIZES[row]: statistics.median(bench_hetps(row, seconds, "")[0] for _ in range(repeats))
        for row in rows
    }


def fit_ring(rows: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(bytes_per_s, hop_s) of t = 2(k-1)/k x bytes / bytes_per_s + 2(k-1) x hop_s, fitted to
    (bytes, k, seconds) rows by least squares on the relative error (every size counts alike)."""
    # t = a*x + b*y with x = 2(k-1)/k*bytes, y = 2(k-1); each row divided by t
    sxx = sxy = syy = sxt = syt = 0.0
    for nbytes, k, t in rows:
        x, y = 2 * (k - 1) / k * nbytes / t, 2 * (k - 1) / t
        sxx, sxy, syy, sxt, syt = sxx + x * x, sxy + x * y, syy + y * y, sxt + x, syt + y
    det = sxx * syy - sxy * sxy
    a, b = (sxt * syy - syt * sxy) / det, (syt * sxx - sxt * sxy) / det
    if b < 0:  # no latency visible: bandwidth alone
        a, b = sxt / sxx, 0.0
    return 1 / a, b


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M", help=f"of {','.join(SIZES)}")
    parser.add_argument("--k", default="2,4,8", help="group sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="push+reply runs per size")
    parser.add_argument("--seconds", type=float, default=0.5, help="per push+reply run")
    parser.add_argument("--quick", action="store_true", help="4K,64K,1M at k 2,4, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.k, args.repeats, args.seconds = "4K,64K,1M", "2,4", 1, 0.2
    rows = args.sizes.split(",")
    unknown = [r for r in rows if r not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {unknown} (known: {','.join(SIZES)})")
    sizes = [SIZES[r] for r in rows]
    ks = [int(k) for k in args.k.split(",")]
    torch.set_num_threads(1)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {cpu_model()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}; gloo all-reduce SUM "
        f"float32 over loopback, median of each size's loops; push+reply: median of {args.repeats}"
    )
    started = time.perf_counter()
    push = push_medians(rows, args.repeats, args.seconds)
    print(
        f"{'bytes':>10} {'k':>3} {'loops':>5} {'all-reduce s':>12} {'push+reply s':>12}"
        f" {'all-reduce/push':>15}"
    )
    fitted = []
    for k in ks:
        for nbytes, (median, loops) in sorted(allreduce_medians(k, sizes, args.quick).items()):
            fitted.append((nbytes, k, median))
            print(
                f"{nbytes:>10} {k:>3} {loops:>5} {median:12.6f} {push[nbytes]:12.6f}"
                f" {median / push[nbytes]:15.2f}",
                flush=True,
            )
    big = max(sizes)
    for k in ks:
        t = next(m for b, kk, m in fitted if b == big and kk == k)
        print(
            f"ratio at {big} bytes, k={k}: one all-reduce = {t / push[big]:.2f}x one push+reply; "
            f"all-reduce + one push = {(t + push[big]) / (k * push[big]):.2f}x k pushes one "
            "after another"
        )
    cores = os.cpu_count() or 1
    own_cpus = [row for row in fitted if row[1] <= cores] or fitted
    if len({b for b, _, _ in own_cpus}) >= 2:
        bytes_per_s, hop_s = fit_ring(own_cpus)
        every_rate, every_hop = fit_ring(fitted)
        print(
            f"ring fit, k <= {cores} cores: t = 2(k-1)/k x bytes / {bytes_per_s:.3g} B/s "
            f"+ 2(k-1) x {hop_s:.3g} s (sim/costs.py GLOO_BYTES_PER_S, GLOO_HOP_S); "
            f"over every row: {every_rate:.3g} B/s, {every_hop:.3g} s"
        )
        for nbytes, k, t in fitted:
            model = 2 * (k - 1) / k * nbytes / bytes_per_s + 2 * (k - 1) * hop_s
            print(f"  {nbytes:>10} k={k}: measured {t:.6f} s, fit {model:.6f} s ({model / t:.2f}x)")
    print(f"bench took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
