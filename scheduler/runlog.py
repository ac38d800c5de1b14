"""The run directory as the scheduler writes it, and its readers: metrics as
JSON lines, each plan, and the summary. Files are written whole through a
temporary file and a rename, so a reader never sees half a JSON document.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RunLog:
    """Appends metric records to RUN_DIR/metrics.jsonl; a None dir writes nothing."""

    def __init__(self, run_dir: Path | None):
        self.run_dir = run_dir
        self._metrics = open(run_dir / "metrics.jsonl", "a", buffering=1) if run_dir else None
        self.sink = None  # also given every record when set: e.g. a TensorBoardSink

    def record(self, kind: str, **values: Any) -> None:
        if self._metrics:
            self._metrics.write(json.dumps({"kind": kind, **values}) + "\n")
        if self.sink is not None:
            self.sink.record(kind, values)

    def write_plan(self, plan: dict) -> None:
        if self.run_dir:
            write_json_atomic(self.run_dir / "plan.json", plan)
            write_json_atomic(self.run_dir / f"plan-{plan['plan_id']}.json", plan)

    def write_summary(self, summary: dict) -> None:
        if self.run_dir:
            write_json_atomic(self.run_dir / "summary.json", summary)

    def close(self) -> None:
        if self._metrics:
            self._metrics.close()
        if self.sink is not None:
            self.sink.close()


def read_metrics(path: Path) -> list[dict]:
    """All complete JSON lines of a metrics file (a torn last line is skipped)."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_summary(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def mark_failed(run_dir: Path, summary: dict, node: str, detail: str) -> None:
    """Write summary.json as a failed run's (the scheduler's own summary, if any, kept)."""
    write_json_atomic(
        run_dir / "summary.json",
        {
            **summary,
            "status": "failed",
            "failed_node": node,
            "detail": detail,
            "stop_reason": summary.get("stop_reason") or detail,
        },
    )
