"""Tensor layouts the decoder has checked already, remembered by their header text.

A peer sends the same tensor list in every message of a kind (a worker's
push to one shard, a shard's pull reply): the same specs, the same `packed`
indices. Checking them (allow-listed dtypes, size bounds, duplicate names,
packed indices, the receiving shard's catalogue) and working out where each
tensor lies in the pack frame is the same work every time, so it is done
once per layout and kept here. What differs per message is still checked
per message: the frame count and every frame's length.

A layout is found by the exact bytes of its header fields (`key_of`), so a
message whose specs differ in any way, even `True` for `1`, is checked in
full. Thread-safe for reading and adding (a worker's shard
threads decode at once); at most MAX_LAYOUTS are kept, then all are dropped.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import msgpack

from .layout import aligned, byte_view
from .lazy import lazy_module
from .tensors import Run, RunSpec, Tensors

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

# a process sees one layout per peer and message kind; a flood of others just re-checks
MAX_LAYOUTS = 256


class Spec(NamedTuple):
    """A checked tensor spec: name, dtype, shape, element count."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    numel: int


class PackedView(NamedTuple):
    """Where one packed tensor lies: its dtype's view of the frame, from `offset` entries on."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    numel: int


class CheckedLayout:
    """The specs, payload sizes and packed indices of one tensor layout that
    passed every check that does not depend on the frames. When every
    tensor is packed (one pack frame: a small model's message), or the one
    tensor travels in a frame of its own (a shard's chunk of a large one), it also
    knows each tensor's place in the frame and the flat runs (runs.py) of
    the floating-point tensors, so a message is turned into views with no
    per-spec work. Not to be changed once made: every message of the layout
    shares its runs' specs (`run_layout`: a round's sum compares them with
    its own, ps/round_sums.py)."""

    def __init__(self, specs: list[Spec], sizes: list[int], packed: list[int]):
        self.specs, self.sizes, self.packed = specs, sizes, packed
        # the last catalogue every spec was found in (compared by identity)
        self.catalog: Any = None
        self.pack_nbytes = sum(aligned(sizes[i]) for i in packed)
        self.views: list[PackedView] | None = None
        self.named: dict[str, PackedView] | None = None  # the views by name
        # each run as (dtype, start and length in entries of that dtype, names)
        self.runs: tuple[tuple[torch.dtype, int, int, tuple[str, ...]], ...] = ()
        self.run_layout: tuple[RunSpec, ...] = ()
        if packed and len(packed) == len(specs) and self.pack_nbytes:
            self._place()
        elif len(specs) == 1 and not packed and specs[0].numel:
            # one tensor in a frame of its own, exactly its bytes: read like a pack of one
            self.pack_nbytes = sizes[0]
            self._place()

    def _place(self) -> None:
        """Each tensor's view of the pack frame, and the runs flat_runs would find in them."""
        views, offset = [], 0
        runs: list[tuple[torch.dtype, int, int, list[str]]] = []
        last = None  # (dtype, end in bytes) of the last non-empty floating tensor
        for s, nbytes in zip(self.specs, self.sizes):
            views.append(
                PackedView(
                    s.name,
                    s.dtype,
                    s.shape,
                    contiguous_strides(s.shape),
                    offset // s.dtype.itemsize,
                    s.numel,
                )
            )
            if s.numel and s.dtype.is_floating_point:
                if last is not None and last == (s.dtype, offset):
                    dtype, start, _, names = runs[-1]
                    names.append(s.name)
                    runs[-1] = (
                        dtype,
                        start,
                        (offset + nbytes - start * dtype.itemsize) // dtype.itemsize,
                        names,
                    )
                else:
                    runs.append((s.dtype, offset // s.dtype.itemsize, s.numel, [s.name]))
                last = (s.dtype, offset + aligned(nbytes))
            offset += aligned(nbytes)
        self.views = views
        self.named = {v.name: v for v in views}
        self.runs = tuple(
            (dtype, start, count, tuple(names)) for dtype, start, count, names in runs
        )
        self.run_layout = tuple(
            RunSpec(dtype, count, names) for dtype, _, count, names in self.runs
        )

    def fits(self, frames: Sequence) -> bool:
        """Whether `frames` (after the header) are the one frame of the right length (the pack
        frame, or the one tensor's own)."""
        return (
            self.views is not None
            and len(frames) == 1
            and byte_view(frames[0]).nbytes == self.pack_nbytes
        )

    def tensors(self, frame: Any) -> FrameTensors:
        """Read-only views of a pack frame that `fits`, with their flat runs
        (each run one 1-D tensor over the frame; the tensors' views are made
        when first read)."""
        return FrameTensors(self, byte_view(frame))


class FrameTensors(Tensors):
    """The tensors of one pack frame by name, in the layout's order, each a
    view of the frame made when it is first read: a shard that checks and
    sums a push run by run (its `runs`) never makes them."""

    __slots__ = ("_views", "_buf", "_typed", "_whole")

    def __init__(self, layout: CheckedLayout, buf: memoryview):
        assert layout.named is not None  # a layout that `fits`
        self._views: dict[str, PackedView] = layout.named
        self._buf = buf
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # the whole frame as each dtype
        # every view, in order, once all were asked for
        self._whole: dict[str, torch.Tensor] | None = None
        self._tensors = {}  # the views made so far
        # over the whole frame: the optimizer may read a run on into its padding (ps/updater.py)
        as_dtype = self.as_dtype
        self._runs = tuple(
            [
                Run(as_dtype(dtype).as_strided((count,), (1,), start), names)
                for dtype, start, count, names in layout.runs
            ]
        )
        self._layout = layout.run_layout
        self._encoded = None

    def as_dtype(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole frame as a 1-D tensor of `dtype` (its length is a multiple of ALIGN)."""
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = torch.frombuffer(self._buf, dtype=dtype)
        return typed

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._tensors.get(name)
        if t is None:
            v = self._views[name]
            t = self._tensors[name] = (
                self.as_dtype(v.dtype).as_strided(v.shape, v.strides, v.offset)
                if v.numel
                else torch.empty(v.shape, dtype=v.dtype)
            )
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    def __contains__(self, name: object) -> bool:
        return name in self._views

    def _all(self) -> dict[str, torch.Tensor]:
        whole = self._whole
        if whole is None:
            whole = {
                n: self[n] for n in self._views
            }  # in the layout's order, whatever was read first
            object.__setattr__(self, "_whole", whole)
        return whole


_known: dict[tuple, CheckedLayout] = {}


def key_of(header: dict, max_bytes: int) -> tuple | None:
    """What tells a header's dense layout from every other: its `tensors` and
    `packed` fields, packed again as msgpack (which, unlike `==` or a cheap
    text, keeps `True` from `1` and `1.0`), and the size limit they were
    checked under. None for compressed tensors (`enc`: checked every time)
    or fields msgpack cannot pack again (the full check then refuses them)."""
    if "enc" in header:
        return None
    try:
        return msgpack.packb(
            (header.get("tensors", []), header.get("packed")), use_bin_type=True
        ), max_bytes
    except Exception:  # e.g. nested deeper than msgpack packs: not a layout anyone sends
        return None


def known(key: tuple | None) -> CheckedLayout | None:
    return _known.get(key) if key is not None else None


def remember(key: tuple, layout: CheckedLayout) -> None:
    if len(_known) >= MAX_LAYOUTS:
        _known.clear()
    _known[key] = layout


@functools.lru_cache(maxsize=1024)  # a model has a few dozen shapes
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))
