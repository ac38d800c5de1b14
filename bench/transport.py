"""Transport benchmark: hetps push+pull against a raw pyzmq ping-pong of the
same bytes, measured in the same run on the same machine.

    .venv/bin/python bench/transport.py [--sizes lenet,4K,64K,1M,16M,64M,256M] [--seconds 1.5]
        [--repeats 3] [--raw-frames one|per-tensor] [--fuse-pull on|off] [--curve] [--shm BYTES]
        [--profile DIR] [--address-scheme tcp|ipc]

Each row is a tensor set: SIZE is one float32 tensor of that many bytes;
`lenet` is the real LeNet-5 parameter set (10 tensors, 61,706 floats).
- raw: a pyzmq ROUTER that echoes every multipart message back (copy=False
  both ways), driven by a DEALER sending the set's bytes, by default as one
  frame (`--raw-frames per-tensor`: one frame per tensor);
- hetps: a real shard (async policy, plain SGD: momentum 0) over the hetps
  codec and transport, driven by the worker's PSClient doing push (the set's
  bytes as gradients) + pull (the set's bytes back) per round trip: one PUSH
  whose PARAMS reply carries the ACK (`comm.fuse_pull`, the default), or with
  `--fuse-pull off` a PUSH and a PULL back to back. `--curve`: hetps with
  CurveZMQ on both sockets (keys in a temporary directory), the raw echo
  still plain, so the ratio includes what encryption costs. `--shm BYTES`:
  hetps frames of at least BYTES through shared memory (`comm.shm_bytes`,
  proto/shm.py) both ways; the raw echo still over the socket.
Both move the set's bytes each way per round trip. The shard's update (the
SGD step, which the echo does not do) is timed inside the shard (thread CPU
seconds per push); `excl. update` is the ratio with that time taken out of
the hetps round trip. Medians over `--repeats` runs (raw and hetps
alternate). `--profile DIR` writes cProfile files of the hetps client and
shard of the last repeat of each row. `--address-scheme ipc`: both the raw
echo and the shard bind a unix socket (ipc://, in a temporary directory)
instead of tcp loopback, as `hetps run` does with comm.local_transport: ipc.
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import zmq

CURVE_CLIENT = "bench"
SIZES = {
    "4K": 4 << 10,
    "64K": 64 << 10,
    "1M": 1 << 20,
    "16M": 16 << 20,
    "64M": 64 << 20,
    "256M": 256 << 20,
}


def tensor_set(row: str) -> list:
    """TensorSpecs of a row: one float32 tensor of SIZE bytes, or LeNet-5's parameters."""
    from hetps.proto.plan import TensorSpec

    if row == "lenet":
        from hetps.training.models import LeNet5
        from hetps.training.state import model_specs

        return model_specs(LeNet5((1, 28, 28), 10))
    return [TensorSpec("w", "float32", (SIZES[row] // 4,))]


def set_nbytes(specs: list) -> int:
    return sum(torch.Size(s.shape).numel() * 4 for s in specs)


def one_shard_plan(specs: list, address: str, algorithm: str = "async"):
    from hetps.proto.plan import ClusterPlan, NodeEntry

    return ClusterPlan(
        plan_id=1,
        algorithm=algorithm,
        workers=[NodeEntry(2, 0)],
        shards=[NodeEntry(1, 0, address)],
        tensors=specs,
        placement={s.name: 0 for s in specs},
    )


def bind_address(scheme: str) -> str:
    """A fresh address to bind: a random tcp loopback port, or a unix socket in a new temporary directory."""
    if scheme == "ipc":
        return f"ipc://{tempfile.mkdtemp(prefix='hetps-bench-', dir='/tmp')}/s"
    return "tcp://127.0.0.1:0"


def remove_socket_dir(address: str) -> None:
    """The temporary directory of an ipc:// address made by `bind_address` (tcp: nothing)."""
    if address.startswith("ipc://"):
        shutil.rmtree(os.path.dirname(address[len("ipc://") :]), ignore_errors=True)


def raw_echo_server(address_queue: mp.Queue, scheme: str) -> None:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    address = bind_address(scheme)
    sock.bind(address.replace(":0", ":*") if scheme == "tcp" else address)
    address_queue.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2 and len(frames[1]) == 0:
            break
        sock.send_multipart(frames, copy=False)
    sock.close(0)
    remove_socket_dir(address)


def use_curve(keys_dir: str, role: str) -> None:
    """Curve on for this process's later hetps sockets (no-op without `keys_dir`)."""
    if keys_dir:
        from hetps.runconfig.load import load_config
        from hetps.runtime.curve_setup import configure

        cfg = load_config(None, ["security.curve=true", f"security.keys_dir={keys_dir}"])
        configure(cfg, role, client_key=CURVE_CLIENT)


def hetps_shard_server(
    row: str, queue: mp.Queue, stop, profile: str, keys_dir: str, scheme: str, shm_bytes: int = 0
) -> None:
    torch.set_num_threads(1)
    from hetps.proto.transport import TransportOptions, make_server
    from hetps.ps.shard import Shard
    from hetps.runconfig.load import load_config

    use_curve(keys_dir, "ps")

    cfg = load_config(None, ["algorithm.name=async", "optimizer.momentum=0.0"])
    server = make_server(bind_address(scheme), TransportOptions(shm_bytes=shm_bytes))
    shard = Shard(server, 1, one_shard_plan(tensor_set(row), server.address), cfg)
    queue.put(server.address)
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    while not stop.is_set() and os.getppid() != 1:  # the parent may die without setting `stop`
        shard.serve_once(0.05)
    if prof:
        prof.disable()
        prof.dump_stats(os.path.join(profile, f"shard-{row}.prof"))
    queue.put(shard.stats())
    server.close()
    remove_socket_dir(server.address)


def worker_gradients(specs: list, parts: list[list[str]]) -> dict:
    """Gradients (1e-6) held as a worker holds them: each shard's part in one
    buffer in the wire's layout (worker/flat_model.py), as ModelState.outgoing gives them."""
    from torch import nn

    from hetps.training.state import ModelState

    model = nn.Module()
    for s in specs:  # one parameter per spec, registered under its (dotted) name
        module = model
        *path, leaf = s.name.split(".")
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(torch.zeros(s.shape)))
    state = ModelState(model, torch.device("cpu"))
    state.lay_out_flat(parts)
    for p in model.parameters():
        p.grad.fill_(1e-6)
    return state.outgoing()


def time_loop(step, seconds: float) -> tuple[int, float]:
    for _ in range(3):  # warm-up
        step()
    n, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds or n < 5:
        step()
        n += 1
    return n, time.perf_counter() - started


def bench_raw(specs: list, seconds: float, per_tensor: bool, scheme: str = "tcp") -> float:
    """Seconds per raw round trip."""
    q: mp.Queue = mp.Queue()
    proc = mp.Process(target=raw_echo_server, args=(q, scheme), daemon=True)
    proc.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(q.get(timeout=30))
    frames = (
        [torch.ones(s.shape).reshape(-1).numpy() for s in specs]
        if per_tensor
        else [torch.ones(set_nbytes(specs) // 4).numpy()]
    )

    def step():
        sock.send_multipart(frames, copy=False)
        sock.recv_multipart(copy=False)

    n, elapsed = time_loop(step, seconds)
    sock.send(b"")
    sock.close(0)
    proc.join(timeout=10)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=10)
    return elapsed / n


def bench_hetps(
    row: str,
    seconds: float,
    profile: str,
    fuse_pull: bool = True,
    keys_dir: str = "",
    scheme: str = "tcp",
    shm_bytes: int = 0,
) -> tuple[float, float]:
    """(seconds per push+pull round trip, shard update seconds per push)."""
    from hetps.proto.transport import TransportOptions
    from hetps.runconfig.schema import ClusterConfig
    from hetps.worker.client import PSClient

    specs = tensor_set(row)
    q: mp.Queue = mp.Queue()
    stop = mp.Event()
    proc = mp.Process(
        target=hetps_shard_server,
        args=(row, q, stop, profile, keys_dir, scheme, shm_bytes),
        daemon=True,
    )
    proc.start()
    use_curve(keys_dir, "worker")
    client = PSClient(
        one_shard_plan(specs, q.get(timeout=60)),
        2,
        ClusterConfig(),
        fuse_pull=fuse_pull,
        transport=TransportOptions(shm_bytes=shm_bytes),
    )
    try:
        client.init({s.name: torch.zeros(s.shape) for s in specs})
        grads = worker_gradients(specs, client.names)
        clock = [0]

        def step():
            client.push_pull(grads, clock[0], 1)
            clock[0] += 1

        prof = cProfile.Profile() if profile else None
        if prof:
            prof.enable()
        n, elapsed = time_loop(step, seconds)
        if prof:
            prof.disable()
            prof.dump_stats(os.path.join(profile, f"client-{row}.prof"))
    finally:
        client.close()
        stop.set()
        if keys_dir:
            from hetps.proto import security

            security.reset()
    stats = q.get(timeout=60)
    proc.join(timeout=10)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=10)
    return elapsed / n, stats["busy_s"] / max(1, stats["pushes"])


def bench_row(row: str, args) -> dict:
    specs = tensor_set(row)
    raw, ours, update = [], [], []
    for r in range(args.repeats):
        raw.append(
            bench_raw(specs, args.seconds, args.raw_frames == "per-tensor", args.address_scheme)
        )
        rt, upd = bench_hetps(
            row,
            args.seconds,
            args.profile if r == args.repeats - 1 else "",
            args.fuse_pull == "on",
            args.keys_dir,
            args.address_scheme,
            args.shm,
        )
        ours.append(rt)
        update.append(upd)
    raw_s, ours_s, upd_s = (
        statistics.median(raw),
        statistics.median(ours),
        statistics.median(update),
    )
    return {
        "row": row,
        "tensors": len(specs),
        "bytes": set_nbytes(specs),
        "raw_s": raw_s,
        "hetps_s": ours_s,
        "update_s": upd_s,
        "ratio": raw_s / ours_s,
        "ratio_excl_update": raw_s / max(ours_s - upd_s, 1e-9),
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="lenet,4K,64K,1M,16M,64M,256M")
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--raw-frames", choices=["one", "per-tensor"], default="one")
    parser.add_argument("--fuse-pull", choices=["on", "off"], default="on")
    parser.add_argument(
        "--curve", action="store_true", help="hetps over CurveZMQ (raw stays plain)"
    )
    parser.add_argument(
        "--shm",
        type=int,
        default=0,
        metavar="BYTES",
        help="hetps frames of at least BYTES through shared memory (0: off)",
    )
    parser.add_argument("--profile", default="", metavar="DIR")
    parser.add_argument(
        "--address-scheme",
        choices=["tcp", "ipc"],
        default="tcp",
        help="bind tcp loopback or unix sockets (ipc://), raw and hetps alike",
    )
    args = parser.parse_args()
    args.keys_dir = ""
    if args.curve:
        from hetps.proto.security import write_keys

        args.keys_dir = tempfile.mkdtemp(prefix="hetps-bench-keys-")
        write_keys(Path(args.keys_dir) / "keys", [CURVE_CLIENT])
        args.keys_dir = str(Path(args.keys_dir) / "keys")
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    torch.set_num_threads(1)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {cpu_model()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}, pyzmq {zmq.__version__}, "
        f"libzmq {zmq.zmq_version()}; medians of {args.repeats}, raw frames: {args.raw_frames}, "
        f"fused push+pull: {args.fuse_pull}, curve: {'on' if args.curve else 'off'}, "
        f"shared memory: {f'frames >= {args.shm} bytes' if args.shm else 'off'}, "
        f"address scheme: {args.address_scheme}"
    )
    print(
        f"{'row':>6} {'tensors':>7} {'bytes':>10} {'raw us':>9} {'hetps us':>9} {'update us':>9} "
        f"{'raw MB/s':>9} {'hetps MB/s':>10} {'ratio':>6} {'excl. update':>12}"
    )
    try:
        for row in args.sizes.split(","):
            print_row(row, bench_row(row, args))
    finally:
        if args.keys_dir:
            shutil.rmtree(Path(args.keys_dir).parent, ignore_errors=True)


def print_row(row: str, r: dict) -> None:
    mb = 2 * r["bytes"] / 1e6
    print(
        f"{row:>6} {r['tensors']:>7} {r['bytes']:>10} {r['raw_s'] * 1e6:9.0f} {r['hetps_s'] * 1e6:9.0f} "
        f"{r['update_s'] * 1e6:9.0f} {mb / r['raw_s']:9.0f} {mb / r['hetps_s']:10.0f} {r['ratio']:6.2f} "
        f"{r['ratio_excl_update']:12.2f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
