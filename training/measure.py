"""Measuring a model on the test split: every metric of its task, a plain
classifier's accuracy and loss, which of two values is better, and the values an
evaluation REPORT carries. Shared by the evaluator daemon, the simulator and
`hetps export`."""

from __future__ import annotations

import math

import torch

from hetps.runconfig.schema import RunConfig

from .data import ArrayDataset, test_batches
from .task import Classification, Metric, Task, evaluate_task


def better(metric: Metric, value: float, than: float | None) -> bool:
    """Whether `value` of `metric` beats `than` (None: nothing yet); NaN never does."""
    if not math.isfinite(value) and not (value == math.inf and metric.higher_is_better):
        return False
    if than is None or math.isnan(than):
        return True
    return value > than if metric.higher_is_better else value < than


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, data: ArrayDataset, batch_size: int, device: torch.device
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy loss) of a classifier on all of `data`."""
    metrics = evaluate_task(Classification(), model, test_batches(data, batch_size), device)
    return metrics["accuracy"], metrics["loss"]


def measure(
    task: Task, model: torch.nn.Module, test, cfg: RunConfig, device, batches=None
) -> dict[str, float]:
    """Every metric of `task` on the whole test split (`data.eval_batch_size` batches).
    `batches`: the split's `test_loader`, made once by a caller that measures again and
    again (the evaluator); None: one made for this measure."""
    if batches is None:
        batches = test_loader(task, test, cfg)
    return evaluate_task(task, model, batches, device)


def test_loader(task: Task, test, cfg: RunConfig, persistent: bool = False):
    """The test split's batches as `measure` reads them, to iterate once per
    evaluation; `persistent`: its loader processes (`data.num_workers`) stay."""
    return test_batches(
        test, cfg.data.eval_batch_size, task.collate, cfg.data.num_workers, persistent
    )


def report_values(task: Task, watched: Metric, metrics: dict[str, float], **more) -> dict:
    """An evaluation REPORT's values: every metric, their directions, the
    watched one's name, the test loss, accuracy (when the task has it), the
    class count (the divergence guard's chance level), and `more`."""
    out = {
        "metrics": metrics,
        "higher_is_better": {m.name: m.higher_is_better for m in task.metrics},
        "watch": watched.name,
        "loss": metrics.get("loss"),
        "num_classes": task.num_classes,
        **more,
    }
    if "accuracy" in metrics:
        out["accuracy"] = metrics["accuracy"]
    return out
