"""`hetps run --resume RUN_DIR`: continue a stopped run from its shard
checkpoints.

The resume point is the newest checkpoint version that every shard has a
valid checkpoint of (under sync and grouping the shards' versions advance
together, and every shard writes a last checkpoint when the run stops, after
the workers left); without a common version, each shard's newest valid one.
A damaged checkpoint (runtime/checkpoint.py's integrity check) is passed over
for every shard alike, so the shards still resume at one version; the shard
whose file it is names it (its log, summary.json `failures`). The resumed run
keeps the run id (so checkpoints stay in one folder), the config
(RUN_DIR/config.yaml, plus any overrides) and the run directory; metrics are
appended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hetps.runconfig.schema import ConfigError
from hetps.runtime import checkpoint
from hetps.scheduler import state


@dataclass(frozen=True)
class ResumePoint:
    run_id: str
    versions: dict[int, int]  # shard rank -> checkpoint version to restore
    consistent: bool  # every shard restores the same version
    # checkpoints passed over for failing their integrity check
    damaged: list[checkpoint.CheckpointDamaged] = field(default_factory=list)


def resume_point(run_dir: Path, n_shards: int) -> ResumePoint:
    saved = state.read(run_dir)
    if saved is None:
        raise ConfigError(
            f"{run_dir}: no {state.STATE_FILE}; not a run directory written by `hetps run`"
        )
    root = checkpoints_root(run_dir)
    folders = {rank: checkpoint.shard_dir(root, saved["run_id"], rank) for rank in range(n_shards)}
    empty = [f"ps{r}" for r, folder in folders.items() if not checkpoint.checkpoints(folder)]
    if empty:
        raise ConfigError(f"{run_dir}: no checkpoints of {', '.join(empty)} under {root}")
    try:
        versions, consistent, damaged = checkpoint.resume_versions(folders)
    except checkpoint.CheckpointError as exc:
        raise ConfigError(str(exc)) from None
    return ResumePoint(saved["run_id"], versions, consistent, damaged)


def check_same_shards(run_dir: Path, n_shards: int) -> None:
    """A resumed run keeps the stopped run's placement: same number of shards."""
    plan = (state.read(run_dir) or {}).get("plan") or {}
    before = len(plan.get("shards", []))
    if before and before != n_shards:
        raise ConfigError(
            f"cluster.shards: the stopped run had {before} shards, not {n_shards}; "
            "a resumed run keeps its shards (tensors do not move)"
        )


def checkpoints_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def strip_resume(args: tuple) -> tuple:
    """A daemon's `args` without `--resume` and `--restore-version V`: a process
    started again goes on from its own newest checkpoint."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--restore-version":
            skip = True
        elif a != "--resume":
            out.append(a)
    return tuple(out)
