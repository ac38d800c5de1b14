"""The click-through-rate example (hetps.examples.ctr): the synthetic click log is the
same for the same seed (in another process too) and differs for another, its ids follow a
power law (id 0 the most frequent), its click rate is the one asked for, the planted
model's AUC is what `planted_metrics` reports and well above chance (the default log's
as the docstring and configs/ctr.yaml state it), and the DLRM model gives one logit per
impression from tables `sparse.tables` can name."""

from __future__ import annotations

import subprocess
import sys

import torch

from hetps.examples import ctr
from hetps.training.task import Binary, evaluate_task

SMALL = dict(train_size=20000, test_size=8000, vocab=(5000, 1000, 300, 50))


def digest(dataset) -> float:
    ids, clicks = dataset.tensors
    weights = torch.arange(1, ids.shape[1] + 1, dtype=torch.float64)
    return float(((ids.double() * weights).sum(1) * (clicks.double() + 1)).sum())


def test_the_same_seed_gives_the_same_log_in_another_process():
    train, test = ctr.datasets(**SMALL)
    code = (
        "from hetps.examples import ctr; import torch\n"
        f"tr, te = ctr.datasets(**{SMALL!r})\n"
        "print(repr(float(tr.tensors[0].double().sum())), repr(float(te.tensors[1].sum())))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == [
        repr(float(train.tensors[0].double().sum())),
        repr(float(test.tensors[1].sum())),
    ]
    ctr._generate.cache_clear()  # generated afresh, not the cached splits
    fresh = ctr.datasets(**SMALL)
    assert [digest(d) for d in fresh] == [digest(train), digest(test)]
    other = ctr.datasets(**SMALL, seed=1)
    assert digest(other[0]) != digest(train)


def test_items_ids_in_range_and_power_law_frequencies():
    train, test = ctr.datasets(**SMALL)
    assert len(train) == 20000 and len(test) == 8000
    ids, click = train[0]
    assert ids.dtype == torch.int64 and ids.shape == (4,) and click.dtype == torch.float32
    all_ids = train.tensors[0]
    for f, vocab in enumerate(SMALL["vocab"]):
        counts = torch.bincount(all_ids[:, f], minlength=vocab)
        assert len(counts) == vocab  # no id at or above the vocabulary
        assert int(counts.argmax()) == 0  # id 0 is the most frequent
        # a power law: the first tenth of the ids takes most of the impressions, and the
        # head is ordered (id 0 > id 1 > id 4 > id 20)
        assert counts[: max(vocab // 10, 1)].sum() > 0.6 * len(train)
        assert counts[0] > counts[1] > counts[4] > counts[20]


def test_click_rate_and_planted_auc():
    train, test = ctr.datasets(**SMALL)
    rate = float(train.tensors[1].mean())
    assert 0.23 < rate < 0.27, rate
    best = ctr.planted_metrics(**SMALL)
    assert best == test.best
    assert best["auc"] > 0.7, best
    assert 0.2 < best["click_rate"] < 0.3
    # the reported metrics are those of the true probabilities, measured as hetps measures
    # a model (the binary task's histogram AUC and its log loss)
    _, y = test.tensors
    logit = torch.logit(test.prob)
    measured = evaluate_task(Binary(), torch.nn.Identity(), [(logit, y)], "cpu")
    assert abs(measured["auc"] - best["auc"]) < 1e-3, (measured, best)
    assert abs(measured["logloss"] - best["logloss"]) < 1e-6, (measured, best)
    # and auc_of is the pairwise count of a positive above a negative (ties half: impressions
    # of the same ids share a probability)
    pos, neg = test.prob[y == 1][:400], test.prob[y == 0][:400]
    y_pairs = torch.cat([torch.ones(len(pos)), torch.zeros(len(neg))])
    above = (pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()
    pairs = float(above.mean())
    assert abs(ctr.auc_of(torch.cat([pos, neg]), y_pairs) - pairs) < 1e-9


def test_the_default_log_is_generated_quickly_and_reports_its_planted_metrics():
    import time

    ctr._generate.cache_clear()
    start = time.perf_counter()
    train, test = ctr.datasets()
    took = time.perf_counter() - start
    assert took < 15.0, took  # about 1 s alone; a loaded 2-core machine takes up to 4
    assert (len(train), len(test)) == (200000, 50000)
    assert test.best == ctr.planted_metrics()
    # the numbers the module's docstring and configs/ctr.yaml state
    assert round(test.best["auc"], 4) == 0.8664, test.best
    assert round(test.best["logloss"], 4) == 0.3772, test.best
    assert round(test.best["click_rate"], 3) == 0.248, test.best


def test_the_shipped_config_targets_the_planted_auc_less_001():
    """configs/ctr.yaml stops at planted - 0.01, rounded down to 3 decimals: a target the
    example reaches (tests/cluster/test_examples.py) only near the best achievable."""
    import math
    from pathlib import Path

    import yaml

    config = yaml.safe_load((Path(__file__).parents[2] / "configs" / "ctr.yaml").read_text())
    planted = ctr.planted_metrics()["auc"]
    assert config["stop"]["target"] == {
        "metric": "auc",
        "value": math.floor((planted - 0.01) * 1000) / 1000,
    }, (config["stop"], planted)
    assert config["task"] == "binary" and config["sparse"]["min_rows"] == 1000


def test_dlrm_gives_one_logit_per_impression_and_names_its_tables():
    train, test = ctr.datasets(**SMALL)
    model = ctr.dlrm(vocab=SMALL["vocab"], dim=4, mlp=(8,))
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.EmbeddingBag)]
    assert names == ["tables.0", "tables.1", "tables.2", "tables.3"]
    x, y = test.tensors
    assert model(x[:32]).shape == (32, 1)
    metrics = evaluate_task(Binary(), model, [(x, y)], "cpu")
    assert 0.3 < metrics["auc"] < 0.7  # untrained: near chance
    loss = Binary().loss(model, (x[:64], y[:64]))
    loss.backward()
    assert model.tables[0].weight.grad is not None
