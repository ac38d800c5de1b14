"""Where one hetps push+pull round trip goes: per-stage times on the worker
and on the shard, measured with perf_counter_ns around each stage of a real
shard process and a real PSClient over ZeroMQ (loopback), next to a raw
pyzmq echo of the same bytes.

    .venv/bin/python bench/rtt_breakdown.py [--size lenet|1M|...] [--seconds 1] [--fuse-pull on|off]

Stages are timed by wrapping the functions that do them (the wrappers cost
~1 us each, included). Worker: encode (message -> frames), send (frames into
ZeroMQ), wait (until the reply is readable: the shard's time and the wire),
recv (frames out of ZeroMQ), decode (frames -> message, incl. validation).
Shard: recv (with the empty non-blocking try before each idle wait),
decode (incl. validation against the catalogue), handle (the PUSH handler
without the update: policy, accept, ACK, reply building), update
(the optimizer step, thread CPU time as the shard counts it), encode and send
of the reply. Means per round trip, in microseconds.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from collections import defaultdict

import torch

# bench/ is the script's directory
from transport import bench_raw, one_shard_plan, tensor_set, time_loop


def timed(acc: dict, key: str, fn):
    def wrapper(*a, **kw):
        t0 = time.perf_counter_ns()
        try:
            return fn(*a, **kw)
        finally:
            acc[key] += time.perf_counter_ns() - t0

    return wrapper


def shard_server(row: str, queue: mp.Queue, stop) -> None:
    torch.set_num_threads(1)
    from hetps.proto import rpc
    from hetps.proto.messages import Op
    from hetps.proto.transport import make_server
    from hetps.ps import shard as shard_mod
    from hetps.ps.shard import Shard
    from hetps.runconfig.load import load_config

    acc: dict = defaultdict(int)
    cfg = load_config(None, ["algorithm.name=async", "optimizer.momentum=0.0"])
    server = make_server("tcp://127.0.0.1:0")
    shard = Shard(server, 1, one_shard_plan(tensor_set(row), server.address), cfg)
    rpc.decode = timed(acc, "decode", rpc.decode)
    shard_mod.encode = timed(acc, "encode reply", shard_mod.encode)
    server.send = timed(acc, "send", server.send)
    server.recv = timed(acc, "recv", server.recv)
    push = shard.handlers[Op.PUSH]
    shard.handlers[Op.PUSH] = timed(acc, "handle", push)
    queue.put(server.address)
    while not stop.is_set() and os.getppid() != 1:
        if shard.serve_once(0.0):
            continue
        t0 = time.perf_counter_ns()
        shard.server.sock.poll(50)  # wait for the next request outside the timed stages
        acc["idle"] += time.perf_counter_ns() - t0
    stats = shard.stats()
    acc["update"] = int(stats["busy_s"] * 1e9)
    acc["handle"] -= acc["update"]
    queue.put((dict(acc), stats["pushes"]))
    server.close()


def run_hetps(row: str, seconds: float, fuse_pull: bool) -> tuple[dict, int, dict, int, float]:
    from hetps.proto import rpc
    from hetps.runconfig.schema import ClusterConfig
    from hetps.worker.client import PSClient

    specs = tensor_set(row)
    q: mp.Queue = mp.Queue()
    stop = mp.Event()
    proc = mp.Process(target=shard_server, args=(row, q, stop), daemon=True)
    proc.start()
    client = PSClient(
        one_shard_plan(specs, q.get(timeout=60)), 2, ClusterConfig(), fuse_pull=fuse_pull
    )
    acc: dict = defaultdict(int)
    client.init({s.name: torch.zeros(s.shape) for s in specs})
    grads = {s.name: torch.full(s.shape, 1e-6) for s in specs}
    transport = client.shards[0].transport
    orig_recv = transport.recv

    def recv(timeout_s):
        t0 = time.perf_counter_ns()
        transport.sock.poll(int(timeout_s * 1000))
        acc["wait"] += time.perf_counter_ns() - t0
        t0 = time.perf_counter_ns()
        try:
            return orig_recv(timeout_s)
        finally:
            acc["recv"] += time.perf_counter_ns() - t0

    transport.recv = recv
    transport.send = timed(acc, "send", transport.send)
    enc, dec = rpc.encode, rpc.decode
    rpc.encode = timed(acc, "encode", enc)
    rpc.decode = timed(acc, "decode", dec)
    clock = [0]

    def step():
        client.push_pull(grads, clock[0], 1)
        clock[0] += 1

    for _ in range(3):
        step()
    acc.clear()
    n, elapsed = time_loop(step, seconds)
    rpc.encode, rpc.decode = enc, dec
    client.close()
    stop.set()
    shard_acc, pushes = q.get(timeout=60)
    proc.join(timeout=10)
    return dict(acc), n, shard_acc, pushes, elapsed / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="lenet")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--fuse-pull", choices=["on", "off"], default="on")
    args = parser.parse_args()
    torch.set_num_threads(1)
    raw = bench_raw(tensor_set(args.size), args.seconds, False)
    acc, n, shard_acc, pushes, rt = run_hetps(args.size, args.seconds, args.fuse_pull == "on")
    print(
        f"{args.size}: raw {raw * 1e6:.0f} us, hetps {rt * 1e6:.0f} us per round trip ({n} round trips)"
    )
    worker = ["encode", "send", "wait", "recv", "decode"]
    for k in worker:
        print(f"  worker {k:<13} {acc.get(k, 0) / n / 1e3:8.1f} us")
    rest = rt * 1e6 - sum(acc.get(k, 0) for k in worker) / n / 1e3
    print(f"  worker {'other':<13} {rest:8.1f} us  (client bookkeeping, loop)")
    for k in ["recv", "decode", "handle", "update", "encode reply", "send"]:
        print(f"  shard  {k:<13} {shard_acc.get(k, 0) / pushes / 1e3:8.1f} us")


if __name__ == "__main__":
    main()
