"""A task of your own, end to end: a small 1-D CNN tells noisy sine waves apart by their
frequency, watched on macro-F1 (a metric no mean of batch values gives: a confusion matrix
summed over the whole test split, `eval_sums` returning a tensor), with a warm-up and
cosine lr schedule of its own. docs/own-model.md walks through it; configs/sines.yaml runs it.

    hetps run configs/sines.yaml
    hetps.run("configs/sines.yaml", on_eval=lambda row: print(row["macro_f1"], row["lr"]))

The data is generated, never downloaded: each example is 64 samples of
`amplitude * sin(2 pi f t / 64 + phase) + noise`, its class the frequency f (2, 3, 4 or 5
cycles per window), amplitude in [0.5, 1.5], phase uniform, Gaussian noise of standard
deviation `noise`; the classes are imbalanced (40/30/20/10 %), so accuracy flatters a model
that neglects the rare class and macro-F1 does not. A fixed seed (not the run's `seed`)
draws it, so every worker, the evaluator and a later `hetps.load_model` see the same splits.

    task: {name: hetps.examples.sines:task}
    model: {name: hetps.examples.sines:cnn}
    data: {dataset: hetps.examples.sines:datasets}
    optimizer: {schedule: {name: hetps.examples.sines:warmup_cosine}}
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from hetps.training.task import Metric, Task

LENGTH = 64  # samples per wave
FREQUENCIES = (2, 3, 4, 5)  # cycles per window, one class each
SHARES = (0.4, 0.3, 0.2, 0.1)  # of the examples in each class
DATA_SEED = 4321


class Waves(TensorDataset):
    """(x (1, LENGTH) float32, y int class) pairs; `num_classes` tells hetps the class count."""

    num_classes = len(FREQUENCIES)


def waves(n: int, noise: float, generator: torch.Generator) -> Waves:
    """`n` noisy waves, classes drawn with SHARES."""
    y = torch.multinomial(torch.tensor(SHARES), n, replacement=True, generator=generator)
    freq = torch.tensor(FREQUENCIES, dtype=torch.float32)[y]
    amplitude = 0.5 + torch.rand(n, generator=generator)
    phase = 2 * math.pi * torch.rand(n, generator=generator)
    t = torch.arange(LENGTH, dtype=torch.float32)
    x = amplitude[:, None] * torch.sin(2 * math.pi * freq[:, None] * t / LENGTH + phase[:, None])
    x = x + noise * torch.randn(n, LENGTH, generator=generator)
    return Waves(x[:, None, :], y)


def datasets(train_size: int = 4000, test_size: int = 1000, noise: float = 0.7):
    """(train, test): the same waves in every process (DATA_SEED)."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    return waves(train_size, noise, generator), waves(test_size, noise, generator)


def cnn(input_shape: tuple = (1, LENGTH), num_classes: int = len(FREQUENCIES), width: int = 16):
    """Two convolutions, global average pooling, a linear head: (B, 1, L) -> (B, classes)."""
    return nn.Sequential(
        nn.Conv1d(input_shape[0], width, 9, padding=4),
        nn.ReLU(),
        nn.MaxPool1d(2),
        nn.Conv1d(width, width, 5, padding=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool1d(1),
        nn.Flatten(),
        nn.Linear(width, num_classes),
    )


class MacroF1(Task):
    """Cross-entropy training; macro-F1 (primary: the mean of the classes' F1 scores),
    accuracy and the mean test loss, all from sums over the whole test split."""

    name = "macro_f1"
    metrics = (Metric("macro_f1", True), Metric("accuracy", True), Metric("loss", False))

    def __init__(self, num_classes: int = len(FREQUENCIES)):
        self.num_classes = num_classes  # also enables the divergence guard's chance-level rule

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    def eval_sums(self, model, batch):
        x, y = batch
        logits = model(x).float()
        c = self.num_classes
        # confusion[true, predicted]: a tensor, added element by element over every batch
        confusion = torch.bincount(y * c + logits.argmax(1), minlength=c * c).reshape(c, c)
        return {
            "confusion": confusion,
            "loss_sum": float(F.cross_entropy(logits, y, reduction="sum")),
            "n": len(y),
        }

    def reduce(self, sums):
        m = sums["confusion"].double()
        tp = m.diag()
        f1 = 2 * tp / (m.sum(0) + m.sum(1)).clamp(min=1)  # 2 TP / (predicted + true) per class
        n = max(sums["n"], 1)
        return {
            "macro_f1": float(f1.mean()),
            "accuracy": float(tp.sum()) / n,
            "loss": sums["loss_sum"] / n,
        }


def task(num_classes: int = len(FREQUENCIES)) -> MacroF1:
    return MacroF1(num_classes)


def warmup_cosine(optimizer, total_steps: int, warmup_steps: int = 0, floor: float = 0.0):
    """A torch LR scheduler: the lr rises linearly over `warmup_steps` updates, then falls
    along a half cosine to `floor` times the base lr at `total_steps` (and stays there).
    The shards step it once per update; `optimizer.schedule.kwargs` gives the arguments."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        done = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
