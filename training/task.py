"""The training task: what a batch's loss is, which metrics an evaluation
measures (and which way is better), how many samples a batch holds, and how
batches are collated and moved to the device. The worker's step
(step.py), the dry step before training (preflight.py), the evaluator and
`hetps export` ask the task; nothing else in the worker knows the loss.

`task:` in the config picks one:

- `classification` (the default): batches `(x, y)`, y int class indices;
  loss = cross-entropy(model(x), y); metrics accuracy (primary), loss.
- `regression`: batches `(x, y)`, y float targets; loss = MSE; metrics r2
  (primary), mse, mae, loss (= mse).
- `binary`: batches `(x, y)`, y float labels in {0, 1}, model(x) logits of
  y's shape (a trailing dimension of 1 is dropped); loss = binary
  cross-entropy with logits; metrics auc (primary), logloss, accuracy (at
  probability 0.5), loss (= logloss).
- `language_model`: batches `(x, y)` of int64 token ids, both (B, T), y the
  next tokens (-100: not counted, as torch and Hugging Face do); loss =
  next-token cross-entropy over every counted token; metrics perplexity
  (primary), token_accuracy, loss (nats per token).
- `package.module:factory`: `factory(**task.kwargs)` returns a `Task` (a
  subclass, or any object with a `loss(model, batch)`; the other attributes
  it lacks take `Task`'s defaults).

Metrics are reduced from additive sums over the whole test set
(`eval_sums` per batch, summed, then `reduce`): never a mean of batch means.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetps.runconfig.factories import FactoryError, load_factory
from hetps.runconfig.schema import RunConfig


class TaskError(ValueError):
    """A task that cannot be built or breaks the contract; one line naming task.name."""


@dataclass(frozen=True)
class Metric:
    """An evaluation metric and its direction."""

    name: str  # e.g. "accuracy", "perplexity", "r2", "loss"
    higher_is_better: bool


LOSS = Metric("loss", False)


def move(batch: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """`batch` with every tensor in it (nested tuples, lists, dicts) on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return type(batch)({k: move(v, device, non_blocking) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(move(v, device, non_blocking) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(move(v, device, non_blocking) for v in batch)
    return batch


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor found in `batch` (depth first; dict values in order)."""
    if isinstance(batch, torch.Tensor):
        return batch
    items = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(items, (tuple, list)) or isinstance(batch, Mapping):
        for item in items:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def pin(batch: Any) -> Any:
    """`batch` with its CPU tensors in page-locked memory (faster, asynchronous copies to a GPU)."""
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory() if batch.device.type == "cpu" else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: pin(v) for k, v in batch.items()})
    if isinstance(batch, (tuple, list)):
        return type(batch)(pin(v) for v in batch)
    return batch


class Task:
    """A training task: the loss of a batch, the evaluation metrics, the
    batch's sample count, and how batches are collated and moved. Subclass it
    (or return any object with these attributes from a factory: missing
    methods take the defaults).

    `metrics[0]` is the primary metric (watched unless the config names
    another); "loss" is always among them. The defaults evaluate the mean of
    `loss` over the test set's samples."""

    name: str = "task"
    metrics: tuple[Metric, ...] = (LOSS,)
    num_classes: int | None = None  # classification only: enables the chance-level divergence rule

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The training loss of `batch`: a scalar tensor, mean over the batch."""
        raise NotImplementedError("a task must define loss(model, batch)")

    def batch_size(self, batch: Any) -> int:
        """Samples in `batch`: by default the length of the first tensor in it."""
        t = first_tensor(batch)
        if t is None or t.dim() == 0:
            raise TaskError(f"task {self.name!r}: cannot tell the batch size: define batch_size")
        return len(t)

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, float]:
        """Additive sums over one test batch (summed over every batch, then `reduce`d):
        numbers, or tensors added element by element (e.g. histograms)."""
        n = self.batch_size(batch)
        return {"loss_sum": float(self.loss(model, batch)) * n, "n": n}

    def reduce(self, sums: dict[str, float]) -> dict[str, float]:
        """Metric name -> value, from the sums over the whole test set."""
        return {"loss": sums["loss_sum"] / max(sums["n"], 1)}

    def collate(self, samples: list) -> Any:
        """A batch from a list of dataset items."""
        return torch.utils.data.default_collate(samples)

    def to_device(self, batch: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
        """`batch` moved to `device` (every tensor of nested tuples, lists, dicts)."""
        return move(batch, device, non_blocking)

    def metric(self, name: str) -> Metric | None:
        """The metric called `name`, or None."""
        return next((m for m in self.metrics if m.name == name), None)


def _pair(task: Task, batch: Any) -> tuple[Any, Any]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TaskError(
            f"task {task.name!r}: a batch must be (x, y), got {type(batch).__name__}; "
            "make the dataset yield (x, y) pairs or use a task of your own (task.name: "
            "package.module:factory)"
        )
    return batch[0], batch[1]


class Classification(Task):
    """Cross-entropy over class logits (B, num_classes); accuracy, mean test loss."""

    name = "classification"
    metrics = (Metric("accuracy", True), LOSS)

    def __init__(self, num_classes: int | None = None):
        self.num_classes = num_classes

    def loss(self, model, batch):
        x, y = _pair(self, batch)
        return F.cross_entropy(model(x).float(), y)

    def eval_sums(self, model, batch):
        x, y = _pair(self, batch)
        logits = model(x).float()
        return {
            "correct": int((logits.argmax(1) == y).sum()),
            "loss_sum": float(F.cross_entropy(logits, y, reduction="sum")),
            "n": len(y),
        }

    def reduce(self, sums):
        n = max(sums["n"], 1)
        return {"accuracy": sums["correct"] / n, "loss": sums["loss_sum"] / n}


def _predictions(model: nn.Module, x: Any, y: torch.Tensor) -> torch.Tensor:
    """model(x) shaped as y: a trailing dimension of 1 is dropped (a (B, 1) head for (B,) targets)."""
    pred = model(x).float()
    if pred.dim() == y.dim() + 1 and pred.shape[-1] == 1:
        pred = pred.squeeze(-1)
    return pred


class Regression(Task):
    """Mean squared error against float targets; R² (pooled over every
    target value), MSE, MAE; loss = MSE."""

    name = "regression"
    metrics = (Metric("r2", True), Metric("mse", False), Metric("mae", False), LOSS)

    def loss(self, model, batch):
        x, y = _pair(self, batch)
        y = y.float()
        return F.mse_loss(_predictions(model, x, y), y)

    def eval_sums(self, model, batch):
        x, y = _pair(self, batch)
        y = y.double()
        err = _predictions(model, x, y).double() - y
        return {
            "n": y.numel(),
            "sum_y": float(y.sum()),
            "sum_y2": float((y * y).sum()),
            "sse": float((err * err).sum()),
            "sae": float(err.abs().sum()),
        }

    def reduce(self, sums):
        n = max(sums["n"], 1)
        mse = sums["sse"] / n
        # total sum of squares around the test set's mean
        sst = sums["sum_y2"] - sums["sum_y"] ** 2 / n
        # constant targets: R² is undefined; 1 for a perfect fit, else 0 (as scikit-learn's
        # r2_score), so a test batch of equal targets is not a non-finite metric
        r2 = 1.0 - sums["sse"] / sst if sst > 0 else (1.0 if sums["sse"] == 0 else 0.0)
        return {"r2": r2, "mse": mse, "mae": sums["sae"] / n, "loss": mse}


AUC_BINS = 4096  # equal-width bins of predicted probability over [0, 1]


def _auc(pos: torch.Tensor, neg: torch.Tensor) -> float:
    """The area under the ROC curve from histograms (ascending bins) of the
    positives' and the negatives' predicted probabilities: the chance that a
    positive scores above a negative, a pair within one bin counting half (the
    trapezoid rule). 0.5 when either class is absent."""
    pos, neg = pos.double(), neg.double()
    total_pos, total_neg = float(pos.sum()), float(neg.sum())
    if total_pos <= 0 or total_neg <= 0:
        return 0.5
    neg_below = torch.cumsum(neg, 0) - neg
    return float((pos * (neg_below + 0.5 * neg)).sum()) / (total_pos * total_neg)


class Binary(Task):
    """Binary classification from one logit per label (click-through rate and
    the like): y float labels in {0, 1} of any shape, model(x) logits of the
    same number of values (a trailing dimension of 1 is dropped); loss = binary
    cross-entropy with logits, mean over the labels.

    Metrics: `auc` (primary, higher is better), `logloss` (mean binary
    cross-entropy, lower), `accuracy` (a probability of at least 0.5 predicts
    1) and `loss` (= logloss). AUC is reduced from two histograms of the
    predicted probabilities, of the positives and of the negatives, in 4096
    equal bins over [0, 1], summed over the whole test set: it is exact up to
    the bin width (pairs within one bin count half), as TensorFlow's streaming
    AUC with num_thresholds. A test set with one class only has no AUC; it is
    reported as 0.5 (chance), so that a check on one batch still gets a finite
    value. Labels between 0 and 1 count as that fraction of a positive."""

    name = "binary"
    metrics = (Metric("auc", True), Metric("logloss", False), Metric("accuracy", True), LOSS)

    def _logits(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _pair(self, batch)
        y = y.float()
        logits = _predictions(model, x, y)
        if logits.shape != y.shape:
            if logits.numel() != y.numel():
                raise TaskError(
                    f"task {self.name!r}: the model gives {tuple(logits.shape)} logits for "
                    f"labels of shape {tuple(y.shape)}; it must give one logit per label"
                )
            logits = logits.reshape(y.shape)
        return logits, y

    def loss(self, model, batch):
        logits, y = self._logits(model, batch)
        return F.binary_cross_entropy_with_logits(logits, y)

    def eval_sums(self, model, batch):
        logits, y = self._logits(model, batch)
        logits, y = logits.reshape(-1).double(), y.reshape(-1).double()
        bins = (torch.sigmoid(logits) * AUC_BINS).long().clamp_(0, AUC_BINS - 1)
        return {
            "n": y.numel(),
            "bce_sum": float(F.binary_cross_entropy_with_logits(logits, y, reduction="sum")),
            "correct": int(((logits >= 0) == (y >= 0.5)).sum()),
            # tensors of counts: added bin by bin over the test set
            "pos_hist": torch.bincount(bins, weights=y, minlength=AUC_BINS),
            "neg_hist": torch.bincount(bins, weights=1 - y, minlength=AUC_BINS),
        }

    def reduce(self, sums):
        n = max(sums["n"], 1)
        logloss = sums["bce_sum"] / n
        return {
            "auc": _auc(sums["pos_hist"], sums["neg_hist"]),
            "logloss": logloss,
            "accuracy": sums["correct"] / n,
            "loss": logloss,
        }


IGNORE = -100  # target id not counted (torch's and Hugging Face's ignore_index)


class LanguageModel(Task):
    """Next-token cross-entropy: x and y int64 (B, T), model(x) logits
    (B, T, vocab); perplexity = exp(total nll / total tokens), token accuracy,
    loss in nats per token. Targets equal to -100 are not counted."""

    name = "language_model"
    metrics = (Metric("perplexity", False), Metric("token_accuracy", True), LOSS)

    def _logits(self, model, batch):
        x, y = _pair(self, batch)
        logits = model(x).float()
        if logits.dim() != y.dim() + 1 or logits.shape[:-1] != y.shape:
            raise TaskError(
                f"task {self.name!r}: the model gives logits of shape {tuple(logits.shape)} for "
                f"targets of shape {tuple(y.shape)}; it must give (B, T, vocab) for (B, T)"
            )
        return logits.reshape(-1, logits.shape[-1]), y.reshape(-1)

    def loss(self, model, batch):
        logits, y = self._logits(model, batch)
        return F.cross_entropy(logits, y, ignore_index=IGNORE)

    def batch_size(self, batch):
        return len(_pair(self, batch)[0])

    def eval_sums(self, model, batch):
        logits, y = self._logits(model, batch)
        counted = y != IGNORE
        return {
            "nll": float(F.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum")),
            "tokens": int(counted.sum()),
            "correct": int(((logits.argmax(-1) == y) & counted).sum()),
        }

    def reduce(self, sums):
        tokens = max(sums["tokens"], 1)
        loss = sums["nll"] / tokens
        return {
            "perplexity": math.exp(loss) if loss < 700 else math.inf,
            "token_accuracy": sums["correct"] / tokens,
            "loss": loss,
        }


BUILTIN = {
    "classification": Classification,
    "regression": Regression,
    "binary": Binary,
    "language_model": LanguageModel,
}

# what a factory's object may define; the rest comes from Task
ATTRIBUTES = ("name", "metrics", "num_classes")
METHODS = ("loss", "batch_size", "eval_sums", "reduce", "collate", "to_device")


class _Adapted(Task):
    """Any object with a `loss(model, batch)` seen as a Task: what it defines, else Task's defaults."""

    def __init__(self, obj: Any, name: str):
        self.obj = obj
        self.name = getattr(obj, "name", None) or name
        self.metrics = tuple(getattr(obj, "metrics", None) or Task.metrics)
        self.num_classes = getattr(obj, "num_classes", None)
        for method in METHODS:
            if callable(getattr(obj, method, None)):
                setattr(self, method, getattr(obj, method))


def _metrics(value: Any, where: str) -> tuple[Metric, ...]:
    """A task's metrics as Metric records: Metric, or (name, higher_is_better)."""
    out = []
    for m in value:
        if isinstance(m, Metric):
            out.append(m)
        elif isinstance(m, (tuple, list)) and len(m) == 2 and isinstance(m[0], str):
            out.append(Metric(m[0], bool(m[1])))
        else:
            raise TaskError(
                f"{where}: metrics must be Metric(name, higher_is_better) records, got {m!r}"
            )
    if not out:
        raise TaskError(f"{where}: metrics is empty; list at least Metric('loss', False)")
    if "loss" not in [m.name for m in out]:
        raise TaskError(
            f"{where}: metrics must include Metric('loss', False) (the divergence guard watches "
            f"it), got {[m.name for m in out]}"
        )
    return tuple(out)


def load_task(cfg: RunConfig, num_classes: int | None = None) -> Task:
    """The configured task (`task.name`, `task.kwargs`). `num_classes`: the
    dataset's class count, for classification (`data.num_classes` wins).
    Raises TaskError in one line naming task.name."""
    name, kwargs = cfg.task.name, dict(cfg.task.kwargs)
    if name in BUILTIN:
        if kwargs:
            raise TaskError(
                f"task.kwargs: only for a package.module:factory task (task.name is {name!r})"
            )
        if name == "classification":
            return Classification(cfg.data.num_classes or num_classes)
        return BUILTIN[name]()
    where = f"task.name {name!r}"
    try:
        factory = load_factory(name, "task.name")
    except FactoryError as exc:
        raise TaskError(f"{where}: cannot load the factory ({exc.reason})") from None
    try:
        made = factory(**kwargs)
    except TypeError as exc:
        raise TaskError(f"{where}: calling it with task.kwargs {kwargs} fails ({exc})") from None
    return as_task(made, where, name.partition(":")[2])


def as_task(made: Any, where: str = "task", default_name: str = "task") -> Task:
    """A Task from a Task (checked) or any object with `loss` (adapted).
    Raises TaskError naming what is missing."""
    if isinstance(made, type) and issubclass(made, Task):
        raise TaskError(f"{where}: returned the class {made.__name__}, not an instance; call it")
    if not callable(getattr(made, "loss", None)):
        raise TaskError(
            f"{where}: returned {type(made).__name__}, which has no loss(model, batch); return a "
            "hetps.training.task.Task or an object with loss(model, batch)"
        )
    if isinstance(made, Task):
        if type(made).loss is Task.loss:
            raise TaskError(f"{where}: {type(made).__name__} does not define loss(model, batch)")
        task = made
        if task.name == "task" and default_name != "task":
            task.name = default_name
    else:
        task = _Adapted(made, default_name)
    task.metrics = _metrics(task.metrics, where)
    classes = task.num_classes
    if classes is not None and (isinstance(classes, bool) or not isinstance(classes, int)):
        raise TaskError(f"{where}: num_classes must be an int or None, got {classes!r}")
    return task


def watched_metric(cfg: RunConfig, task: Task) -> Metric:
    """The metric an evaluation is judged by (best model, progress line, plots):
    `eval.metric` when set, else the stop target's metric (`stop.target.metric`,
    or accuracy for the `stop.target_accuracy` shorthand), else the task's
    primary metric (metrics[0]). Raises TaskError when the named metric is not
    the task's."""
    name, key = getattr(cfg.eval, "metric", None), "eval.metric"
    target = getattr(cfg.stop, "target", None)
    if name is None and target is not None:
        name, key = target.metric, "stop.target.metric"
    if name is None and cfg.stop.target_accuracy is not None and task.metric("accuracy"):
        name = "accuracy"  # stop.target_accuracy: the classification shorthand
    if name is None:
        return task.metrics[0]
    found = task.metric(name)
    if found is None:
        raise TaskError(
            f"{key}: task {task.name!r} has no metric {name!r}; its metrics: "
            f"{', '.join(m.name for m in task.metrics)}"
        )
    return found


def evaluate_task(
    task: Task, model: nn.Module, batches, device: torch.device | str
) -> dict[str, float]:
    """Every metric of `task` over `batches` (an iterable of collated batches):
    the task's sums added over every batch, then reduced."""
    model.eval()
    sums: dict[str, float] = {}
    with torch.no_grad():
        for batch in batches:
            for key, value in task.eval_sums(model, task.to_device(batch, device)).items():
                sums[key] = sums.get(key, 0) + value
    if not sums:
        raise TaskError(f"task {task.name!r}: the test set gave no batch to evaluate")
    return {k: float(v) for k, v in task.reduce(sums).items()}
