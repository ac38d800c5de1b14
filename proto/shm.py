"""Shared-memory frames between processes on one host (opt-in: `comm.shm_bytes`).

A large frame crossing loopback TCP is copied twice by the kernel (into the
socket, out of it) and freshly allocated on the receiving side. With shared
memory on, a client writes each frame of at least `shm_bytes` into a segment
of its own (a sealed memfd) and sends, ahead of the usual frames, a small
descriptor frame that names the segment and where each frame lies; those
frames travel empty. The server maps the segment once and hands the codec
read-only views of it in their place, so a shard's optimizer reads the
gradient where the worker wrote it.

Buffer lifetime: a segment carries one message at a time. Its first byte is
set busy by the client before it writes, and cleared by the server only when
the last view of that message is gone (a finalizer on one object per message
that every view keeps alive): a client never overwrites a frame the
server still reads. A client with no free segment (at most MAX_SEGMENTS)
sends through the socket as usual; nothing ever blocks on a segment. A server
that dies holding a message never clears its flag: when the client connects
again it sets its busy segments aside (`SegmentPool.set_aside`), so they stop
counting against MAX_SEGMENTS, and closes them once free (a copy queued in the
socket was read after all), or once more than MAX_SEGMENTS are aside and they
were set aside before the last two reconnects.

TRUST BOUNDARY, with a narrower trust than the socket: the server opens
`/proc/PID/fd/FD` of the descriptor, so only peers running as the same user
on this host can use it (the descriptor names the host's boot id and the
segment's inode: a sender on another host or in another pid namespace is
refused, not misread), and it checks that the file is a hetps memfd sealed
against shrinking (no SIGBUS from a truncated file) and that every frame lies
inside it. A descriptor that fails a check is dropped with a log line; the
message then reaches the codec with empty frames and is refused MALFORMED.
Linux only.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import weakref
from collections import OrderedDict
from typing import Sequence

import msgpack

log = logging.getLogger(__name__)

MARK = b"\xc1hetps-shm"  # 0xc1 never starts a msgpack value, so never a message header
MEMFD_NAME = "hetps-shm"
PAGE = mmap.PAGESIZE  # the first page holds the busy flag; frames start at the second
ALIGN = 64
MAX_SEGMENTS = 4  # per client: messages in flight through shared memory at once
OPEN_SEGMENTS = 64  # per server: segments kept open (least recently used closed first)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


BOOT_ID = _boot_id()  # this host's kernel: a descriptor from another host is refused
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class ShmRefused(ValueError):
    """A descriptor frame that names no usable segment or frames outside it."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Segment:
    """One sealed memfd of PAGE + `capacity` bytes, mapped by its client."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, PAGE + capacity)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
        self.map = mmap.mmap(self.fd, PAGE + capacity)
        self.view = memoryview(self.map)
        self.ino = os.fstat(self.fd).st_ino

    def free(self) -> bool:
        return self.view[0] == 0

    def close(self) -> None:
        """Unmap and close; a server's mapping of it stays valid."""
        self.view.release()
        self.map.close()
        os.close(self.fd)


class SegmentPool:
    """The client side: writes large frames into free segments. Not thread-safe
    (one per socket, like the socket)."""

    def __init__(self, min_bytes: int, max_segments: int = MAX_SEGMENTS):
        self.min_bytes = min_bytes
        self.max_segments = max_segments
        self.segments: list[Segment] = []
        # (reconnect, segment): busy when the server went away
        self.aside: list[tuple[int, Segment]] = []
        self.reconnects = 0
        self.staged = 0  # messages sent through shared memory
        self.fallbacks = 0  # messages with large frames sent through the socket: no free segment

    def stage(self, frames: Sequence) -> list | None:
        """The parts to send for `frames`: [descriptor, *frames with each frame of
        at least `min_bytes` emptied], its bytes written into a free segment; or
        None when no frame is that large or no segment is free (send `frames`)."""
        views = [
            memoryview(f).cast("B")
            if not isinstance(f, memoryview) or f.format != "B" or f.ndim != 1
            else f
            for f in frames
        ]
        large = [i for i, v in enumerate(views) if v.nbytes >= self.min_bytes]
        if not large:
            return None
        need = sum(_aligned(views[i].nbytes) for i in large)
        segment = self._take(need)
        if segment is None:
            self.fallbacks += 1
            return None
        segment.view[0] = 1  # busy until the server lets go of every view of this message
        places, offset = [], 0
        for i in large:
            n = views[i].nbytes
            segment.view[PAGE + offset : PAGE + offset + n] = views[i]
            places.append([i, offset, n])
            offset += _aligned(n)
        self.staged += 1
        desc = msgpack.packb([BOOT_ID, os.getpid(), segment.fd, segment.ino, places])
        moved = set(large)
        return [MARK + desc, *(b"" if i in moved else f for i, f in enumerate(frames))]

    def set_aside(self) -> int:
        """The server went away and came back (a restart): the messages it held may
        never be let go. Its busy segments leave the pool, so that new messages
        take fresh ones; each is closed once free, or once more than
        `max_segments` are aside and it was set aside before the last two
        reconnects (see `_tidy_aside`). Returns how many were set aside."""
        self.reconnects += 1
        busy = [s for s in self.segments if not s.free()]
        self.segments = [s for s in self.segments if s.free()]
        self.aside += [(self.reconnects, s) for s in busy]
        self._tidy_aside()
        return len(busy)

    def _tidy_aside(self) -> None:
        """Close the set-aside segments that were let go after all, then the oldest
        beyond `max_segments`, but only those set aside before the last two
        reconnects: a message re-sent into a segment just before a reconnect may
        still wait in the socket's queue for the new server (a connection that
        flaps reconnects twice before it is read). The others went to a server that
        is gone: closing the client's side frees the memory, and a live reader's
        mapping stays valid."""
        for entry in [e for e in self.aside if e[1].free()]:
            self.aside.remove(entry)
            entry[1].close()
        while len(self.aside) > self.max_segments and self.aside[0][0] < self.reconnects - 1:
            self.aside.pop(0)[1].close()

    def _take(self, need: int) -> Segment | None:
        if self.aside:
            self._tidy_aside()
        free = [s for s in self.segments if s.free()]
        fits = [s for s in free if s.capacity >= need]
        if fits:
            return min(fits, key=lambda s: s.capacity)
        # make room: replace a free one too small
        if free and len(self.segments) >= self.max_segments:
            self.segments.remove(free[0])
            free[0].close()
        if len(self.segments) >= self.max_segments:
            return None
        segment = Segment((need + PAGE - 1) // PAGE * PAGE)
        self.segments.append(segment)
        return segment

    def close(self) -> None:
        for s in self.segments + [s for _, s in self.aside]:
            s.close()
        self.segments.clear()
        self.aside.clear()


class _Opened:
    """A client's segment as the server holds it: the fd, its size, and one
    mapping of the whole (the busy flag and every message's frames)."""

    def __init__(self, fd: int, size: int, ino: int):
        self.fd, self.size, self.ino = fd, size, ino
        self.map = mmap.mmap(fd, size)

    def close(self) -> None:
        # the mapping goes with its last reference: views and finalizers may hold it
        os.close(self.fd)


def _release(segment_map: mmap.mmap) -> None:
    segment_map[0] = 0


class SegmentReader:
    """The server side: turns a descriptor frame and the frames behind it into
    the frames the client meant, views of its segment. Not thread-safe."""

    def __init__(self, open_segments: int = OPEN_SEGMENTS):
        self.open_segments = open_segments
        self.opened: OrderedDict[tuple[int, int], _Opened] = OrderedDict()

    def restore(self, frames: Sequence) -> list:
        """`frames` (descriptor first) as the client meant them. Raises ShmRefused."""
        try:
            boot, pid, fd, ino, places = msgpack.unpackb(bytes(frames[0][len(MARK) :]), raw=False)
        # msgpack raises several unrelated types; a bad shape fails to unpack
        except Exception as exc:
            raise ShmRefused(f"undecodable descriptor: {exc}") from None
        if not (
            type(pid) is int
            and type(fd) is int
            and type(ino) is int
            and type(places) is list
            and places
        ):
            raise ShmRefused(
                "descriptor must be [boot id, pid, fd, inode, [[frame, offset, bytes], ...]]"
            )
        if boot != BOOT_ID:
            raise ShmRefused(
                "the sender runs on another host (comm.shm_bytes is for processes on one host)"
            )
        seg = self._open(pid, fd, ino)
        out = list(frames[1:])
        low, high = seg.size, 0
        for place in places:
            if not (
                type(place) is list
                and len(place) == 3
                and all(type(x) is int and x >= 0 for x in place)
            ):
                raise ShmRefused(f"bad frame place {place!r:.60}")
            i, offset, n = place
            if not i < len(out) or memoryview(out[i]).nbytes or offset + n > seg.size - PAGE:
                raise ShmRefused(f"frame place {place} outside the message or the segment")
            low, high = min(low, offset), max(high, offset + n)
        # one object per message that every view of its frames keeps alive (a memoryview's
        # exporter): when it goes, the message is consumed and the client may write the segment again
        region = (ctypes.c_ubyte * (high - low)).from_buffer(seg.map, PAGE + low)
        weakref.finalize(region, _release, seg.map)
        whole = memoryview(region).cast("B").toreadonly()
        for i, offset, n in places:
            out[i] = whole[offset - low : offset - low + n]
        return out

    def _open(self, pid: int, fd: int, want_ino: int) -> _Opened:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            ino = os.stat(path).st_ino
            # another process of that pid (another pid namespace): not the sender's
            if ino != want_ino:
                raise ShmRefused(f"{path} is not the sender's segment")
            seg = self.opened.get((pid, fd))
            if seg is not None and seg.ino == ino:
                self.opened.move_to_end((pid, fd))
                return seg
            if not os.readlink(path).startswith(f"/memfd:{MEMFD_NAME}"):
                raise ShmRefused(f"{path} is not a hetps segment")
            own = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise ShmRefused(f"cannot open {path}: {exc}") from None
        try:
            if fcntl.fcntl(own, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK == 0:
                raise ShmRefused(f"{path} is not sealed against shrinking")
            size = os.fstat(own).st_size
            if size <= PAGE:
                raise ShmRefused(f"{path} holds no frames")
            seg = _Opened(own, size, ino)
        except BaseException:
            os.close(own)
            raise
        self._forget_gone()
        old = self.opened.pop((pid, fd), None)
        if old is not None:
            old.close()
        self.opened[(pid, fd)] = seg
        while len(self.opened) > self.open_segments:
            self.opened.popitem(last=False)[1].close()
        return seg

    def _forget_gone(self) -> None:
        """Close the segments their clients closed or died with (their memory is
        freed once no view of them is left)."""
        for (pid, fd), seg in list(self.opened.items()):
            try:
                alive = os.stat(f"/proc/{pid}/fd/{fd}").st_ino == seg.ino
            except OSError:
                alive = False
            if not alive:
                del self.opened[(pid, fd)]
                seg.close()

    def close(self) -> None:
        for seg in self.opened.values():
            seg.close()
        self.opened.clear()


def is_descriptor(frame) -> bool:
    return memoryview(frame)[: len(MARK)] == MARK
