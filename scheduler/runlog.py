"""The run directory as the scheduler writes it, and its readers: metrics as
JSON lines, each plan, and the summary. Files are written whole through a
temporary file and a rename, so a reader never sees half a JSON document.
A resumed run appends to the same files: its records carry the run's time
and counts, on from the earlier segments' (segments.py), after a `segment`
record that marks where it began.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .outcome import INTERRUPTED
from .segments import Earlier


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RunLog:
    """Appends metric records to RUN_DIR/metrics.jsonl; a None dir writes nothing. Every record
    is written in the run's terms (`earlier`: the segments before this one, Earlier.shift)."""

    def __init__(self, run_dir: Path | None):
        self.run_dir = run_dir
        self._metrics = open(run_dir / "metrics.jsonl", "a", buffering=1) if run_dir else None
        self.sink = None  # also given every record when set: e.g. a TensorBoardSink
        self.earlier = Earlier()  # a resumed run's earlier segments (Coordinator.resume)

    def record(self, kind: str, **values: Any) -> None:
        values = self.earlier.shift(kind, values)
        if self._metrics:
            self._metrics.write(json.dumps({"kind": kind, **values}) + "\n")
        if self.sink is not None:
            self.sink.record(kind, values)

    def write_plan(self, plan: dict) -> None:
        if self.run_dir:
            write_json_atomic(self.run_dir / "plan.json", plan)
            write_json_atomic(self.run_dir / f"plan-{plan['plan_id']}.json", plan)

    def write_summary(self, summary: dict) -> None:
        """The scheduler's summary.json, whole (SummaryFile.write)."""
        if self.run_dir:
            SummaryFile(self.run_dir).write(summary)

    def close(self) -> None:
        if self._metrics:
            self._metrics.close()
        if self.sink is not None:
            self.sink.close()


def parse_record(line: str | bytes) -> dict | None:
    """One line of a metrics file as a record (a map with a string `kind`); None for a line that
    is none: torn by a kill, edited by hand, bytes that are no UTF-8 (replaced, not refused)."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("kind"), str) else None


def read_metrics(path: Path) -> list[dict]:
    """Every record of a metrics file (parse_record: a line that is no record is skipped)."""
    if not path.exists():
        return []
    return [r for r in map(parse_record, path.read_bytes().splitlines()) if r is not None]


def _is(value: Any, kind: type) -> bool:
    if kind is float:  # any real number: a peer's loss of 1 is written as 1
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def fits(rec: dict, **types: type) -> bool:
    """Whether `rec` holds each key of `types` with a value of that type (`float`: any real
    number; a bool is no number). What a reader of metrics.jsonl checks before it uses a
    record's fields: a file may hold records of another version, or edited by hand, and the
    step records' optional fields are whatever a worker sent (docs/protocol.md, Step records)."""
    return all(_is(rec.get(key), kind) for key, kind in types.items())


def records_of(records: list[dict], kind: str, **types: type) -> list[dict]:
    """The records of `kind` that `fits(**types)`, in order; the others are skipped."""
    return [r for r in records if r.get("kind") == kind and fits(r, **types)]


def steps_recorded(records: list[dict]) -> tuple[int, float]:
    """The workers' steps as their step records tell them (each worker's highest
    `step` + 1, summed) and the time of the latest one (seconds since training
    began): what a run's metrics.jsonl says when nothing else does (a scheduler
    that died between two saves of its state)."""
    highest: dict[int, int] = {}
    steps = records_of(records, "step", worker=int, step=int, t=float)
    for r in steps:
        highest[r["worker"]] = max(highest.get(r["worker"], -1), r["step"])
    last_t = max((r["t"] for r in steps), default=0.0)
    return sum(h + 1 for h in highest.values()), last_t


def plan_fits(rec: dict) -> bool:
    """Whether `rec` is a `plan` record with what its readers use: `t`, `plan_id` and `groups`
    (lists of worker node ids)."""
    return (
        rec.get("kind") == "plan"
        and fits(rec, t=float, plan_id=int, groups=list)
        and all(isinstance(g, list) for g in rec["groups"])
    )


def read_summary(run_dir: Path) -> dict | None:
    """RUN_DIR/summary.json; None when there is none (or it is no JSON)."""
    return SummaryFile(run_dir).read()


class SummaryFile:
    """RUN_DIR/summary.json, and the one writer of it. The scheduler writes its summary whole
    when the run stops (`write`); the launcher, and the simulator, then add to it (`update`,
    `mark_failed`, `mark_interrupted`). Every change reads, merges and writes under an
    exclusive lock on the run directory (flock: processes of one host) through a temporary
    file and a rename: a reader never sees half a document, and a writer never loses
    another's change. Blocking (briefly); raises OSError."""

    NAME = "summary.json"

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.path = run_dir / self.NAME

    def read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def write(self, summary: dict) -> None:
        """Replace the summary with `summary` (the scheduler's, at the end of a run)."""
        with self._locked():
            write_json_atomic(self.path, summary)

    def update(self, **fields: Any) -> dict:
        """Set top-level `fields` in the summary (none yet: an empty one); returns the result."""
        return self._change(lambda summary: {**summary, **fields})

    def mark_failed(self, node: str, detail: str) -> dict:
        """Mark the run failed: the scheduler's own summary, if any, kept (what it counted and
        measured, its failures), with the node that failed and why. Its stop reason is kept,
        unless it is the stop the launcher asked for after the failure (`interrupted`): then
        the run stopped for `detail`. Returns the result."""

        def failed(summary: dict) -> dict:
            reason = summary.get("stop_reason")
            return {
                **summary,
                "status": "failed",
                "failed_node": node,
                "detail": detail,
                "stop_reason": detail if reason in (None, "", INTERRUPTED) else reason,
            }

        return self._change(failed)

    def mark_interrupted(self) -> dict:
        """Ctrl-C: the summary says so, even if the scheduler saw the stop another way."""
        return self._change(
            lambda summary: {**summary, "status": INTERRUPTED, "stop_reason": INTERRUPTED}
        )

    def _change(self, change: Callable[[dict], dict]) -> dict:
        """Read, `change` and write back (unless unchanged) under the lock."""
        with self._locked():
            summary = self.read() or {}
            changed = change(summary)
            if changed != summary or not self.path.exists():
                write_json_atomic(self.path, changed)
            return changed

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.run_dir, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when closed
            yield
        finally:
            os.close(fd)
