"""The simulator's shard cost, measured: a real shard's CPU per fused
PUSH+PULL as a fixed cost per message plus a cost per byte
(`sim.shard_message_s`, `sim.shard_bytes_per_s`; docs/simulation.md).

    .venv/bin/python bench/shard_cost.py [--sizes 256,4096,65536,1048576,4194304] [--tensors 1,10]
                                         [--loops 200] [--optimizer sgd] [--momentum 0.9]

One real Shard (ps/shard.py, the async policy: every push is applied) serves
pushes from one worker in this process through the simulator's transport
(sim/wire.py): the shard's own `serve_once` decodes the request (the trust
boundary's checks included), checks it for NaN/Inf, steps torch.optim and
encodes the reply with the values; ZeroMQ's socket I/O (its own thread) is
left out. Each row is a push of N float32 tensors of BYTES in all; the time
is thread CPU per push, best of 3 loops, with one torch thread. A least-squares
line over the rows gives the two costs, printed as the config overrides.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch


def push_cost_us(nbytes: int, n_tensors: int, overrides: list[str], loops: int) -> float:
    from hetps.proto.messages import Init, Push
    from hetps.proto.plan import ClusterPlan, NodeEntry, TensorSpec
    from hetps.ps.shard import Shard
    from hetps.runconfig.load import load_config
    from hetps.sim.wire import SimServer, dispatch, request, request_ids

    cfg = load_config(None, ["algorithm.name=async", *overrides])
    per = max(1, nbytes // 4 // n_tensors)
    specs = [TensorSpec(f"t{i}.weight", "float32", (per,)) for i in range(n_tensors)]
    worker = 100
    plan = ClusterPlan(
        plan_id=1,
        algorithm="async",
        workers=[NodeEntry(worker, 0)],
        shards=[NodeEntry(1, 0, "sim://ps0")],
        tensors=specs,
        placement={s.name: 0 for s in specs},
    )
    shard = Shard(SimServer("sim://ps0"), 1, plan, cfg)
    ids = request_ids()
    frames, _ = request(
        Init(plan_id=1, tensors={s.name: torch.randn(s.shape) for s in specs}), worker, ids
    )
    dispatch(shard, worker, frames)
    grads = {s.name: torch.randn(s.shape) * 1e-3 for s in specs}
    version = [0]

    def one() -> float:
        """The shard's CPU seconds for one push (the worker's encoding left out)."""
        push = Push(plan_id=1, clock=version[0], base_version=version[0], pull=True, tensors=grads)
        frames, _ = request(push, worker, ids)
        frames = [bytes(f) for f in frames]  # as received off a socket
        started = time.thread_time()
        dispatch(shard, worker, frames)
        version[0] += 1
        return time.thread_time() - started

    one()
    return min(sum(one() for _ in range(loops)) / loops * 1e6 for _ in range(3))


def fit(rows: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares `us = a + b * bytes`: (a µs per message, b µs per byte)."""
    n = len(rows)
    mx = sum(x for x, _ in rows) / n
    my = sum(y for _, y in rows) / n
    b = sum((x - mx) * (y - my) for x, y in rows) / sum((x - mx) ** 2 for x, _ in rows)
    return my - b * mx, b


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="256,4096,65536,1048576,4194304")
    parser.add_argument("--tensors", default="1,10")
    parser.add_argument("--loops", type=int, default=200)
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    parser.add_argument("--momentum", type=float, default=0.9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    overrides = [f"optimizer.name={args.optimizer}", f"optimizer.momentum={args.momentum}"]
    print(
        f"machine: {platform.machine()}, torch {torch.__version__}; {args.optimizer}; "
        "thread CPU µs per fused push+pull, best of 3"
    )
    print(f"{'bytes':>10} {'tensors':>8} {'us/push':>10}")
    rows = []
    for n_tensors in (int(t) for t in args.tensors.split(",")):
        for nbytes in (int(s) for s in args.sizes.split(",")):
            loops = max(5, args.loops * 65536 // max(nbytes, 65536))
            us = push_cost_us(nbytes, n_tensors, overrides, loops)
            rows.append((nbytes, us))
            print(f"{nbytes:>10} {n_tensors:>8} {us:10.1f}")
    a, b = fit(rows)
    print(f"fit: {a:.1f} µs per message + {b * 1e3:.3f} µs per KB")
    print(f"sim.shard_message_s={a * 1e-6:.2e} sim.shard_bytes_per_s={1e6 / b:.3g}")


if __name__ == "__main__":
    main()
