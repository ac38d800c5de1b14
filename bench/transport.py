"""Transport benchmark: hetps push+pull against a raw pyzmq ping-pong of the
same bytes, measured in the same run on the same machine.

    .venv/bin/python bench/transport.py [--sizes 4K,64K,1M,16M,64M] [--seconds 2]

For each size, a server process holds one float32 tensor of that many bytes:
- raw: a pyzmq ROUTER that echoes every multipart message back (copy=False
  both ways), driven by a DEALER client sending one frame of N bytes;
- hetps: a real shard (async policy, plain SGD) over the hetps codec and
  transport, driven by the worker's PSClient doing push (N bytes) + pull
  (N bytes) per round trip.
Both move 2N bytes per round trip. Prints MB/s for each and the ratio
hetps / raw (1.0 = as fast as raw ZeroMQ).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import time

import torch
import zmq

SIZES = {"4K": 4 << 10, "64K": 64 << 10, "1M": 1 << 20, "16M": 16 << 20, "64M": 64 << 20, "256M": 256 << 20}


def raw_echo_server(port_queue: mp.Queue) -> None:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port_queue.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2 and len(frames[1]) == 0:
            break
        sock.send_multipart(frames, copy=False)
    sock.close(0)


def hetps_shard_server(nbytes: int, addr_queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    from hetps.proto.config import load_config
    from hetps.proto.plan import ClusterPlan, NodeEntry, TensorSpec
    from hetps.proto.transport import make_server
    from hetps.ps.shard import Shard

    cfg = load_config(None, ["algorithm.name=async", "optimizer.momentum=0.0"])
    server = make_server("tcp://127.0.0.1:0")
    plan = ClusterPlan(plan_id=1, algorithm="async", workers=[NodeEntry(2, 0)],
                       shards=[NodeEntry(1, 0, server.address)],
                       tensors=[TensorSpec("w", "float32", (nbytes // 4,))], placement={"w": 0})
    shard = Shard(server, 1, plan, cfg)
    addr_queue.put(server.address)
    while True:
        shard.serve_once(0.1)
        if os.getppid() == 1:  # parent gone
            break


def time_loop(step, seconds: float) -> tuple[int, float]:
    step()  # warm-up
    n, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds or n < 3:
        step()
        n += 1
    return n, time.perf_counter() - started


def bench_raw(nbytes: int, seconds: float) -> float:
    q: mp.Queue = mp.Queue()
    proc = mp.Process(target=raw_echo_server, args=(q,), daemon=True)
    proc.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{q.get(timeout=30)}")
    payload = torch.ones(nbytes // 4).numpy()

    def step():
        sock.send(payload, copy=False)
        sock.recv(copy=False)

    n, elapsed = time_loop(step, seconds)
    sock.send(b"")
    sock.close(0)
    proc.join(timeout=10)
    return 2 * nbytes * n / elapsed / 1e6


def bench_hetps(nbytes: int, seconds: float) -> float:
    from hetps.proto.config import ClusterConfig
    from hetps.proto.plan import ClusterPlan, NodeEntry, TensorSpec
    from hetps.worker.client import PSClient

    q: mp.Queue = mp.Queue()
    proc = mp.Process(target=hetps_shard_server, args=(nbytes, q), daemon=True)
    proc.start()
    address = q.get(timeout=60)
    plan = ClusterPlan(plan_id=1, algorithm="async", workers=[NodeEntry(2, 0)],
                       shards=[NodeEntry(1, 0, address)],
                       tensors=[TensorSpec("w", "float32", (nbytes // 4,))], placement={"w": 0})
    client = PSClient(plan, 2, ClusterConfig())
    client.init({"w": torch.zeros(nbytes // 4)})
    grad = {"w": torch.full((nbytes // 4,), 1e-6)}
    clock = [0]

    def step():
        client.push_pull(grad, clock[0], 1)
        clock[0] += 1

    n, elapsed = time_loop(step, seconds)
    client.close()
    proc.terminate()
    proc.join(timeout=10)
    return 2 * nbytes * n / elapsed / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}, "
          f"torch {torch.__version__}, pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}")
    print(f"{'size':>6} {'raw MB/s':>10} {'hetps MB/s':>11} {'ratio':>6}")
    for name in args.sizes.split(","):
        nbytes = SIZES[name]
        raw = bench_raw(nbytes, args.seconds)
        ours = bench_hetps(nbytes, args.seconds)
        print(f"{name:>6} {raw:10.0f} {ours:11.0f} {ours / raw:6.2f}")


if __name__ == "__main__":
    main()
