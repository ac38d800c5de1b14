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
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

from hetps.runconfig.schema import CheckpointConfig

log = logging.getLogger(__name__)
FORMAT = 2  # 2: policy state after ps/policies/ (one `pushed` clock map, shared counts)
_NAME = re.compile(r"v(\d{12})\.pt")


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


def load(path: Path) -> dict:
    import torch  # here: `hetps run` lists checkpoints (frontend/faults.py) without torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a hetps shard checkpoint of format {FORMAT}")
    return state


def abandon_after(folder: Path, version: int) -> list[Path]:
    """Set aside (rename to *.abandoned) the checkpoints newer than `version`:
    after restoring an older one they belong to a timeline that no longer
    continues, and must never be restored or outlive the new ones."""
    moved = []
    for v, path in checkpoints(folder):
        if v > version:
            target = path.with_name(path.name + ".abandoned")
            os.replace(path, target)
            moved.append(target)
    return moved


def write_atomic(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        import torch

        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    """Decides when a shard writes a checkpoint (every `every_updates`
    updates or `every_s` seconds, whichever comes first) and keeps the newest
    `keep` of them."""

    def __init__(self, cfg: CheckpointConfig, folder: Path):
        self.cfg = cfg
        self.folder = folder
        self.last_version = -1
        self.last_time = time.monotonic()
        self.written = 0
        self.seconds = 0.0  # spent writing

    def due(self, version: int) -> bool:
        if version == self.last_version:
            return False
        by_count = (
            self.cfg.every_updates > 0
            and version - max(self.last_version, 0) >= self.cfg.every_updates
        )
        by_time = self.cfg.every_s > 0 and time.monotonic() - self.last_time >= self.cfg.every_s
        return by_count or by_time

    def write(self, state: dict) -> Path:
        started = time.monotonic()
        version = int(state["version"])
        path = self.folder / f"v{version:012d}.pt"
        write_atomic(path, {"format": FORMAT, **state})
        self.last_version, self.last_time = version, time.monotonic()
        self.written += 1
        self.seconds += self.last_time - started
        for _, old in checkpoints(self.folder)[: -max(1, self.cfg.keep)]:
            old.unlink(missing_ok=True)
        log.debug("checkpoint v%d written in %.3fs", version, self.last_time - started)
        return path
