"""Shard checkpoints: one file per checkpoint, written atomically.

Layout: `DIR/RUN_ID/ps{RANK}/v{VERSION:012d}.pt`, where RUN_ID comes from the
plan, so a directory reused by a later run never restores the wrong
experiment. A checkpoint is written to a temporary file in the same folder,
flushed and fsync'ed, renamed into place, and the folder fsync'ed: a crash
leaves either the old set or the new file complete, never half a file.

The files hold the shard's own state (tensors, optimizer and lr-schedule
state, versions, the policy's clocks and open rounds as plain data, recent
push ACKs) in torch's format, and load with `torch.load(weights_only=True)`:
tensors and plain containers only, no pickled class is ever loaded.

Integrity: a file is a 48-byte header (MAGIC, the payload's length, its
SHA-256) followed by the payload torch.save wrote. torch.load checks no
checksum of its zip, so a file cut short or with a few bytes changed could
otherwise load and serve damaged values; `load` verifies the length and hash
first and raises CheckpointDamaged naming the file. A starting shard passes
over damaged checkpoints to the newest valid one (`restore_point`), and
refuses to start (NoValidCheckpoint, naming the folder) when none is valid.
Checkpoints of format 2 and older (bare torch files, no checksum) are refused
as damaged: their contents cannot be told apart from a damaged file's.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
import re
import struct
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from hetps.runconfig.schema import CheckpointConfig

log = logging.getLogger(__name__)
# 3: the header with the payload's length and SHA-256; 2: policy state after ps/policies/
FORMAT = 3
MAGIC = b"HETPSCK\n"
_HEADER = struct.Struct("<8sQ32s")  # MAGIC, payload bytes, SHA-256 of the payload
_CHUNK = 1 << 20  # bytes hashed at a time by `verify`
_NAME = re.compile(r"v(\d{12})\.pt")
_TMP = re.compile(r"\.v\d{12}\.pt\.\d+\.tmp")
MAX_REPORTED = 16  # damaged files a shard's stats name (the newest)
K = TypeVar("K")


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored; the message names the file or folder."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint file that fails its integrity check: cut short, changed
    after it was written, unreadable, or not a hetps checkpoint of FORMAT."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"checkpoint {path} is damaged: {reason}")
        self.path, self.reason = Path(path), reason

    def report(self) -> dict:
        """Plain data for a shard's stats (the scheduler's `checkpoint_damaged` failures)."""
        return {"file": str(self.path), "error": self.reason}


class NoValidCheckpoint(CheckpointError):
    """A folder holds checkpoints and every one is damaged."""

    def __init__(self, folder: Path, damaged: list[CheckpointDamaged]):
        listed = "; ".join(f"{d.path.name}: {d.reason}" for d in damaged)
        super().__init__(
            f"no valid checkpoint in {folder} ({listed}); not starting afresh over them: "
            "restore a copy, or move the folder away to start from initial values"
        )
        self.folder, self.damaged = folder, damaged


def shard_dir(root: str | Path, run_id: str, rank: int) -> Path:
    return Path(root) / (run_id or "run") / f"ps{rank}"


def checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(version, path) of every complete checkpoint in `folder`, oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.fullmatch(p.name))]
    return sorted(found)


def latest(folder: Path, version: int | None = None) -> Path | None:
    """The newest checkpoint (or the one at exactly `version`), None if there is none."""
    for v, path in reversed(checkpoints(folder)):
        if version is None or v == version:
            return path
    return None


def _header(f, path: Path) -> tuple[int, bytes]:
    """(payload length, SHA-256) from an open checkpoint's header."""
    raw = f.read(_HEADER.size)
    if len(raw) == _HEADER.size and raw.startswith(MAGIC):
        _, length, digest = _HEADER.unpack(raw)
        return length, digest
    if raw.startswith(b"PK\x03\x04"):  # torch's zip: hetps before format 3 wrote bare torch files
        reason = (
            f"not a hetps shard checkpoint of format {FORMAT}: a bare torch file, without the "
            "checksum of format 3 (an older hetps's checkpoint, or not a checkpoint)"
        )
    elif not raw:
        reason = "empty"
    elif MAGIC.startswith(raw[: len(MAGIC)]):
        reason = f"cut short: {len(raw)} bytes, within its {_HEADER.size}-byte header"
    else:
        reason = f"not a hetps shard checkpoint of format {FORMAT} (no hetps header)"
    raise CheckpointDamaged(path, reason)


def _check(path: Path, length: int, digest: bytes, size: int, sha: bytes) -> None:
    if size < length:
        raise CheckpointDamaged(path, f"cut short: {size} of its {length} bytes of data")
    if size > length:
        raise CheckpointDamaged(path, f"{size - length} bytes longer than written")
    if sha != digest:
        raise CheckpointDamaged(
            path,
            f"checksum mismatch: its bytes changed after it was written (SHA-256 {sha.hex()[:16]}..., "
            f"written {digest.hex()[:16]}...)",
        )


def verify(path: Path) -> None:
    """Raise CheckpointDamaged unless `path` is whole and unchanged: its
    length and SHA-256 are those its header recorded. Reads the file in
    chunks and needs no torch (`hetps run --resume` checks without it)."""
    try:
        with open(path, "rb") as f:
            length, digest = _header(f, path)
            sha, size = hashlib.sha256(), 0
            while chunk := f.read(_CHUNK):
                sha.update(chunk)
                size += len(chunk)
    except OSError as exc:
        raise CheckpointDamaged(path, f"unreadable: {exc}") from exc
    _check(path, length, digest, size, sha.digest())


def damage(path: Path) -> CheckpointDamaged | None:
    """What `verify` finds wrong with `path`, None when it is valid."""
    try:
        verify(path)
    except CheckpointDamaged as exc:
        return exc
    return None


def load(path: Path) -> dict:
    """A checkpoint's state, its integrity verified first (CheckpointDamaged
    otherwise); tensors and plain containers only (weights_only)."""
    import torch  # here: `hetps run` lists checkpoints (frontend/faults.py) without torch

    try:
        with open(path, "rb") as f:
            length, digest = _header(f, path)
            payload = f.read()
    except OSError as exc:
        raise CheckpointDamaged(path, f"unreadable: {exc}") from exc
    _check(path, length, digest, len(payload), hashlib.sha256(payload).digest())
    # a BytesIO over the bytes object shares its buffer: the payload is in memory once
    state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a hetps shard checkpoint of format {FORMAT}")
    return state


@dataclass
class RestorePoint:
    """What a starting shard restores (`restore_point`)."""

    path: Path | None  # None: the folder holds no checkpoint (a fresh start)
    state: dict | None
    # checkpoints newer than `path` that failed their integrity check, newest first
    damaged: list[CheckpointDamaged] = field(default_factory=list)


def restore_point(folder: Path, version: int | None = None) -> RestorePoint:
    """The newest checkpoint in `folder` that passes its integrity check,
    loaded; a damaged newer one is passed over (listed in `damaged`).
    `version`: exactly that one (absent: path None; damaged: CheckpointDamaged),
    and the newer ones are verified so that `damaged` lists theirs too.
    Raises NoValidCheckpoint when the folder holds checkpoints and none is
    valid: starting from initial values over them would silently throw the
    training away."""
    found = checkpoints(folder)
    if version is not None:
        path = latest(folder, version)
        if path is None:
            return RestorePoint(None, None)
        state = load(path)
        newer = [p for v, p in reversed(found) if v > version]
        return RestorePoint(path, state, [d for d in map(damage, newer) if d is not None])
    damaged = []
    for _, path in reversed(found):
        try:
            return RestorePoint(path, load(path), damaged)
        except CheckpointDamaged as exc:
            damaged.append(exc)
    if damaged:
        raise NoValidCheckpoint(folder, damaged)
    return RestorePoint(None, None)


def resume_versions(folders: dict[K, Path]) -> tuple[dict[K, int], bool, list[CheckpointDamaged]]:
    """The checkpoint version each folder's shard restores when a stopped
    run goes on (`hetps run --resume`) or its model is exported: the newest
    version every folder holds a valid checkpoint of (consistent: True);
    without one, each folder's newest valid checkpoint (False). Only the files
    considered are verified (hashed; no torch). Returns (versions, consistent,
    the damaged files met). Raises NoValidCheckpoint for a folder whose every
    checkpoint is damaged, CheckpointError for one without any."""
    found = {k: dict(checkpoints(folder)) for k, folder in folders.items()}
    judged: dict[Path, CheckpointDamaged | None] = {}

    def valid(path: Path) -> bool:
        if path not in judged:
            judged[path] = damage(path)
        return judged[path] is None

    def met() -> list[CheckpointDamaged]:
        return [d for d in judged.values() if d is not None]

    common = set.intersection(*(set(v) for v in found.values())) if found else set()
    for version in sorted(common, reverse=True):
        if all(valid(by_version[version]) for by_version in found.values()):
            return {k: version for k in found}, True, met()
    versions = {}
    for k, by_version in found.items():
        if not by_version:
            raise CheckpointError(f"no checkpoints in {folders[k]}")
        newest = next((v for v in sorted(by_version, reverse=True) if valid(by_version[v])), None)
        if newest is None:
            raise NoValidCheckpoint(folders[k], [judged[p] for p in reversed(by_version.values())])
        versions[k] = newest
    return versions, False, met()


def newest_valid_versions(
    folders: dict[K, Path],
) -> tuple[dict[K, int], list[CheckpointDamaged]]:
    """Each folder's newest valid checkpoint version: the newest model every
    shard can give (`hetps export`, a run's result model), whether or not the
    shards hold one version in common. Only the files considered are verified.
    Returns (versions, the damaged files met). Raises NoValidCheckpoint for a
    folder whose every checkpoint is damaged, CheckpointError for one without any."""
    versions: dict[K, int] = {}
    met: list[CheckpointDamaged] = []
    for k, folder in folders.items():
        found = checkpoints(folder)
        if not found:
            raise CheckpointError(f"no checkpoints in {folder}")
        damaged: list[CheckpointDamaged] = []
        for version, path in reversed(found):
            why = damage(path)
            if why is None:
                versions[k] = version
                break
            damaged.append(why)
        else:
            raise NoValidCheckpoint(folder, damaged)
        met.extend(damaged)
    return versions, met


def abandon_after(folder: Path, version: int, damaged: Collection[Path] = ()) -> list[Path]:
    """Set aside (rename to *.abandoned) the checkpoints newer than `version`:
    after restoring an older one they belong to a timeline that no longer
    continues, and must never be restored or outlive the new ones. Those in
    `damaged` become *.damaged instead, kept for a look but never restored."""
    moved = []
    for v, path in checkpoints(folder):
        if v > version:
            target = path.with_name(path.name + (".damaged" if path in damaged else ".abandoned"))
            os.replace(path, target)
            moved.append(target)
    return moved


class _HashingWriter:
    """The file object torch.save writes to: counts and hashes the bytes on
    their way into `f`, and keeps the OSError a write raised (torch's zip
    writer replaces it with its own `RuntimeError: ... unexpected pos`)."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            written = self.f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise
        self.sha.update(data)
        self.size += memoryview(data).nbytes
        return written

    def flush(self) -> None:
        self.f.flush()


def write_atomic(path: Path, state: dict) -> None:
    """Write `state` to `path` (header, then torch's payload) through a
    temporary file: `path` appears complete or not at all. On any error the
    temporary file is removed (a disk briefly full must not stay full) and
    the error raised: the OSError behind a failed write, not torch's wrapper."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    f = open(tmp, "wb")
    try:
        with f:
            f.write(_HEADER.pack(MAGIC, 0, bytes(32)))  # filled in once the payload is written
            out = _HashingWriter(f)
            try:
                torch.save(state, out)
            except Exception as exc:
                if out.error is not None:
                    raise out.error from exc
                raise
            f.seek(0)
            f.write(_HEADER.pack(MAGIC, out.size, out.sha.digest()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError as exc:  # the error that matters is the one being raised
            log.warning("could not remove %s: %s", tmp, exc)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_leftovers(folder: Path) -> list[Path]:
    """Remove the temporary files of writes this host's processes no longer
    make (a process killed while writing): their space is the disk's again."""
    removed = []
    if not folder.is_dir():
        return removed
    for path in folder.iterdir():
        if _TMP.fullmatch(path.name) and not _running(int(path.name.split(".")[-2])):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def error_kind(exc: BaseException) -> str:
    """How a failed write is told apart in the log: `OSError ENOSPC`, `RuntimeError`."""
    code = errno.errorcode.get(exc.errno, str(exc.errno)) if isinstance(exc, OSError) else ""
    return f"{type(exc).__name__} {code}".strip()


class Checkpointer:
    """Decides when a shard writes a checkpoint (every `every_updates`
    updates or `every_s` seconds, whichever comes first) and keeps the newest
    `keep` of them. A failed write (`failed`) is retried at the next interval,
    not at every update; each kind of error is logged once."""

    def __init__(self, cfg: CheckpointConfig, folder: Path):
        self.cfg = cfg
        self.folder = folder
        self.last_version = -1  # of the newest checkpoint written
        self.attempted = -1  # version of the newest write tried, written or not
        self.last_time = time.monotonic()
        self.written = 0
        self.seconds = 0.0  # spent writing
        self.errors: dict[str, int] = {}  # kind of error (error_kind) -> failed writes
        self.failing = 0  # failed writes since the last one that succeeded
        # checkpoints of this folder found damaged when the shard started (CheckpointDamaged.report)
        self.damaged: list[dict] = []

    def start(self, last_version: int, damaged: list[dict]) -> None:
        """Checkpoints start now, after the shard restored (or did not): the newest one in
        the folder is of `last_version` (-1: none), `damaged` those found damaged at start
        (reported in `stats`); `every_s` counts from now, not from the restore's start."""
        self.last_version = last_version
        self.damaged = list(damaged)
        self.last_time = time.monotonic()

    def due(self, version: int) -> bool:
        last = max(self.last_version, self.attempted)
        if version == last:
            return False
        by_count = self.cfg.every_updates > 0 and version - max(last, 0) >= self.cfg.every_updates
        by_time = self.cfg.every_s > 0 and time.monotonic() - self.last_time >= self.cfg.every_s
        return by_count or by_time

    def write(self, state: dict) -> Path:
        started = time.monotonic()
        version = int(state["version"])
        self.attempted, self.last_time = version, started
        path = self.folder / f"v{version:012d}.pt"
        write_atomic(path, {"format": FORMAT, **state})
        self.last_version, self.last_time = version, time.monotonic()
        self.written += 1
        self.seconds += self.last_time - started
        for _, old in checkpoints(self.folder)[: -max(1, self.cfg.keep)]:
            old.unlink(missing_ok=True)
        if self.failing:
            log.info("checkpoint v%d written, after %d failed writes", version, self.failing)
            self.failing = 0
        log.debug("checkpoint v%d written in %.3fs", version, self.last_time - started)
        return path

    def failed(self, version: int, exc: BaseException) -> None:
        """Count a write that raised `exc`; log the first of each kind of
        error (a full disk fails every write until space is freed)."""
        kind = error_kind(exc)
        self.errors[kind] = self.errors.get(kind, 0) + 1
        self.failing += 1
        if self.errors[kind] == 1:
            log.error(
                "checkpoint v%d not written to %s: %s (training goes on; later %s errors are "
                "counted in checkpoint_errors, not logged)",
                version,
                self.folder,
                exc,
                kind,
            )
        else:
            log.debug("checkpoint v%d not written: %s", version, exc)

    def stats(self) -> dict:
        """A shard's checkpoint numbers, for its stats (heartbeats, /metrics, summary)."""
        return {
            "checkpoints": self.written,
            "checkpoint_s": round(self.seconds, 3),
            "checkpoint_version": self.last_version,
            **({"checkpoints_damaged": self.damaged[:MAX_REPORTED]} if self.damaged else {}),
        }
