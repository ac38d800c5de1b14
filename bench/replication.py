"""What replicated shards cost: the step time and bytes of one worker's
fused push+pull under `sync` with `cluster.replicas: 0` and `1`, measured in
the same run, for LeNet-5 and a 100 MB MLP.

    .venv/bin/python bench/replication.py [--models lenet5,mlp100m] [--steps 20] [--warmup 3]

Two shard processes (spawned, torch.set_num_threads(1)) serve over ZeroMQ on
loopback; one worker in this process pushes seeded gradients of the model's
real tensors and waits for the next values (`PSClient.push_pull`), `steps`
timed steps after `warmup`. With replicas 1 each shard process is the
primary of its own tensors and holds the other's backup (ps/replication.py),
and a push is acknowledged only after the backup has it. `step` is the
median push+pull time (compute is the same either way and left out),
`bytes/step` the bytes the worker sent and received plus those the primaries
forwarded to their backups, per step. The ratio is R=1 / R=0.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import statistics
import time

import torch

from hetps.proto.plan import ClusterPlan, NodeEntry, schema_hash
from hetps.runconfig.load import load_config
from hetps.scheduler.placement import place
from hetps.training.models import MLP, LeNet5
from hetps.training.state import model_specs, model_tensors
from hetps.worker.client import PSClient

MODELS = {
    "lenet5": lambda: LeNet5((1, 28, 28), 10),
    "mlp100m": lambda: MLP((1, 28, 28), 10, hidden=(5000, 4200)),
}  # 25.0M parameters, 100 MB
SHARD_IDS, WORKER = (1, 2), 3
WAIT_S = 300.0


def shard_process(rank: int, replicas: int, to_main, from_main) -> None:
    """Bind, report the addresses, take the plan, serve until told to stop, report stats."""
    torch.set_num_threads(1)
    from hetps.proto.transport import make_server
    from hetps.ps.replication import ReplicaHost, ReplicatedShard, serve_round
    from hetps.ps.shard import Shard

    cfg = load_config(
        None, ["algorithm.name=sync", "optimizer.momentum=0.9", f"cluster.replicas={replicas}"]
    )
    server = make_server("tcp://127.0.0.1:0")
    host = ReplicaHost(make_server("tcp://127.0.0.1:0"), cfg, SHARD_IDS[rank]) if replicas else None
    to_main.put((rank, server.address, host.address if host else ""))
    plan = from_main.get(timeout=WAIT_S)
    if host is None:
        shard = Shard(server, SHARD_IDS[rank], plan, cfg)
    else:
        shard = ReplicatedShard(server, SHARD_IDS[rank], plan, cfg)
        host.follow(plan)
    stop = from_main  # the next item says stop
    while stop.empty():
        if host is None:
            shard.serve_once(0.05)
        else:
            serve_round(shard, host, 0.05)
    stop.get()
    to_main.put((rank, shard.stats().get("replica_bytes", 0)))
    server.close()
    if host is not None:
        host.close()


def make_plan(model, addresses: list[tuple[str, str]], replicas: int) -> ClusterPlan:
    specs = model_specs(model)
    shards = [NodeEntry(SHARD_IDS[i], i, a) for i, (a, _) in enumerate(addresses)]
    backups = (
        {
            str(SHARD_IDS[i]): {
                "node": SHARD_IDS[(i + 1) % 2],
                "address": addresses[(i + 1) % 2][1],
            }
            for i in range(2)
        }
        if replicas
        else {}
    )
    return ClusterPlan(
        plan_id=1,
        algorithm="sync",
        workers=[NodeEntry(WORKER, 0)],
        shards=shards,
        tensors=specs,
        placement=place(specs, [1.0, 1.0]),
        schema_hash=schema_hash(specs),
        backups=backups,
        run_id="bench",
    )


def measure(name: str, replicas: int, steps: int, warmup: int) -> dict:
    """One cluster: the median step and the bytes per step."""
    model = MODELS[name]()
    ctx = mp.get_context("spawn")
    to_main = ctx.Queue()
    inboxes = [ctx.Queue() for _ in SHARD_IDS]
    procs = [
        ctx.Process(target=shard_process, args=(r, replicas, to_main, inboxes[r])) for r in range(2)
    ]
    for p in procs:
        p.start()
    client = None
    try:
        addresses = dict((r, (a, b)) for r, a, b in (to_main.get(timeout=WAIT_S) for _ in procs))
        plan = make_plan(model, [addresses[0], addresses[1]], replicas)
        for q in inboxes:
            q.put(plan)
        # no re-sends: a slow step must not count a second copy of a push
        client = PSClient(plan, WORKER, load_config(None, ["cluster.retry_s=0"]).cluster)
        client.init({n: t.detach() for n, (t, _) in model_tensors(model).items()})
        times = []
        for clock in range(warmup + steps):
            if clock == warmup:
                sent, received = client.bytes_sent, client.bytes_received
            g = torch.Generator().manual_seed(clock)
            push = {
                n: (torch.randn(t.shape, generator=g) * 1e-3 if kind == "param" else t.detach())
                for n, (t, kind) in model_tensors(model).items()
            }
            started = time.perf_counter()
            client.push_pull(push, clock, 32)
            times.append(time.perf_counter() - started)
        worker_bytes = client.bytes_sent - sent + client.bytes_received - received
        for q in inboxes:
            q.put("stop")
        replica = sum(b for _, b in (to_main.get(timeout=WAIT_S) for _ in procs))
    finally:
        if client is not None:
            client.close()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    # replica bytes count the warm-up steps and the INIT too: prorated per step over all pushes
    per_push = replica / (warmup + steps + 1) if replicas else 0.0
    return {
        "step_ms": statistics.median(times[warmup:]) * 1e3,
        "bytes_per_step": worker_bytes / steps + per_push,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="lenet5,mlp100m")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    print(
        f"# {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, steps {args.steps}"
    )
    print("| model | MB | R=0 step ms | R=1 step ms | ratio | R=0 MB/step | R=1 MB/step | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        mb = (
            sum(t.numel() * t.element_size() for t, _ in model_tensors(MODELS[name]()).values())
            / 1e6
        )
        r0, r1 = (measure(name, r, args.steps, args.warmup) for r in (0, 1))
        print(
            f"| {name} | {mb:.1f} | {r0['step_ms']:.2f} | {r1['step_ms']:.2f} | "
            f"{r1['step_ms'] / r0['step_ms']:.2f} | {r0['bytes_per_step'] / 1e6:.2f} | "
            f"{r1['bytes_per_step'] / 1e6:.2f} | {r1['bytes_per_step'] / r0['bytes_per_step']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
