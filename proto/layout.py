"""Where each tensor's bytes sit in a message: in a frame of its own, or in
the one pack frame that carries all the small ones.

A frame costs a send call, a receive call and a Frame object in Python and
ZeroMQ, whatever its size; a small model's push of ten tensors would pay that
ten times. So payloads smaller than PACK_BELOW bytes (which ZeroMQ would copy
anyway) travel back to back in one frame, the last of the message, each at an
8-byte aligned offset so that a view of any dtype is aligned. When all the
payloads together are at most PACK_ALL_BELOW bytes, all of them are packed,
so a small model's message has one tensor frame. Otherwise larger payloads
keep a frame of their own (zero-copy from ZERO_COPY_BYTES on); received ones
are views of the frames either way. The header's optional
`packed` field lists the indices (into `tensors`) of the packed payloads in
increasing order; without it every tensor has its own frame.

TRUST BOUNDARY: `split_frames` checks `packed`, the frame count and every
length against the sizes the already validated specs imply, and returns
views; it allocates nothing sized by the header.
"""

from __future__ import annotations

from typing import Any, Sequence

from .errors import ProtocolError
from .ops import Status

ALIGN = 8
# Packing copies a payload once more (into the pack, which ZeroMQ then copies
# too, being smaller than ZERO_COPY_BYTES): worth it for small payloads, where
# a frame's fixed cost dominates, not for those of tens of kilobytes and more.
PACK_BELOW = 64 * 1024
# A message whose payloads total at most this many bytes (a small model's
# push) packs them all, large ones too: one frame, one length check, and on
# the shard one contiguous run per dtype (one finiteness check, no gather).
PACK_ALL_BELOW = 512 * 1024
_PAD = bytes(ALIGN)


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to the next multiple of ALIGN."""
    return (nbytes + ALIGN - 1) & -ALIGN


def choose_packed(sizes: Sequence[int], pack_below: int) -> list[int]:
    """Indices of the payloads to pack: all of them when they total at most
    PACK_ALL_BELOW bytes, else those under `pack_below` bytes; either only
    when there are at least two (one small frame gains nothing). `pack_below`
    0: none."""
    if pack_below > 0 and len(sizes) >= 2 and sum(aligned(n) for n in sizes) <= PACK_ALL_BELOW:
        return list(range(len(sizes)))
    small = [i for i, n in enumerate(sizes) if n < pack_below]
    return small if len(small) >= 2 else []


def build_pack(payloads: Sequence[memoryview]) -> bytes:
    """One frame holding `payloads` back to back, each padded to ALIGN bytes."""
    parts: list = []
    for p in payloads:
        parts.append(p)
        pad = -p.nbytes % ALIGN
        if pad:
            parts.append(_PAD[:pad])
    return b"".join(parts)


def byte_view(frame: Any) -> memoryview:
    """A flat unsigned-byte view of a frame (bytes, bytearray, memoryview, zmq buffer)."""
    view = memoryview(frame)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def check_packed(packed: Any, n: int, req_id: int) -> list[int]:
    """`packed` (a header field) if it is increasing indices below `n`; raises ProtocolError (MALFORMED)."""
    if not isinstance(packed, list) or not all(type(i) is int for i in packed):
        raise ProtocolError(
            Status.MALFORMED, "field 'packed' must be a list of tensor indices", req_id
        )
    if packed and not (
        0 <= packed[0] and packed[-1] < n and all(a < b for a, b in zip(packed, packed[1:]))
    ):
        raise ProtocolError(
            Status.MALFORMED, f"field 'packed' must be increasing indices below {n}", req_id
        )
    return packed


def split_frames(
    frames: Sequence, sizes: Sequence[int], packed: Any, req_id: int
) -> list[memoryview]:
    """One byte view per tensor payload (in spec order), each exactly `sizes[i]`
    long. `frames` are the message's frames after the header. Raises
    ProtocolError (MALFORMED) on a wrong frame count or length."""
    n = len(sizes)
    packed = check_packed(packed, n, req_id)
    expected = n - len(packed) + (1 if packed else 0)
    if len(frames) != expected:
        raise ProtocolError(
            Status.MALFORMED,
            f"{len(frames)} tensor frames for {n} tensor specs"
            f"{f' ({len(packed)} packed)' if packed else ''}",
            req_id,
        )
    views: list = [None] * n
    if packed:
        pack = byte_view(frames[-1])
        need = sum(aligned(sizes[i]) for i in packed)
        if pack.nbytes != need:
            raise ProtocolError(
                Status.MALFORMED,
                f"pack frame has {pack.nbytes} bytes, its {len(packed)} tensors need {need}",
                req_id,
            )
        offset = 0
        for i in packed:
            views[i] = pack[offset : offset + sizes[i]]
            offset += aligned(sizes[i])
    own = iter(frames)
    for i in range(n):
        if views[i] is None:
            views[i] = byte_view(next(own))
            if views[i].nbytes != sizes[i]:
                raise ProtocolError(
                    Status.MALFORMED,
                    f"tensor #{i}: frame has {views[i].nbytes} bytes, needs {sizes[i]}",
                    req_id,
                )
    return views
