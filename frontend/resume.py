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
appended, and read as one run's: the new segment's time, steps, samples and
bytes go on from the earlier segments' (scheduler/segments.py), and
`stop.max_steps` counts the whole run while `stop.max_seconds` counts the
new segment (`check_limits`, `resume_line`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hetps.runconfig.schema import ConfigError, RunConfig
from hetps.runtime import checkpoint
from hetps.scheduler import segments, state


@dataclass(frozen=True)
class ResumePoint:
    run_id: str
    versions: dict[int, int]  # shard rank -> checkpoint version to restore
    consistent: bool  # every shard restores the same version
    # checkpoints passed over for failing their integrity check
    damaged: list[checkpoint.CheckpointDamaged] = field(default_factory=list)
    # what the run did before: the new segment goes on from it
    earlier: segments.Earlier = field(default_factory=segments.Earlier)


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
    return ResumePoint(saved["run_id"], versions, consistent, damaged, segments.after(saved))


def check_limits(point: ResumePoint, cfg: RunConfig) -> None:
    """`stop.max_steps` counts the whole run: one the run already reached would stop the new
    segment as soon as it began. Raises ConfigError saying how far the run got."""
    done, limit = point.earlier.total("steps"), cfg.stop.max_steps
    if limit and done >= limit:
        raise ConfigError(
            f"stop.max_steps: the run already made {done} steps of stop.max_steps={limit}, which "
            f"counts the whole run, resumed or not; raise it (e.g. stop.max_steps={done + limit})"
        )


def resume_line(point: ResumePoint, run_dir: Path, cfg: RunConfig) -> str:
    """What `hetps run --resume` says before it starts: which run, from where, and what the
    stop limits count."""
    earlier, stop = point.earlier, cfg.stop
    done = earlier.total("steps")
    steps = (
        f"stop.max_steps={stop.max_steps} counts the whole run ({stop.max_steps - done} more steps)"
        if stop.max_steps
        else "no step limit"
    )
    return (
        f"resuming run {point.run_id} in {run_dir} as segment {earlier.segment}, after {done} "
        f"steps and {earlier.t:.1f}s of training, from shard versions {point.versions}"
        f"{'' if point.consistent else ' (not one common version)'}; {steps}, "
        f"stop.max_seconds={stop.max_seconds:g} counts this segment"
    )


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
