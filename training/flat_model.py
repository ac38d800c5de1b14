"""A worker's parameters and gradients in one buffer per shard, in the wire's pack layout.

A shard's part of a small model travels as one pack frame (proto/layout.py):
its tensors back to back at ALIGN-byte offsets, zero padding between them.
When a shard's part is parameters of one floating dtype on the CPU, the
worker keeps them that way itself, as DDP keeps gradients in its buckets:
the parameters are views of one value buffer and their gradients views of
one gradient buffer, both in the frame's layout. Then

- a push's frame is the gradient buffer as it is (pack_templates.py sends
  tensors that already lie in their pack layout without joining them), and
- a pull reply's frame, whose tensors the decoder reads as one run
  (runs.py), is loaded with one copy instead of one per tensor;

the bytes on the wire are the same either way (but for the sign of a zero
gradient: backward adds into the zeroed buffer, and -0.0 + 0 is +0.0).
Gradients are zeroed in place (one kernel per buffer), never set to None, so
backward accumulates into the views. A shard's part that does not qualify (buffers, mixed
dtypes, chunked tensors, a parameter shared under two names) keeps the
per-tensor path.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from hetps.proto.layout import aligned
from hetps.proto.tensors import Tensors


class FlatPart:
    """One shard's parameters (`names`, in the order pushes list them) as views of
    `values`, their gradients as views of `grads`. `span`: the values from the first
    tensor's start to the last one's end, the extent of a decoded reply's run."""

    def __init__(self, names: list[str], params: list[torch.nn.Parameter]):
        dtype = params[0].dtype
        offsets, end = [], 0
        for p in params:
            offsets.append(end // dtype.itemsize)
            end += aligned(p.numel() * dtype.itemsize)
        self.names = tuple(names)
        self.values = torch.zeros(end // dtype.itemsize, dtype=dtype)
        self.grads = torch.zeros_like(self.values)
        for p, at in zip(params, offsets):
            value = self.values[at : at + p.numel()].view(p.shape)
            with torch.no_grad():
                value.copy_(p)
            p.data = value
            p.grad = self.grads[at : at + p.numel()].view(p.shape)
        self.span = self.values[: offsets[-1] + params[-1].numel()]


class FlatParams:
    """The shards' parts that qualify (see the module docstring), laid out flat."""

    def __init__(self, tensors: Mapping[str, tuple[torch.Tensor, str]], groups: list[list[str]]):
        self.parts: list[FlatPart] = []
        seen: dict[int, int] = {}
        for t, _ in tensors.values():
            seen[id(t)] = seen.get(id(t), 0) + 1
        for names in groups:
            entries = [tensors.get(n) for n in names]
            if not names or any(e is None or e[1] != "param" for e in entries):
                continue
            params = [e[0] for e in entries]
            dtype = params[0].dtype
            if not dtype.is_floating_point or any(
                p.dtype != dtype
                or p.device.type != "cpu"
                or seen[id(p)] > 1
                or not math.prod(p.shape)
                for p in params
            ):
                continue
            self.parts.append(FlatPart(names, params))
        self.by_names = {part.names: part for part in self.parts}
        self.names = {n for part in self.parts for n in part.names}

    def zero_grad(self) -> None:
        for part in self.parts:
            part.grads.zero_()

    def load(self, values: Mapping[str, torch.Tensor]) -> set[str]:
        """Copy the runs `values` knows (a Tensors: its decoders' runs, proto/tensors.py)
        that are exactly one part's tensors into that part, one copy each; the names loaded."""
        loaded: set[str] = set()
        for run, names in values.runs if isinstance(values, Tensors) else ():
            part = self.by_names.get(names)
            if (
                part is not None
                and run.dtype == part.span.dtype
                and run.numel() == part.span.numel()
            ):
                part.span.copy_(run)
                loaded.update(names)
        return loaded
