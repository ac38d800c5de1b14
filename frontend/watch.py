"""The watched metric as the readers of a run directory find it: in each
metrics.jsonl eval row (`watch` names it, its value is the row's key of that
name) and in summary.json (`metric`, `final_metrics`, `best`, `target`).
Rows and summaries written before metrics were named hold accuracy: read as
the watched metric, higher is better."""

from __future__ import annotations

from hetps.runconfig.schema import RunConfig
from hetps.runconfig.targets import TASK_METRICS, stop_target
from hetps.scheduler.runlog import fits

ACCURACY = "accuracy"


def run_metric(rows: list[dict]) -> str:
    """The metric a run's eval rows watch: the latest row's `watch`; accuracy for rows
    without one (or no rows)."""
    for row in reversed(rows):
        if row.get("kind") == "eval" and isinstance(row.get("watch"), str):
            return row["watch"]
    return ACCURACY


def configured_metric(cfg: RunConfig) -> str | None:
    """The metric a run of `cfg` watches, known before its first evaluation (the progress
    line's name until then): training/task.py watched_metric's rule, from the config for a
    built-in task, from the task itself for a `package.module:factory` one (its module is
    imported already: the config was loaded with its targets). None when that task cannot
    be built here; the check before training reports why."""
    metrics = TASK_METRICS.get(cfg.task.name)
    if metrics is None:
        from hetps.training.task import load_task, watched_metric

        try:
            return watched_metric(cfg, load_task(cfg, cfg.data.num_classes)).name
        except Exception:  # noqa: BLE001 - the user's factory: its error is the check's to report
            return None
    target = stop_target(cfg.stop)
    return cfg.eval.metric or (target[0] if target else next(iter(metrics)))


def row_value(row: dict) -> tuple[str, float] | None:
    """(metric, value) an eval row watches: its `watch` key's number, else its accuracy (a
    row written before metrics were named); None when the row holds neither."""
    name = row.get("watch") if isinstance(row.get("watch"), str) else ACCURACY
    return (name, float(row[name])) if fits(row, **{name: float}) else None


def watched_rows(records: list[dict], metric: str, **types: type) -> list[dict]:
    """The eval records that hold a number for `metric` (and `types`), in order."""
    return [r for r in records if r.get("kind") == "eval" and fits(r, **{**types, metric: float})]


def summary_metric(summary: dict) -> dict:
    """The watched metric of a summary.json: name, higher_is_better, final, best and
    target (a number or None), from the named fields or, in an older summary, accuracy's."""
    named = summary.get("metric")
    if isinstance(named, dict) and isinstance(named.get("name"), str):
        name = named["name"]
        target = summary.get("target") or {}
        final = (summary.get("final_metrics") or {}).get(name)
        return {
            "name": name,
            "higher_is_better": bool(named.get("higher_is_better", True)),
            "final": final,
            "best": summary.get("best"),
            "target": target.get("value") if target.get("metric") == name else None,
        }
    return {
        "name": ACCURACY,
        "higher_is_better": True,
        "final": summary.get("final_accuracy"),
        "best": summary.get("best_accuracy"),
        "target": summary.get("target_accuracy"),
    }


def label(metric: str) -> str:
    """E.g. `test accuracy`, `test perplexity`."""
    return f"test {metric}"


def number(value: float | None) -> str:
    """A metric's value for a line of text: 4 decimals, or 4 significant digits when
    that hides it (an MSE of 12345.6 or of 0.00001234); `-` for None."""
    if value is None:
        return "-"
    return f"{value:.4f}" if 1e-3 <= abs(value) < 1e4 or value == 0 else f"{value:.4g}"
