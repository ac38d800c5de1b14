"""Runs of tensors that lie back to back in one buffer, read as one tensor.

A decoded pack frame (layout.py) or a shard's arena holds its tensors at
aligned offsets one after the other; tensors of one dtype that follow each
other there can be checked or updated as one 1-D tensor over that memory
(the padding between them included), one kernel instead of one per tensor.
Whoever lays tensors out says so with a Tensors value (tensors.py) that
carries its runs; `flat_runs` finds them in any other mapping's memory.
Read-only: nothing here writes or copies a tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from .layout import aligned
from .tensors import Run, Tensors

if TYPE_CHECKING:
    import torch


def flat_runs(tensors: Mapping[str, torch.Tensor]) -> tuple[Run, ...]:
    """The runs of `tensors`: those a Tensors value knows (tensors.py), else
    its non-empty floating-point tensors grouped into runs as they lie in
    memory: consecutive (in order) contiguous tensors of one dtype in one
    storage, each starting at the previous one's aligned end (layout.py)."""
    if isinstance(tensors, Tensors) and tensors.runs:
        return tensors.runs
    runs: list[Run] = []
    first: torch.Tensor | None = None
    last: torch.Tensor | None = None
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
            if first is not None and last is not None:
                runs.append(Run(_span(first, last), tuple(names)))
            first, names = t, [name]
        last = t
    if first is not None and last is not None:
        runs.append(Run(_span(first, last), tuple(names)))
    return tuple(runs)


def _span(first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    if first is last:
        return first.reshape(-1)
    count = (last.data_ptr() - first.data_ptr()) // first.element_size() + last.numel()
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (count,), (1,))
