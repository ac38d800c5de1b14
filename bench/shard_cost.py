"""The simulator's shard cost, measured: a real shard's CPU per message
(receive, decode, add into the open round's sum: `sim.shard_message_s`
plus bytes / `sim.shard_bytes_per_s`) and per optimizer step (the update
applied to the shard's parameters and the reply encoded:
parameter bytes / `sim.shard_apply_bytes_per_s`); docs/simulation.md.

    .venv/bin/python bench/shard_cost.py [--sizes 256,4096,65536,1048576,4194304] [--tensors 1,10]
                                         [--loops 200] [--workers 2,32] [--optimizer sgd] [--momentum 0.9]

One real Shard (ps/shard.py) serves fused PUSH+PULLs in this process through
the simulator's transport (sim/wire.py): the shard's own `serve_once`
decodes the request (the trust boundary's checks included), checks it for
NaN/Inf and hands it to its policy. Under sync (WORKERS workers, one
round per WORKERS pushes) a push that leaves the round open is the receive
cost; the push that closes it also runs the optimizer step and answers the
round's WORKERS parked pulls: the difference between the two, fitted over
the sizes and the worker counts, is the step's cost plus one reply per
worker, and the reply is charged with its message. Under async every push
is both (its fit printed as a check).
ZeroMQ's socket I/O (its own thread) is left out, and so are the
simulator's copies of replies (a socket sends the shard's encoding as it
is). Each row is a push of N float32 tensors of BYTES in all; the times are
thread CPU, best of 3 loops, with one torch thread. Least-squares lines
over the rows give the costs, printed as the config overrides.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch


class _Server:
    """SimServer without the simulator's copy of each reply (a socket sends the encoding as is)."""

    @staticmethod
    def make(address: str):
        from hetps.sim.wire import SimServer

        class Quiet(SimServer):
            def send(self, peer: bytes, frames):
                self.inbox.sent.append((peer, frames))

        return Quiet(address)


def costs_us(
    nbytes: int, n_tensors: int, algorithm: str, workers: int, overrides: list[str], loops: int
) -> tuple[float, float]:
    """(µs per push that leaves a round open, µs per push that closes it): the
    shard's thread CPU, best of 3 loops of `loops` rounds. Under async every
    push closes its own round (both numbers are the same push)."""
    from hetps.proto.messages import Init, Push
    from hetps.proto.plan import ClusterPlan, NodeEntry, TensorSpec
    from hetps.ps.shard import Shard
    from hetps.runconfig.load import load_config
    from hetps.sim.wire import dispatch, request, request_ids

    workers = workers if algorithm == "sync" else 1
    cfg = load_config(None, [f"algorithm.name={algorithm}", *overrides])
    per = max(1, nbytes // 4 // n_tensors)
    specs = [TensorSpec(f"t{i}.weight", "float32", (per,)) for i in range(n_tensors)]
    ids_of = [100 + k for k in range(workers)]
    plan = ClusterPlan(
        plan_id=1,
        algorithm=algorithm,
        workers=[NodeEntry(node, k) for k, node in enumerate(ids_of)],
        shards=[NodeEntry(1, 0, "sim://ps0")],
        tensors=specs,
        placement={s.name: 0 for s in specs},
    )
    shard = Shard(_Server.make("sim://ps0"), 1, plan, cfg)
    ids = request_ids()
    init = Init(plan_id=1, tensors={s.name: torch.randn(s.shape) for s in specs})
    frames, _ = request(init, ids_of[0], ids)
    dispatch(shard, ids_of[0], frames)
    grads = {s.name: torch.randn(s.shape) * 1e-3 for s in specs}
    clock = [0]

    def one_round() -> tuple[float, float]:
        """CPU seconds of the pushes that left the round open, and of the one that closed it."""
        pushes = []
        for node in ids_of:  # encoded before timing: the worker's side, and off a socket as bytes
            push = Push(plan_id=1, clock=clock[0], base_version=clock[0], pull=True, tensors=grads)
            pushes.append((node, [bytes(f) for f in request(push, node, ids)[0]]))
        times = []
        for node, frames in pushes:
            started = time.thread_time()
            dispatch(shard, node, frames)
            times.append(time.thread_time() - started)
        clock[0] += 1
        return sum(times[:-1]), times[-1]

    one_round()
    best_open, best_close = float("inf"), float("inf")
    for _ in range(3):
        rounds = [one_round() for _ in range(loops)]
        opened = sum(r[0] for r in rounds) / max(1, loops * (workers - 1))
        best_open = min(best_open, opened) if workers > 1 else 0.0
        best_close = min(best_close, sum(r[1] for r in rounds) / loops)
    return best_open * 1e6, best_close * 1e6


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
    parser.add_argument(
        "--workers",
        default="2,32",
        help="sync: pushes per round, comma-separated (two or more: the closing push answers "
        "every parked pull, so the step's fixed part is told apart from the replies' by them)",
    )
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    parser.add_argument("--momentum", type=float, default=0.9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    overrides = [f"optimizer.name={args.optimizer}", f"optimizer.momentum={args.momentum}"]
    worker_counts = [int(w) for w in args.workers.split(",")]
    print(
        f"machine: {platform.machine()}, torch {torch.__version__}; {args.optimizer}; "
        "thread CPU µs, best of 3; receive: a push into an open sync round; "
        "apply: the closing push less a receive"
    )
    print(
        f"{'bytes':>10} {'tensors':>8} {'workers':>8} {'receive':>10} {'apply':>10}"
        f" {'async push':>11}"
    )
    receive_rows, apply_rows, asynchronous = [], {w: [] for w in worker_counts}, []
    for n_tensors in (int(t) for t in args.tensors.split(",")):
        for nbytes in (int(s) for s in args.sizes.split(",")):
            base = max(3, args.loops * 65536 // max(nbytes, 65536))
            _, alone = costs_us(nbytes, n_tensors, "async", 1, overrides, base)
            asynchronous.append((nbytes, alone))
            for w in worker_counts:
                opened, closed = costs_us(
                    nbytes, n_tensors, "sync", w, overrides, max(3, base // w)
                )
                receive_rows.append((nbytes, opened))
                apply_rows[w].append((nbytes, closed - opened))
                print(
                    f"{nbytes:>10} {n_tensors:>8} {w:>8} {opened:10.1f} {closed - opened:10.1f}"
                    f" {alone:11.1f}"
                )
    a, b = fit(receive_rows)
    per_w = {w: fit(rows) for w, rows in apply_rows.items()}
    d = sum(slope for _, slope in per_w.values()) / len(per_w)
    print(f"receive fit: {a:.1f} µs per message + {b * 1e3:.3f} µs per KB")
    for w, (c, slope) in per_w.items():
        print(f"apply fit, {w} workers: {c:.1f} µs per step + {slope * 1e3:.3f} µs per KB")
    if len(per_w) > 1:
        # the step's fixed part grows by one reply per parked pull it answers
        apply_s, reply = fit([(w, c) for w, (c, _) in per_w.items()])
    else:
        apply_s, reply = per_w[worker_counts[0]][0], 0.0
    e, f = fit(asynchronous)
    print(f"async fit: {e:.1f} µs per push + {f * 1e3:.3f} µs per KB")
    print(
        f"the step: {apply_s:.1f} µs + {d * 1e3:.3f} µs per KB of parameters; "
        f"a reply: {reply:.1f} µs (charged with its message)"
    )
    print(
        f"sim.shard_message_s={(a + reply) * 1e-6:.2e} sim.shard_bytes_per_s={1e6 / b:.3g} "
        f"sim.shard_apply_s={max(0.0, apply_s) * 1e-6:.2e} "
        f"sim.shard_apply_bytes_per_s={1e6 / d:.3g}"
    )


if __name__ == "__main__":
    main()
