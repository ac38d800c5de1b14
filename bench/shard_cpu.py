"""A shard's CPU per push, by piece: the flat layout against per-tensor
handling of the same tensors, measured in the same run, in one process.

    .venv/bin/python bench/shard_cpu.py [--sets lenet,1M] [--optimizer sgd|adam] [--momentum 0.9]

Per push a shard decodes the message, checks it for NaN/Inf, steps the
optimizer and (fused pull) encodes the reply. Each row times one piece
(thread CPU µs, best of 3 loops):
- decode: a push of the set, packed as a worker sends it (one frame for a
  small model) / one frame per tensor (`pack_below=0`);
- nonfinite: `nonfinite_names` over the decoded push (one sum per run of
  back-to-back tensors / per tensor);
- step: the shard's Updater, torch.optim over the arena's flat runs / over
  the separate tensors (the gradients as decoded);
- encode: a pull reply's tensors, the arena as one frame / one frame per
  tensor (no copy either way).
`ratio` is flat / per-tensor (below 1: the flat layout is cheaper).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch


def specs_of(name: str) -> list:
    from hetps.proto.plan import TensorSpec

    if name == "lenet":
        from hetps.training.models import LeNet5
        from hetps.training.state import model_specs

        return model_specs(LeNet5((1, 28, 28), 10))
    return [TensorSpec("w", "float32", (int(name.rstrip("M")) << 18,))]


def cpu_us(fn, loops: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        started = time.thread_time()
        for _ in range(loops):
            fn()
        best = min(best, (time.thread_time() - started) / loops * 1e6)
    return best


def pieces(specs: list, overrides: list[str], flat: bool, loops: int) -> dict[str, float]:
    from hetps.proto.codec import decode, encode, encode_tensors, nonfinite_names
    from hetps.proto.layout import PACK_BELOW
    from hetps.proto.messages import Push
    from hetps.ps.store import TensorStore
    from hetps.ps.updater import Updater
    from hetps.runconfig.load import load_config

    cfg = load_config(None, overrides)
    store = TensorStore(specs)
    store.initialize({s.name: torch.randn(s.shape) for s in specs})
    updater = Updater(
        store.tensors, store.param_names(), cfg.optimizer, store.arena if flat else None
    )
    grads = {s.name: torch.randn(s.shape) * 1e-3 for s in specs}
    pack_below = PACK_BELOW if flat else 0  # the baseline: one frame per tensor
    frames = [
        bytes(f)
        for f in encode(
            Push(plan_id=1, clock=0, base_version=0, tensors=grads), pack_below=pack_below
        )
    ]
    pushed = decode(frames, store.catalog).msg.tensors
    memory = store.arena.memory if flat else None
    tensors = store.tensors
    return {
        "decode": cpu_us(lambda: decode(frames, store.catalog), loops),
        "nonfinite": cpu_us(lambda: nonfinite_names(pushed), loops),
        "step": cpu_us(lambda: updater.apply(pushed), loops),
        "encode": cpu_us(lambda: encode_tensors(tensors, pack_below, memory), loops),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sets", default="lenet,1M")
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--loops", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(1)
    overrides = [f"optimizer.name={args.optimizer}", f"optimizer.momentum={args.momentum}"]
    print(
        f"machine: {platform.machine()}, torch {torch.__version__}; {args.optimizer}"
        f"{f' momentum {args.momentum}' if args.optimizer == 'sgd' else ''}; thread CPU µs per push, best of 3"
    )
    print(f"{'set':>6} {'piece':>10} {'per-tensor':>11} {'flat':>8} {'ratio':>6}")
    for name in args.sets.split(","):
        specs = specs_of(name)
        base = pieces(specs, overrides, flat=False, loops=args.loops)
        flat = pieces(specs, overrides, flat=True, loops=args.loops)
        for piece in (*base, "total"):
            b = sum(base.values()) if piece == "total" else base[piece]
            f = sum(flat.values()) if piece == "total" else flat[piece]
            print(f"{name:>6} {piece:>10} {b:11.1f} {f:8.1f} {f / b:6.2f}")


if __name__ == "__main__":
    main()
