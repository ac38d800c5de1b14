"""Runs of tensors that lie back to back in one buffer, read as one tensor.

A decoded pack frame (layout.py) or a shard's arena holds its tensors at
aligned offsets one after the other; tensors of one dtype that follow each
other there can be checked or updated as one 1-D tensor over that memory
(the padding between them included), one kernel instead of one per tensor.
Read-only: nothing here writes or copies a tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from .layout import aligned

if TYPE_CHECKING:
    import torch


class RunTensors(dict):
    """Tensors by name that may know their flat runs already (`runs`, set by
    whoever laid them out: a round's sum, a worker's merged pull replies; a
    decoded pack frame is a FrameTensors, known_layouts.py). Any change to
    the dict forgets them, so they never describe other tensors."""

    runs: Any = None

    def __setitem__(self, key, value):
        self.runs = None
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self.runs = None
        super().__delitem__(key)

    def __ior__(self, other):
        self.runs = None
        return super().__ior__(other)


def _forgetting(name: str):
    method = getattr(dict, name)

    def changed(self, *args, **kwargs):
        self.runs = None
        return method(self, *args, **kwargs)

    changed.__name__ = name
    return changed


for _name in ("pop", "popitem", "clear", "update", "setdefault"):
    setattr(RunTensors, _name, _forgetting(_name))


def flat_runs(tensors: Mapping[str, torch.Tensor]) -> list[tuple[torch.Tensor, list[str]]]:
    """The non-empty floating-point tensors grouped into runs: consecutive
    (in order) contiguous tensors of one dtype in one storage, each starting
    at the previous one's aligned end (layout.py). Each run as one 1-D tensor
    over that memory (padding included), with its tensors' names."""
    known = getattr(tensors, "runs", None)
    if known is not None:
        return known
    runs: list[tuple[torch.Tensor, list[str]]] = []
    first = last = None
    names: list[str] = []
    for name, t in tensors.items():
        if not (t.is_floating_point() and t.numel()):
            continue
        if (
            last is not None
            and t.dtype == last.dtype
            and t.is_contiguous()
            and last.is_contiguous()
            and t.untyped_storage().data_ptr() == last.untyped_storage().data_ptr()
            and t.data_ptr() == last.data_ptr() + aligned(last.numel() * last.element_size())
        ):
            names.append(name)
        else:
            if first is not None:
                runs.append((_span(first, last), names))
            first, names = t, [name]
        last = t
    if first is not None:
        runs.append((_span(first, last), names))
    return runs


def _span(first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    if first is last:
        return first.reshape(-1)
    count = (last.data_ptr() - first.data_ptr()) // first.element_size() + last.numel()
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (count,), (1,))
