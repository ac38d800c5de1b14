"""A newcomer's own module and config (issue 42): a macro-F1 task (and two variants that put
accuracy first or lack it), a 1-D CNN, a schedule factory and a dataset factory in mytask.py,
named by sine.yaml beside it. Written into a temporary folder by
tests/unit/test_newcomer_checks.py and tests/cluster/test_cluster_newcomer.py."""

MYTASK = '''
"""A macro-F1 task, a model and a schedule factory, as a newcomer writes them."""
import torch
import torch.nn.functional as F
from torch import nn

from hetps.training.task import Metric, Task


class MacroF1(Task):
    metrics = (Metric("macro_f1", True), Metric("accuracy", True), Metric("loss", False))
    num_classes = 2

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    def eval_sums(self, model, batch):
        x, y = batch
        logits = model(x)
        hits = torch.zeros(2, 2)
        hits.index_put_((y, logits.argmax(1)), torch.ones(len(y)), accumulate=True)
        return {"loss_sum": float(F.cross_entropy(logits, y)) * len(y), "n": len(y), "hits": hits}

    def reduce(self, sums):
        hits = sums["hits"]
        f1 = 2 * hits.diag() / (hits.sum(0) + hits.sum(1)).clamp(min=1)
        return {
            "macro_f1": float(f1.mean()),
            "accuracy": float(hits.diag().sum() / hits.sum()),
            "loss": sums["loss_sum"] / sums["n"],
        }


class AccuracyFirst(MacroF1):
    metrics = (Metric("accuracy", True), Metric("macro_f1", True), Metric("loss", False))


class NoAccuracy(MacroF1):
    metrics = (Metric("macro_f1", True), Metric("loss", False))


class Conv1DNet(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.conv = nn.Conv1d(input_shape[0], 4, 3, padding=1)
        self.emb = nn.Embedding(8, 4)
        self.fc = nn.Linear(4 * input_shape[1], num_classes)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)).flatten(1))


def cosine(optimizer, t_max):
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=t_max)


def waves(length=8):
    x = torch.randn(64, 1, length)
    y = (x.mean(-1).squeeze(1) > 0).long()
    return torch.utils.data.TensorDataset(x, y), torch.utils.data.TensorDataset(x[:32], y[:32])
'''

SINE_YAML = """
task: mytask:MacroF1
model: {name: mytask:Conv1DNet}
data: {dataset: synthetic, synthetic: {classes: 2, shape: [1, 8], train_size: 64, test_size: 32}}
cluster: {shards: 1, workers: 2}
"""
