"""The sender's side of a repeated layout: a pack frame made in one copy.

A worker pushes the same tensor list (names, dtypes, shapes) to a shard in
every step. When all of it travels in one pack frame (layout.py) and the
tensors share one dtype, the header's tensor fields are the same every
time and the frame is the tensors back to back with zero padding: one
`torch.cat`, instead of a byte view per tensor and a join. The fields are
worked out once per tensor list (`PackTemplate`) and kept; the frame's
bytes are exactly what `layout.build_pack` would make.

Thread-safe for reading and adding; at most MAX_TEMPLATES are kept, then
all are dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from . import dtypes as _dt
from .layout import aligned, choose_packed
from .lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

MAX_TEMPLATES = 64  # one per shard a worker pushes to, and per message kind


class PackTemplate:
    """The header fields and padding of one tensor list sent as one pack frame."""

    def __init__(self, names: list[str], dtype: torch.dtype, shapes: list[tuple[int, ...]]):
        dtype_name = _dt.DTYPE_NAMES[dtype]
        self.fields = {
            "tensors": [[n, dtype_name, list(s)] for n, s in zip(names, shapes)],
            "packed": list(range(len(names))),
        }  # sent as is: never changed
        # a zero tensor after each payload that does not end on ALIGN, else None
        self.pads: list = []
        self.offsets: list[int] = []  # bytes from the frame's start
        self.nbytes = 0
        for shape in shapes:
            nbytes = dtype.itemsize * _numel(shape)
            # ALIGN is a multiple of every itemsize
            pad = (aligned(nbytes) - nbytes) // dtype.itemsize
            self.pads.append(torch.zeros(pad, dtype=dtype) if pad else None)
            self.offsets.append(self.nbytes)
            self.nbytes += aligned(nbytes)

    def frame(self, tensors: list[torch.Tensor]) -> memoryview:
        """The pack frame of `tensors` (CPU, in template order): the memory they
        lie in when they lie in this layout already (a worker's flat gradients,
        worker/flat_model.py: its padding is zero), else a new buffer."""
        laid_out = self.laid_out(tensors)
        if laid_out is not None:
            return laid_out
        parts = []
        for t, pad in zip(tensors, self.pads):
            parts.append(t.reshape(-1))
            if pad is not None:
                parts.append(pad)
        return torch.cat(parts).detach().view(torch.uint8).numpy().data

    def laid_out(self, tensors: list[torch.Tensor]) -> memoryview | None:
        """The bytes of the one CPU buffer `tensors` lie in, at this layout's
        offsets (`nbytes` of them, trailing padding included), or None."""
        first = tensors[0]
        if first.device.type != "cpu":
            return None
        storage = first.untyped_storage()
        start = first.data_ptr()
        # at their addresses, inside the first one's storage
        for t, offset in zip(tensors, self.offsets):
            # (checked below): its memory
            if t.data_ptr() != start + offset or not t.is_contiguous():
                return None
        at = start - storage.data_ptr()
        if at + self.nbytes > storage.nbytes():
            return None
        span = torch.empty(0, dtype=torch.uint8).set_(storage, at, (self.nbytes,), (1,))
        return span.numpy().data


_templates: dict[tuple, PackTemplate | None] = {}  # None: a tensor list no template fits
_UNSEEN = object()


def packed_fields_and_frame(tensors: Mapping, pack_below: int) -> tuple[dict, memoryview] | None:
    """Header fields and the one pack frame for `tensors`, when they are at
    least two plain CPU tensors of one allowed dtype that `choose_packed`
    packs all together; else None (the caller encodes them the general way)."""
    if pack_below <= 0 or len(tensors) < 2:
        return None
    values = list(tensors.values())
    specs = []
    for name, t in zip(tensors, values):
        if type(t) is not torch.Tensor:  # Compressed payloads, subclasses: the general way
            return None
        specs.append((name, t.dtype, t.shape))
    key = tuple(specs)
    found = _templates.get(key, _UNSEEN)  # one read: another thread may clear the dict meanwhile
    if found is _UNSEEN:
        template = _template(key, pack_below)
        if len(_templates) >= MAX_TEMPLATES:
            _templates.clear()
        _templates[key] = template
    else:
        template = found if isinstance(found, PackTemplate) else None
    if template is None:
        return None
    try:
        return template.fields, template.frame(values)
    # not CPU memory, or not all on one device: the general way says so
    except (RuntimeError, TypeError):
        return None


def _template(key: tuple, pack_below: int) -> PackTemplate | None:
    names, dtypes, shapes = zip(*key)
    dtype = dtypes[0]
    if any(d != dtype for d in dtypes) or dtype not in _dt.DTYPE_NAMES:
        return None
    sizes = [dtype.itemsize * _numel(s) for s in shapes]
    if not sum(sizes) or len(choose_packed(sizes, pack_below)) != len(sizes):
        return None
    return PackTemplate(list(names), dtype, [tuple(s) for s in shapes])


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
