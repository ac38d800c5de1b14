"""The Python of one hetps push+pull round trip, piece by piece, without
sockets: a real Shard (async policy, or sync: one-worker rounds; SGD) and the
real codec in one process, the frames handed over in memory (copied, as
ZeroMQ copies frames this small); the worker's gradients held as a worker
holds them (one buffer in the wire's layout, worker/flat_model.py).
Each piece is timed with perf_counter_ns around the function that does it;
the table gives, per piece, the least mean over many blocks of round trips,
so that on a busy machine the time other processes took is left out (sums of
minima: the pieces may not add up to the total exactly).

    .venv/bin/python bench/rtt_pieces.py [--size lenet|4K|64K|1M] [--momentum 0.9] [--blocks 60]
                                         [--algorithm async|sync] [--gap-ms 0]

Worker: build (the PUSH message), encode (message -> frames), decode (the
PARAMS reply, validated). Shard: decode (validated, catalogue), NaN/Inf
screen, update (the optimizer step, inside handle), handle (the PUSH handler:
policy, update, ACK, values), reply (encode and hand over), total (all of
it, from frames in to frames out). There is no raw ZeroMQ baseline here: the
sockets are what `bench/rtt_breakdown.py` and `bench/transport.py` add.
`--gap-ms` sleeps before each round trip, as a worker computes between its
steps: the pieces then run with cold caches, as they do in training.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

# bench/ is the script's directory
from transport import one_shard_plan, tensor_set, worker_gradients


class Handover:
    """A ServerTransport that holds one request and keeps the last reply (copied, as ZeroMQ does)."""

    address = "mem://pieces"

    def __init__(self):
        self.inbox, self.out = None, None

    def recv(self, timeout_s):
        got, self.inbox = self.inbox, None
        return got

    def send(self, peer, frames):
        self.out = [bytes(memoryview(f)) for f in frames]

    def close(self):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="lenet")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--blocks", type=int, default=60)
    parser.add_argument(
        "--algorithm",
        choices=["async", "sync"],
        default="async",
        help="the shard's policy (sync: a one-worker round per push)",
    )
    parser.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="sleep this long before each round trip (a worker's compute between steps)",
    )
    parser.add_argument("--per-block", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from hetps.proto import rpc
    from hetps.proto.codec import decode, encode
    from hetps.proto.messages import Init, Op, Push
    from hetps.ps import shard as shard_module
    from hetps.ps.shard import Shard
    from hetps.runconfig.load import load_config

    acc: dict[str, int] = {}

    def timed(key, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                acc[key] = acc.get(key, 0) + time.perf_counter_ns() - t0

        return wrapper

    specs = tensor_set(args.size)
    server = Handover()
    cfg = load_config(
        None, [f"algorithm.name={args.algorithm}", f"optimizer.momentum={args.momentum}"]
    )
    shard = Shard(server, 1, one_shard_plan(specs, server.address, args.algorithm), cfg)
    server.inbox = (
        b"w",
        encode(Init(plan_id=1, tensors={s.name: torch.zeros(s.shape) for s in specs}), 1, 2),
    )
    shard.serve_once(0.0)
    rpc.decode = timed("shard decode", rpc.decode)
    shard_module.nonfinite_names = timed("shard NaN/Inf screen", shard_module.nonfinite_names)
    shard.policy.updater.apply = timed("shard update", shard.policy.updater.apply)
    shard.handlers[Op.PUSH] = timed("shard handle", shard.handlers[Op.PUSH])
    shard.reply = timed("shard reply", shard.reply)
    serve, push_of = timed("shard total", shard.serve_once), timed("worker build", Push)
    worker_encode, worker_decode = timed("worker encode", encode), timed("worker decode", decode)
    grads = worker_gradients(specs, [[s.name for s in specs]])

    def round_trip(clock: int) -> None:
        push = push_of(
            plan_id=1,
            clock=clock,
            base_version=clock,
            n_samples=1,
            pull=True,
            tensors=grads,
        )
        server.inbox = (b"w", [bytes(memoryview(f)) for f in worker_encode(push, clock + 10, 2)])
        serve(0.0)
        worker_decode(server.out)

    clock = 0
    for _ in range(50):  # warm-up: the first step, remembered layouts
        round_trip(clock)
        clock += 1
    best: dict[str, float] = {}
    for _ in range(args.blocks):
        acc.clear()
        for _ in range(args.per_block):
            if args.gap_ms:
                time.sleep(args.gap_ms / 1e3)  # idle, as between a worker's steps: caches go cold
            t0 = time.perf_counter_ns()
            round_trip(clock)
            acc["round trip"] = acc.get("round trip", 0) + time.perf_counter_ns() - t0
            clock += 1
        for key, ns in acc.items():
            best[key] = min(best.get(key, float("inf")), ns / args.per_block / 1e3)
    print(
        f"{args.size}, {args.algorithm}, momentum {args.momentum}, gap {args.gap_ms} ms: least mean of "
        f"{args.blocks} blocks of {args.per_block} round trips, {platform.machine()}, torch {torch.__version__}"
    )
    for key in [
        "worker build",
        "worker encode",
        "shard decode",
        "shard NaN/Inf screen",
        "shard update",
        "shard handle",
        "shard reply",
        "shard total",
        "worker decode",
        "round trip",
    ]:
        print(f"  {key:<22} {best.get(key, 0.0):8.1f} us")


if __name__ == "__main__":
    main()
