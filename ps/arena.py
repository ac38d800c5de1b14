"""One byte buffer for all of a shard's tensors: the arena.

The parameters come first, grouped by dtype (in spec order within a dtype),
then the buffers, each at an ALIGN-byte aligned offset (the pack layout of
proto/layout.py). So:

- the parameters of one dtype are one contiguous run, `flat[dtype]`: the
  optimizer updates that one tensor (a few kernels per step, whatever the
  number of tensors; SGD and Adam act entry-wise, so the values are those of
  an optimizer over the separate tensors), and its state is flat too;
- the whole arena, as it is, is the pack frame of a pull reply that lists
  the tensors in `order`: one frame, no copy (codec.encode_tensors `arena`).

`views` are the per-tensor views the rest of the shard reads and writes in
place. `move_to` puts the arena in other memory and re-seats every view and
flat run on it (the same tensor objects: the optimizer and the store keep
theirs). Padding entries of a flat run stay zero under SGD/Adam/AdamW (zero
value, zero gradient) unless a peer's push carried other bytes in its pack
padding (the optimizer may read a packed push in place): either way they are
read by nobody, a receiver skips padding. Not thread-safe.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from hetps.proto.layout import aligned


class Arena:
    def __init__(self, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...], bool]]):
        """`entries`: (name, dtype, shape, is_param) in spec order."""
        entries = list(entries)
        params = [e for e in entries if e[3]]
        dtypes = list(dict.fromkeys(e[1] for e in params))
        ordered = [e for d in dtypes for e in params if e[1] == d] + [
            e for e in entries if not e[3]
        ]
        self.order: list[str] = [e[0] for e in ordered]
        self.offsets: dict[str, int] = {}  # bytes from the arena's start
        runs: dict[torch.dtype, list[int]] = {}
        offset = 0
        for name, dtype, shape, is_param in ordered:
            self.offsets[name] = offset
            nbytes = aligned(dtype.itemsize * math.prod(shape))
            if is_param:
                run = runs.setdefault(dtype, [offset, offset])
                run[1] = offset + nbytes
            offset += nbytes
        self._specs = {e[0]: (e[1], tuple(e[2])) for e in ordered}
        self._runs = {d: (start, end) for d, (start, end) in runs.items()}
        self.memory = torch.zeros(offset, dtype=torch.uint8)
        self.views: dict[str, torch.Tensor] = {
            n: torch.empty(0, dtype=self._specs[n][0]) for n in self.order
        }
        self.flat: dict[torch.dtype, torch.Tensor] = {
            d: torch.empty(0, dtype=d) for d in self._runs
        }
        self._seat()

    @property
    def nbytes(self) -> int:
        return self.memory.numel()

    def run_names(self, dtype: torch.dtype) -> list[str]:
        """The parameters in `dtype`'s flat run, in its order."""
        start, end = self._runs[dtype]
        return [
            n for n in self.order if self._specs[n][0] == dtype and start <= self.offsets[n] < end
        ]

    def offset_in_run(self, name: str) -> int:
        """Entries from the start of the tensor's flat run to the tensor."""
        dtype = self._specs[name][0]
        return (self.offsets[name] - self._runs[dtype][0]) // dtype.itemsize

    def move_to(self, memory: torch.Tensor) -> None:
        """Copy the arena into `memory` (uint8, same size) and re-seat every view on it."""
        memory.copy_(self.memory)
        self.memory.set_(memory)
        self._seat()

    def _seat(self) -> None:
        storage = self.memory.untyped_storage()
        base = self.memory.storage_offset()  # bytes (uint8)
        for name, view in self.views.items():
            dtype, shape = self._specs[name]
            view.set_(
                storage,
                (base + self.offsets[name]) // dtype.itemsize,
                shape,
                _contiguous_strides(shape),
            )
        for dtype, flat in self.flat.items():
            start, end = self._runs[dtype]
            flat.set_(
                storage, (base + start) // dtype.itemsize, ((end - start) // dtype.itemsize,), (1,)
            )


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))
