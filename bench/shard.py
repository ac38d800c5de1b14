"""Shard throughput: one real shard process fed by N synthetic workers, and
this machine's memory bandwidth measured in the same run (the physical
limit of a CPU parameter server).

    .venv/bin/python bench/shard.py [--rows lenet:4,lenet:64,1M:4,1M:64,100M:2] [--seconds 2]
                                    [--generators 2] [--shm BYTES] [--raw-mib 100]

Each row is SET:N: the tensor set (`lenet`: LeNet-5's 10 parameter tensors,
61,706 floats; `1M`, `100M`: one float32 tensor of that many MiB) and the
number of synthetic workers. The shard runs the async policy with SGD and
momentum 0.9 (every push is one optimizer step), over tcp on loopback. The
workers are RpcClients (one DEALER each, their own node ids) spread over
`--generators` load-generator processes; each keeps one PUSH in flight and
sends the next when its ACK comes. Printed per row:
- updates/s: pushes applied by the shard per second of the timed window;
- grad MB/s: gradient bytes the shard took in per second;
- shard us/update: the shard's busy CPU time per push (its handler time,
  `busy_s` / pushes): the per-message cost, comparable across N;
- traffic/bw: the memory traffic of the updates per second, over the memory
  bandwidth measured here just before the row (`bw GB/s`: the best of five
  torch copies of 256 MiB, read + write; on a shared machine it moves with
  the load, so each row gets its own). Per
  gradient byte: the SGD-momentum step reads the gradient, the parameter and
  the momentum and writes the latter two (5), the finiteness check reads the
  gradient (1), and the way in copies it: over the socket once into the
  kernel and once out of it (2 + 2, each a read and a write: 10 in all);
  with `--shm` the worker's one copy into the shared segment (2: 8 in all).
Compare rows of one run only; on a loaded machine every figure moves.

`--shm BYTES`: frames of at least BYTES go through shared memory
(`comm.shm_bytes`, proto/shm.py) in the shard and the generators.
`--raw-mib N` (0: off): first, as a reference, the one-way throughput of raw
pyzmq messages of N MiB (DEALER to ROUTER, copy=False, a small reply per
message) over tcp on loopback and over ipc, measured in the same run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import tempfile
import time

import torch

MIB = 1 << 20
# SGD-momentum step (read grad, param, buf; write param, buf) + finiteness check (read grad) + the way in:
# a socket copies into the kernel and out of it (read + write each), shared memory once into the segment
TRAFFIC_PER_GRAD_BYTE = {"socket": 5 + 1 + 2 + 2, "shm": 5 + 1 + 2}
FIRST_WORKER = 100  # synthetic workers' node ids: 100, 101, ...


def tensor_specs(name: str) -> list:
    from hetps.proto.plan import TensorSpec

    if name == "lenet":
        from hetps.training.models import LeNet5
        from hetps.training.state import model_specs

        return model_specs(LeNet5((1, 28, 28), 10))
    mib = int(name.rstrip("M"))
    return [TensorSpec("w", "float32", (mib * MIB // 4,))]


def plan_for(specs: list, workers: int, address: str):
    from hetps.proto.plan import ClusterPlan, NodeEntry

    return ClusterPlan(
        plan_id=1,
        algorithm="async",
        workers=[NodeEntry(FIRST_WORKER + r, r) for r in range(workers)],
        shards=[NodeEntry(1, 0, address)],
        tensors=specs,
        placement={s.name: 0 for s in specs},
    )


def memory_bandwidth(nbytes: int = 256 * MIB, repeats: int = 5) -> float:
    """Bytes/s of the best of `repeats` copies of `nbytes` (each byte read once and written once)."""
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return 2 * nbytes / best


def raw_echo(address: str, queue: mp.Queue) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    queue.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while True:
        peer, body = sock.recv_multipart(copy=False)
        sock.send_multipart([peer, b"ok"])
        if not len(body):
            break
    sock.close(0)


def raw_throughput(address: str, nbytes: int, messages: int = 6) -> float:
    """Bytes/s of raw pyzmq messages of `nbytes` sent one at a time (copy=False)
    to a ROUTER in another process that answers each with two bytes."""
    import zmq

    q: mp.Queue = mp.Queue()
    proc = mp.Process(target=raw_echo, args=(address, q), daemon=True)
    proc.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(q.get(timeout=60))
    body = torch.ones(nbytes // 4).numpy()
    sock.send(body, copy=False)  # warm-up
    sock.recv()
    started = time.perf_counter()
    for _ in range(messages):
        sock.send(body, copy=False)
        sock.recv()
    elapsed = time.perf_counter() - started
    sock.send(b"")
    sock.recv()
    sock.close(0)
    proc.join(timeout=30)
    return messages * nbytes / elapsed


def shm_options(shm_bytes: int):
    """Socket options with frames of >= `shm_bytes` through shared memory (0: off)."""
    from hetps.proto.transport import TransportOptions

    return TransportOptions(shm_bytes=shm_bytes)


def shard_server(set_name: str, workers: int, queue: mp.Queue, stop, shm_bytes: int = 0) -> None:
    torch.set_num_threads(1)
    from hetps.proto.transport import make_server
    from hetps.ps.shard import Shard
    from hetps.runconfig.load import load_config

    cfg = load_config(None, ["algorithm.name=async", "optimizer.momentum=0.9"])
    server = make_server("tcp://127.0.0.1:0", shm_options(shm_bytes))
    shard = Shard(server, 1, plan_for(tensor_specs(set_name), workers, server.address), cfg)
    queue.put(server.address)
    while not stop.is_set() and os.getppid() != 1:  # the parent may die without setting `stop`
        shard.serve_once(0.05)
    queue.put(shard.stats())
    server.close()


def generator(
    set_name: str,
    address: str,
    node_ids: list[int],
    ready: mp.Queue,
    start,
    seconds: float,
    queue: mp.Queue,
    shm_bytes: int = 0,
) -> None:
    """Drive `node_ids` workers, one PUSH in flight each, for `seconds` after `start`; report the count."""
    torch.set_num_threads(1)
    from hetps.proto.messages import Push
    from hetps.proto.rpc import RpcClient

    specs = tensor_specs(set_name)
    grads = {s.name: torch.full(s.shape, 1e-6) for s in specs}
    options = shm_options(shm_bytes)
    clients = [RpcClient(address, src=n, timeout_s=120.0, options=options) for n in node_ids]
    clocks = [0] * len(clients)
    ready.put(len(clients))
    start.wait(timeout=300)
    pending = [c.send(Push(plan_id=1, clock=0, base_version=0, tensors=grads)) for c in clients]
    done, ended = 0, time.perf_counter() + seconds
    while time.perf_counter() < ended:
        for i, client in enumerate(clients):
            client.wait(pending[i])
            done += 1
            clocks[i] += 1
            pending[i] = client.send(
                Push(plan_id=1, clock=clocks[i], base_version=0, tensors=grads)
            )
    for i, client in enumerate(clients):  # the last ones in flight: answered, not counted
        client.wait(pending[i])
        client.close()
    queue.put(done)


def bench_row(
    set_name: str, workers: int, seconds: float, generators: int, shm_bytes: int = 0
) -> dict:
    from hetps.proto.messages import Init
    from hetps.proto.rpc import RpcClient

    specs = tensor_specs(set_name)
    q, ready, results, stop, start = mp.Queue(), mp.Queue(), mp.Queue(), mp.Event(), mp.Event()
    shard = mp.Process(
        target=shard_server, args=(set_name, workers, q, stop, shm_bytes), daemon=True
    )
    shard.start()
    address = q.get(timeout=120)
    init = RpcClient(address, src=FIRST_WORKER, timeout_s=120.0)
    init.call(Init(plan_id=1, tensors={s.name: torch.zeros(s.shape) for s in specs}))
    init.close()
    ids = [FIRST_WORKER + r for r in range(workers)]
    gens = [
        mp.Process(
            target=generator,
            args=(set_name, address, ids[g::generators], ready, start, seconds, results, shm_bytes),
            daemon=True,
        )
        for g in range(min(generators, workers))
    ]
    for g in gens:
        g.start()
    for _ in gens:  # connected, gradients built: the timed window starts now
        ready.get(timeout=300)
    start.set()
    pushes = sum(results.get(timeout=seconds + 300) for _ in gens)
    stop.set()
    stats = q.get(timeout=120)
    for p in (*gens, shard):
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
    grad_bytes = sum(torch.Size(s.shape).numel() * 4 for s in specs)
    return {
        "set": set_name,
        "workers": workers,
        "updates_s": pushes / seconds,
        "grad_Bps": pushes * grad_bytes / seconds,
        "shard_us": 1e6 * stats["busy_s"] / max(1, stats["pushes"]),
        "grad_bytes": grad_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="lenet:4,lenet:64,1M:4,1M:64,100M:2")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--generators", type=int, default=2)
    parser.add_argument(
        "--shm",
        type=int,
        default=0,
        metavar="BYTES",
        help="frames of at least BYTES through shared memory (0: all through the socket)",
    )
    parser.add_argument(
        "--raw-mib",
        type=int,
        default=100,
        metavar="N",
        help="reference: raw pyzmq throughput of N MiB messages, tcp and ipc (0: off)",
    )
    args = parser.parse_args()
    mp.set_start_method("spawn")
    torch.set_num_threads(1)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
        f"{args.generators} load generators; shared memory: {f'frames >= {args.shm} bytes' if args.shm else 'off'}"
    )
    if args.raw_mib:
        for kind, address in (
            ("tcp", "tcp://127.0.0.1:*"),
            ("ipc", f"ipc://{tempfile.mkdtemp()}/raw"),
        ):
            rate = raw_throughput(address, args.raw_mib * MIB)
            print(
                f"raw pyzmq {kind}, {args.raw_mib} MiB messages: {rate / 1e6:.0f} MB/s "
                f"({1e3 * args.raw_mib * MIB / rate:.0f} ms each)",
                flush=True,
            )
    per_byte = TRAFFIC_PER_GRAD_BYTE["shm" if args.shm else "socket"]
    print(
        f"{'set':>6} {'workers':>7} {'updates/s':>10} {'grad MB/s':>10} {'shard us/update':>16} {'bw GB/s':>8} "
        f"{'traffic/bw':>11}"
    )
    for row in args.rows.split(","):
        name, workers = row.split(":")
        bandwidth = memory_bandwidth()
        r = bench_row(name, int(workers), args.seconds, args.generators, args.shm)
        print(
            f"{r['set']:>6} {r['workers']:>7} {r['updates_s']:>10.1f} {r['grad_Bps'] / 1e6:>10.1f} "
            f"{r['shard_us']:>16.1f} {bandwidth / 1e9:>8.2f} {per_byte * r['grad_Bps'] / bandwidth:>11.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
