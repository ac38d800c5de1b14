"""The stop target and the watched metric, as the configuration names them.

    stop.target: {metric: perplexity, value: 3.0}   any metric of the task, with its direction
    stop.target_accuracy: 0.95                      the classification shorthand for
                                                    {metric: accuracy, value: 0.95}
    eval.metric: r2                                 the watched metric when no target names one

The watched metric is stop.target's metric when a target is set, else
eval.metric, else the task's primary metric (its first). The scheduler reads
the names and directions of a task's metrics from each evaluation report (it
never imports user code); for the built-in tasks they are known here too, so
a name that is not one of theirs is a config error before anything starts.

`resolve_targets` runs on the plain data before the config is built
(load.py): it is the only place that still sees which keys the user wrote.
It makes the written config say what the run does, so the resolved config a
run directory keeps (config.yaml) loads back to the same targets:
`stop.target` set -> `stop.target_accuracy` null; a built-in task other than
classification and no target written -> `stop.target_accuracy` null (the
0.95 default is classification's).

A `package.module:factory` task's metrics are known once it is made
(`settle_factory_task`, where the config's code is imported: checks.py
`factory_task_metrics`). The shorthand is for a task whose primary metric is
accuracy: for any other, the 0.95 default is dropped (its primary metric is
watched and no target is set), and another value of stop.target_accuracy
targets its accuracy metric (an error when it has none). The value, not
whether it was written, decides: `hetps.run` hands over every key written out.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .build import Problems
from .factories import closest
from .schema import RunConfig, StopConfig

# metric name -> higher is better, primary first (worker/task.py's built-in tasks: the same names)
TASK_METRICS: dict[str, dict[str, bool]] = {
    "classification": {"accuracy": True, "loss": False},
    "regression": {"r2": True, "mse": False, "mae": False, "loss": False},
    "binary": {"auc": True, "logloss": False, "accuracy": True, "loss": False},
    "language_model": {"perplexity": False, "token_accuracy": True, "loss": False},
}
DEFAULT_TASK = "classification"


def task_name(raw_task: Any) -> str | None:
    """The task's name as written (`task: NAME` or `task: {name: NAME}`); the default when
    absent; None when it is not a name (the builder reports that)."""
    if raw_task is None:
        return DEFAULT_TASK
    if isinstance(raw_task, dict):
        raw_task = raw_task.get("name", DEFAULT_TASK)
    return raw_task if isinstance(raw_task, str) else None


def known_metrics(raw_task: Any) -> dict[str, bool] | None:
    """A built-in task's metrics (name -> higher is better); None for a
    `package.module:factory` task, whose metrics only its code knows."""
    return TASK_METRICS.get(task_name(raw_task) or "")


def resolve_targets(raw: dict, problems: Problems) -> None:
    """Check and settle stop.target, stop.target_accuracy and eval.metric in the
    plain data `raw` (a top-level copy the caller owns; the sections it changes
    are copied first). Problems name the key."""
    task = task_name(raw.get("task"))
    metrics = known_metrics(raw.get("task"))
    listed = ", ".join(metrics) if metrics else ""
    stop = raw.get("stop")
    stop = dict(stop) if isinstance(stop, dict) else {} if stop is None else None
    if stop is None:
        return  # not a mapping: the builder says so
    target = stop.get("target")
    accuracy = stop.get("target_accuracy")
    if target is not None and accuracy is not None:
        problems.add(
            "stop.target_accuracy",
            f"set stop.target or its classification shorthand stop.target_accuracy, not both (got "
            f"target {target!r} and target_accuracy {accuracy!r}; stop.target_accuracy=null drops "
            "the shorthand)",
        )
    elif target is not None:
        stop["target_accuracy"] = None
    elif metrics is not None and (
        "accuracy" not in metrics or (task != DEFAULT_TASK and "target_accuracy" not in stop)
    ):
        # binary has an accuracy, but its primary metric is auc: the default is not its target
        if accuracy is not None and "target_accuracy" in stop:
            problems.add(
                "stop.target_accuracy",
                f"task {task} has no accuracy metric (its metrics: {listed}); set stop.target: "
                f"{{metric: {next(iter(metrics))}, value: ...}} instead",
            )
        stop["target_accuracy"] = None  # the 0.95 default is classification's
    if isinstance(target, dict):
        name, value = target.get("metric"), target.get("value")
        if metrics is not None and isinstance(name, str) and name not in metrics:
            problems.add("stop.target.metric", not_a_metric(name, task, list(metrics)))
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                problems.add("stop.target.value", f"must be a finite number, got {value!r}")
    raw["stop"] = stop
    section = raw.get("eval")
    name = section.get("metric") if isinstance(section, dict) else None
    if isinstance(name, str) and metrics is not None and name not in metrics:
        problems.add("eval.metric", not_a_metric(name, task, list(metrics)))


def not_a_metric(name: str, task: str | None, metrics: list[str]) -> str:
    """`'f1' is not a metric of task T; allowed: ...; did you mean 'macro_f1'?`"""
    close = closest(name, metrics)
    hint = f"; did you mean {close!r}?" if close else ""
    return f"{name!r} is not a metric of task {task}; allowed: {', '.join(metrics)}{hint}"


def settle_factory_task(cfg: RunConfig, metrics: list[str], problems: Problems) -> RunConfig:
    """`cfg` once its `package.module:factory` task is known to report `metrics` (primary
    first): eval.metric and stop.target.metric checked against them, and the accuracy
    shorthand settled (see the module docstring). Problems name the key."""
    task, stop = cfg.task.name, cfg.stop
    for key, name in (
        ("eval.metric", cfg.eval.metric),
        ("stop.target.metric", stop.target.metric if stop.target else None),
    ):
        if name is not None and name not in metrics:
            problems.add(key, not_a_metric(name, task, metrics))
    accuracy = stop.target_accuracy
    if stop.target is not None or accuracy is None or metrics[0] == "accuracy":
        return cfg
    if accuracy == StopConfig().target_accuracy:
        stop = dataclasses.replace(stop, target_accuracy=None)  # the default is not its target
        return dataclasses.replace(cfg, stop=stop)
    if "accuracy" not in metrics:
        problems.add(
            "stop.target_accuracy",
            f"task {task} has no accuracy metric (its metrics: {', '.join(metrics)}); set "
            f"stop.target: {{metric: {metrics[0]}, value: ...}} instead",
        )
    return cfg


def stop_target(stop) -> tuple[str, float] | None:
    """(metric, value) of the run's stop target (a StopConfig): stop.target, else
    {accuracy: stop.target_accuracy}; None without one."""
    if stop.target is not None:
        return stop.target.metric, stop.target.value
    if stop.target_accuracy is not None:
        return "accuracy", stop.target_accuracy
    return None


def reached(value: float, target: float, higher_is_better: bool) -> bool:
    """Whether `value` reaches `target`: >= for a higher-is-better metric, <= for a
    lower-is-better one (NaN never does)."""
    return value >= target if higher_is_better else value <= target
