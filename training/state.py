"""Moving a model's tensors to and from the wire: the tensor list in forward
order, gradients and buffers to push, pulled values to load.

Buffer policy (all algorithms): floating-point buffers (BatchNorm running
mean/var) travel with every push as current values and come back averaged by
the shard; integer buffers (num_batches_tracked) take the max.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from hetps.proto.codec import dtype_name
from hetps.proto.plan import TensorSpec

from .flat_model import FlatParams
from .sparse import tables_of


def model_tensors(model: nn.Module) -> dict[str, tuple[torch.Tensor, str]]:
    """name -> (tensor, kind) in forward (module registration) order, each
    module's parameters before its buffers."""
    out: dict[str, tuple[torch.Tensor, str]] = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, p in module.named_parameters(recurse=False):
            out[dot + name] = (p, "param")
        for name, b in module.named_buffers(recurse=False):
            if b is not None:
                out[dot + name] = (b, "buffer")
    return out


def model_specs(model: nn.Module) -> list[TensorSpec]:
    """The model's tensors, then its sparse tables (kind "table", sparse.py)."""
    return [
        TensorSpec(n, dtype_name(t.dtype), tuple(t.shape), kind)
        for n, (t, kind) in model_tensors(model).items()
    ] + list(m.spec for m in tables_of(model).values())


class ModelState:
    """A model's wire view. On CUDA, gradients are staged through pinned
    host buffers with non-blocking copies; a staging buffer is reused only
    after the shard acknowledged the push that carried it (so ZeroMQ is done
    with it)."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model = model
        self.device = device
        self.tensors = model_tensors(model)
        self._pinned: dict[str, torch.Tensor] = {}
        self.flat: FlatParams | None = None
        self._loose = self._params_not_in(())  # parameters whose gradients are set to None per step

    def _params_not_in(self, names) -> list[torch.Tensor]:
        return [
            t for name, (t, kind) in self.tensors.items() if kind == "param" and name not in names
        ]

    def lay_out_flat(self, groups: list[list[str]]) -> None:
        """Keep each group's parameters (a shard's part, in push order) and
        their gradients in one buffer in the wire's pack layout where the
        part qualifies (flat_model.py)."""
        self.flat = FlatParams(self.tensors, groups)
        self._loose = self._params_not_in(self.flat.names)

    def zero_grad(self) -> None:
        """Before a backward: flat gradients zeroed in place, the others set to None."""
        for t in self._loose:
            t.grad = None
        if self.flat is not None:
            self.flat.zero_grad()

    def values(self) -> dict[str, torch.Tensor]:
        """Current values (CPU), for INIT."""
        return {n: t.detach().cpu() for n, (t, _) in self.tensors.items()}

    def load(self, values: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            loaded = self.flat.load(values) if self.flat is not None else ()
            for name, value in values.items():
                if name not in loaded:
                    self.tensors[name][0].copy_(value, non_blocking=True)

    def outgoing(self) -> dict[str, torch.Tensor]:
        """This step's gradients (params) and current values (buffers), on the CPU."""
        out = {}
        for name, (t, kind) in self.tensors.items():
            src = t.grad if kind == "param" else t
            if src is None:
                src = torch.zeros_like(t)
            out[name] = self._to_host(name, src.detach())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return out

    def _to_host(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t
        buf = self._pinned.get(name)
        if buf is None:
            buf = self._pinned[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        return buf
