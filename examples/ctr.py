"""Click-through-rate prediction on a synthetic click log with a planted model: a
DLRM-style network (one embedding table per categorical field, their pairwise dot
products, an MLP) learns to predict clicks whose true probabilities are known.

The log is generated at load time from `seed`, the same in every process (nothing is
read or downloaded): `fields` categorical fields, field f with `vocab[f]` ids drawn from
a power law truncated to the vocabulary (P(id = i) proportional to (i + 1) ** -exponent:
id 0 is the most frequent, as in real click logs, where a few ads, sites and users make
most impressions and most ids are rare). The planted model gives every (field, id) a
weight and a `true_dim`-dimensional embedding, normal with a standard deviation that
fades from the frequent ids to the rare ones (`planted_scale`: rare ids, which no log of
this size can teach, carry little signal, so that a model can come near the planted one;
real logs behave alike: what a rare ad adds is little and unknowable), and the true logit
of an impression is

    bias + sum_f weight_f[id_f] + strength * sum_{f < g} <emb_f[id_f], emb_g[id_g]>

with the bias set so that `click_rate` of the training impressions are clicks; a label is
1 with probability sigmoid(true logit). Because labels are drawn, not decided, no model
can beat the true probabilities: their AUC and log loss on the test split are the best
achievable, `planted_metrics()` (and `test.best`). With the defaults (200,000 training
and 50,000 test impressions, 8 fields of 100,000 down to 100 ids, seed 0) they are
AUC 0.8664 and log loss 0.3772 (click rate 0.248); predicting the click rate alone
scores AUC 0.5 and log loss 0.56. A plain torch loop (the DLRM of configs/ctr.yaml,
dim 16; Adagrad lr 0.05 on the tables, Adam lr 0.001 on the MLP, batch 256) reaches
AUC 0.861 after one epoch (0.006 below the planted model) and then slowly overfits
(0.855 after four). Generating the default log takes about a second.

    task: binary
    model: {name: hetps.examples.ctr:dlrm}
    data: {dataset: hetps.examples.ctr:datasets}

The model's tables are `tables.0` ... `tables.7` (nn.EmbeddingBag, mode sum): the names
`sparse.tables` takes (configs/ctr.yaml).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

VOCAB = (100000, 50000, 20000, 10000, 5000, 1000, 500, 100)


class ClickLog(TensorDataset):
    """(ids (fields,) int64, click () float 0/1) impressions; `prob`: each one's true
    click probability; `best`: the planted model's metrics on this split ({"auc": ...,
    "logloss": ..., "click_rate": ...})."""

    def __init__(
        self, ids: torch.Tensor, clicks: torch.Tensor, prob: torch.Tensor, best: dict[str, float]
    ):
        super().__init__(ids, clicks)
        self.prob = prob
        self.best = best


def planted_scale(vocab: int, fade: float) -> torch.Tensor:
    """The planted parameters' standard deviation of each id, 1 for id 0 fading as
    1 / sqrt(1 + id / fade): rare ids, which no finite log can teach, carry less signal."""
    return (1.0 + torch.arange(vocab, dtype=torch.float64) / fade).rsqrt()


def power_law_ids(n: int, vocab: int, exponent: float, g: torch.Generator) -> torch.Tensor:
    """`n` ids in [0, vocab) with P(i) proportional to (i + 1) ** -exponent (inverse CDF)."""
    weights = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-exponent)
    cdf = torch.cumsum(weights, 0)
    cdf /= cdf[-1].clone()
    u = torch.rand(n, generator=g, dtype=torch.float64)
    return torch.searchsorted(cdf, u).clamp_(max=vocab - 1)


def auc_of(p: torch.Tensor, y: torch.Tensor) -> float:
    """The exact AUC of scores `p` for labels `y` (rank statistic; ties share their rank)."""
    values, inverse, counts = torch.unique(p.double(), return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts  # rank - 1 of each distinct value's first copy
    ranks = (first + (counts + 1) / 2.0)[inverse]
    pos = float(y.sum())
    neg = len(y) - pos
    if pos == 0 or neg == 0:
        return 0.5
    return (float(ranks[y > 0.5].sum()) - pos * (pos + 1) / 2) / (pos * neg)


@functools.lru_cache(maxsize=4)
def _generate(
    train_size: int,
    test_size: int,
    vocab: tuple[int, ...],
    exponent: float,
    true_dim: int,
    weight_std: float,
    strength: float,
    fade: float,
    click_rate: float,
    seed: int,
):
    g = torch.Generator().manual_seed(seed)
    n = train_size + test_size
    ids = torch.stack([power_law_ids(n, v, exponent, g) for v in vocab], dim=1)
    logit = torch.zeros(n, dtype=torch.float64)
    pooled = torch.zeros(n, true_dim, dtype=torch.float64)
    square = torch.zeros(n, dtype=torch.float64)
    for f, v in enumerate(vocab):
        scale = planted_scale(v, fade)
        weight = torch.randn(v, generator=g, dtype=torch.float64) * scale * weight_std
        emb = torch.randn(v, true_dim, generator=g, dtype=torch.float64) * scale[:, None]
        logit += weight[ids[:, f]]
        e = emb[ids[:, f]]
        pooled += e
        square += (e * e).sum(1)
    # sum over pairs f < g of <e_f, e_g> = (|sum e|^2 - sum |e|^2) / 2
    logit += strength * ((pooled * pooled).sum(1) - square) / 2
    logit += _bias(logit[:train_size], click_rate)
    prob = torch.sigmoid(logit)
    clicks = (torch.rand(n, generator=g, dtype=torch.float64) < prob).float()
    splits = []
    for part in (slice(0, train_size), slice(train_size, n)):
        p, y = prob[part], clicks[part]
        best = {
            "auc": auc_of(p, y),
            "logloss": float(F.binary_cross_entropy(p, y.double())),
            "click_rate": float(y.mean()),
        }
        splits.append(ClickLog(ids[part].contiguous(), y.contiguous(), p.contiguous(), best))
    return tuple(splits)


def _bias(logit: torch.Tensor, click_rate: float) -> float:
    """The bias b with mean(sigmoid(logit + b)) = click_rate (Newton's method: the mean is
    increasing and smooth in b; a few steps from the logit of the rate)."""
    b = math.log(click_rate / (1 - click_rate)) - float(logit.mean())
    for _ in range(20):
        p = torch.sigmoid(logit + b)
        miss = float(p.mean()) - click_rate
        if abs(miss) < 1e-9:
            break
        b -= miss / max(float((p * (1 - p)).mean()), 1e-12)
    return b


def datasets(
    train_size: int = 200000,
    test_size: int = 50000,
    vocab: Sequence[int] = VOCAB,
    exponent: float = 1.6,
    true_dim: int = 4,
    weight_std: float = 1.0,
    strength: float = 0.08,
    fade: float = 1.0,
    click_rate: float = 0.25,
    seed: int = 0,
) -> tuple[ClickLog, ClickLog]:
    """(train, test) click logs generated from `seed` (the same in every process): items
    (ids (len(vocab),) int64, click () float). Each split's `best` holds the planted
    model's AUC and log loss on it (the best any model can score)."""
    if not vocab or any(int(v) < 1 for v in vocab):
        raise ValueError(f"vocab: every field needs at least one id, got {list(vocab)}")
    if train_size < 1 or test_size < 1:
        raise ValueError(
            f"train_size and test_size must be positive, got {train_size}, {test_size}"
        )
    if not 0 < click_rate < 1:
        raise ValueError(f"click_rate must be in (0, 1), got {click_rate}")
    return _generate(
        int(train_size),
        int(test_size),
        tuple(int(v) for v in vocab),
        float(exponent),
        int(true_dim),
        float(weight_std),
        float(strength),
        float(fade),
        float(click_rate),
        int(seed),
    )


def planted_metrics(**kwargs) -> dict[str, float]:
    """The planted model's AUC, log loss and click rate on the test split of
    `datasets(**kwargs)`: the best a model can reach on that data."""
    return dict(datasets(**kwargs)[1].best)


class DLRM(nn.Module):
    """One nn.EmbeddingBag (mode sum) per field, `tables.<f>`; the pooled vectors and
    their pairwise dot products go through an MLP to one logit: (B, 1) for ids (B, fields)."""

    def __init__(self, vocab: Sequence[int], dim: int, mlp: Sequence[int]):
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(int(v), dim, mode="sum") for v in vocab)
        for table in self.tables:
            nn.init.normal_(table.weight, 0.0, 0.01)
        fields = len(vocab)
        self.pairs = torch.triu_indices(fields, fields, offset=1)
        width = fields * dim + self.pairs.shape[1]
        layers: list[nn.Module] = []
        for hidden in mlp:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b = ids.shape[0]
        offsets = torch.arange(b, device=ids.device)  # one id per sample per field
        pooled = torch.stack(
            [table(ids[:, f].contiguous(), offsets) for f, table in enumerate(self.tables)], 1
        )  # (B, fields, dim)
        dots = torch.bmm(pooled, pooled.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.mlp(torch.cat([pooled.flatten(1), dots], 1))


def dlrm(vocab: Sequence[int] = VOCAB, dim: int = 16, mlp: Sequence[int] = (64, 32)) -> DLRM:
    """The model factory (model.kwargs are its arguments; `vocab` must match the data's)."""
    return DLRM(vocab, dim, mlp)
