"""What a run's model file holds, held against what the run reports.

The evaluator writes RUN_DIR/model.safetensors from the model it measured
last; when it could not (a shard died as the run stopped), the launcher
builds the file from the shards' newest checkpoints (`hetps export`), which
may be older than the last evaluation summary.json reports. `check` compares
the shard versions in model.json with those of the last evaluation in
metrics.jsonl, records both in summary.json's `model` section and returns
the line the user must see when the file is older than what was reported,
or missing.
"""

from __future__ import annotations

import json
from pathlib import Path

from hetps.scheduler.runlog import SummaryFile, read_metrics, records_of


def _by_shard(versions) -> dict[str, int] | None:
    """`versions` as {psN: version}: a list in shard order (the evaluator's pull) or a dict
    by shard folder name (checkpoints); None when it is neither."""
    if isinstance(versions, list) and all(isinstance(v, int) for v in versions):
        return {f"ps{i}": v for i, v in enumerate(versions)}
    if isinstance(versions, dict) and all(isinstance(v, int) for v in versions.values()):
        return {str(k): v for k, v in versions.items()}
    return None


def _described(versions: dict[str, int]) -> str:
    return ", ".join(f"{k} v{v}" for k, v in sorted(versions.items()))


def last_reported(run_dir: Path) -> dict | None:
    """The last evaluation row of metrics.jsonl that names its shard versions."""
    rows = records_of(read_metrics(run_dir / "metrics.jsonl"), "eval")
    return next((r for r in reversed(rows) if _by_shard(r.get("versions"))), None)


def check(run_dir: Path) -> str | None:
    """Record in summary.json what model.safetensors holds (`model`: file, source,
    evaluation, each shard's version, its metrics, the last reported evaluation's
    versions, `older_than_reported`); returns a line for the user when the file is
    older than the last reported evaluation or was not written, else None."""
    summary_file = SummaryFile(run_dir)
    if summary_file.read() is None:
        return None
    reported = last_reported(run_dir)
    reported_versions = _by_shard(reported["versions"]) if reported else None
    path = run_dir / "model.safetensors"
    try:
        described = json.loads(path.with_suffix(".json").read_text()) if path.exists() else None
    except (OSError, ValueError):
        described = None
    if not isinstance(described, dict):
        summary_file.update(
            model={
                "file": None,
                "reported_versions": reported_versions,
                "older_than_reported": None,
            }
        )
        return (
            f"hetps run: no model file: {path} was not written (see the lines above)"
            if reported
            else None
        )
    versions = _by_shard(described.get("versions", described.get("checkpoint_versions")))
    older = (
        versions is not None
        and reported_versions is not None
        and any(versions.get(k, -1) < v for k, v in reported_versions.items())
    )
    watch = described.get("watch")
    value = (described.get("metrics") or {}).get(watch)
    summary_file.update(
        model={
            "file": path.name,
            "source": described.get("source"),
            "evaluation": described.get("evaluation"),
            "versions": versions,
            "metrics": described.get("metrics"),
            "reported_versions": reported_versions,
            "older_than_reported": older,
        }
    )
    if not older:
        return None
    assert versions is not None and reported_versions is not None and reported is not None
    measured = f"test {watch} {value:.4f}" if isinstance(value, (int, float)) else "not measured"
    said = reported.get(reported.get("watch"))
    said_text = f"{reported.get('watch')} {said:.4f}" if isinstance(said, (int, float)) else ""
    return (
        f"hetps run: {path.name} holds {_described(versions)} (from {described.get('source')}, "
        f"{measured}), older than the last evaluation reported: "
        f"{_described(reported_versions)} ({said_text})"
    )
