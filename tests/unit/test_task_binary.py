"""The `binary` task (worker/task.py): AUC from histograms of predicted probabilities
equals the exact AUC (all positive-negative pairs, ties half) within the bin width, sums
over uneven batches reduce to the same metrics as one batch, logloss is torch's binary
cross-entropy, and a config naming the task watches auc."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetps.runconfig.load import load_config
from hetps.training.preflight import check_metrics
from hetps.training.task import Binary, TaskError, evaluate_task, load_task, watched_metric


class Scores(nn.Module):
    """A model that returns its input as the logit: the scores under test are the data."""

    def forward(self, x):
        return x


def exact_auc(p: torch.Tensor, y: torch.Tensor) -> float:
    """The chance that a positive scores above a negative (ties half), by sorting."""
    order = torch.argsort(p)
    p, y = p[order].double(), y[order].double()
    ranks = torch.empty_like(p)
    ranks[:] = torch.arange(1, len(p) + 1, dtype=torch.float64)
    # equal scores share their mean rank
    values, inverse, counts = torch.unique(p, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(values), dtype=torch.float64).index_add_(0, inverse, ranks)
    ranks = (sums / counts)[inverse]
    pos = float(y.sum())
    neg = len(y) - pos
    return (float(ranks[y == 1].sum()) - pos * (pos + 1) / 2) / (pos * neg)


def random_scores(n: int, seed: int, separation: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, generator=g) < 0.3).float()
    logits = torch.randn(n, generator=g) * 1.5 + separation * (2 * y - 1)
    return logits, y


@pytest.mark.parametrize("seed,separation", [(0, 1.0), (1, 0.2), (2, 3.0), (3, 0.0)])
def test_auc_from_histograms_equals_the_exact_auc(seed, separation):
    logits, y = random_scores(20000, seed, separation)
    got = evaluate_task(Binary(), Scores(), [(logits, y)], "cpu")
    want = exact_auc(torch.sigmoid(logits), y)
    assert abs(got["auc"] - want) < 1e-3, (got["auc"], want)


def test_sums_over_uneven_batches_equal_one_batch():
    logits, y = random_scores(5003, seed=7)
    cuts = [0, 1, 17, 900, 2500, 5003]
    pieces = [(logits[a:b], y[a:b]) for a, b in zip(cuts, cuts[1:])]
    whole = evaluate_task(Binary(), Scores(), [(logits, y)], "cpu")
    split = evaluate_task(Binary(), Scores(), pieces, "cpu")
    assert split == pytest.approx(whole, rel=1e-12, abs=1e-12)
    assert whole["auc"] > 0.75  # separated scores: far from chance


def test_logloss_accuracy_and_loss_are_torchs():
    logits, y = random_scores(3000, seed=11)
    got = evaluate_task(Binary(), Scores(), [(logits, y)], "cpu")
    bce = float(F.binary_cross_entropy(torch.sigmoid(logits.double()), y.double()))
    assert got["logloss"] == pytest.approx(bce, rel=1e-9)
    assert got["loss"] == got["logloss"]
    assert got["accuracy"] == pytest.approx(float(((logits >= 0).float() == y).float().mean()))
    loss = Binary().loss(Scores(), (logits, y))
    assert float(loss) == pytest.approx(bce, rel=1e-5)


def test_a_trailing_logit_dimension_is_dropped_and_a_wrong_count_is_refused():
    logits, y = random_scores(64, seed=3)
    column = Binary().loss(Scores(), (logits.unsqueeze(1), y))  # (B, 1) logits, (B,) labels
    assert float(column) == pytest.approx(float(Binary().loss(Scores(), (logits, y))))
    with pytest.raises(TaskError, match="one logit per label"):
        Binary().loss(Scores(), (logits[:10], y))


def test_one_class_reports_chance_and_every_metric_is_finite():
    logits = torch.randn(32)
    for y in (torch.ones(32), torch.zeros(32)):
        got = evaluate_task(Binary(), Scores(), [(logits, y)], "cpu")
        assert got["auc"] == 0.5
        check_metrics(Binary(), Scores(), (logits, y), "scores")  # the dry step's check passes


def test_a_perfect_ranking_scores_one():
    y = torch.tensor([0.0, 0.0, 1.0, 1.0])
    logits = torch.tensor([-6.0, -3.0, 3.0, 6.0])
    assert evaluate_task(Binary(), Scores(), [(logits, y)], "cpu")["auc"] == 1.0


def test_a_config_with_task_binary_watches_auc_not_the_classification_default():
    cfg = load_config(None, ["task=binary"])
    task = load_task(cfg)
    assert isinstance(task, Binary)
    assert cfg.stop.target_accuracy is None  # the 0.95 accuracy default is classification's
    assert watched_metric(cfg, task).name == "auc"
    written = load_config(None, ["task=binary", "stop.target_accuracy=0.8"])
    assert watched_metric(written, task).name == "accuracy"  # written: the shorthand holds
    target = load_config(None, ["task=binary", "stop.target.metric=auc", "stop.target.value=0.7"])
    assert (target.stop.target.metric, target.stop.target.value) == ("auc", 0.7)
