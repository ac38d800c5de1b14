"""The model and data of the sparse-table benchmarks (bench/sparse.py) and the
big-table test (tests/cluster/test_cluster_sparse_big.py): a DLRM-like
classifier, one `nn.EmbeddingBag` table of `rows` x `dim` (mode sum) under a
small MLP, on bags of ids with a planted label. Daemons import it by name, so
whoever starts them puts this folder on PYTHONPATH:

    model: {name: sparse_model:dlrm, kwargs: {rows: 1000000, dim: 32}}
    data: {dataset: sparse_model:clicks, kwargs: {rows: 1000000}}

Ids are drawn from a truncated power law, P(id = i) roughly proportional to
1 / (i + 1) (log-uniform: id 0 most frequent, most ids rare, as in click
logs), drawn without building a table of `rows` weights, so a 10^7-row
vocabulary costs the data nothing. Each id carries a planted sign (a hash
of the id); a sample's label is 1 when the signs of its `bag` ids (odd: no
ties) sum above zero. The table must learn the signs of the ids it sees, so
the loss falls as the frequent rows train.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

TABLE = "table"  # the embedding's module name: `sparse.tables=[table]`


class DLRM(nn.Module):
    """EmbeddingBag(rows, dim, sum) -> Linear(dim, hidden) -> ReLU -> Linear(hidden, classes)."""

    def __init__(self, num_classes: int, rows: int, dim: int, hidden: int, meta: bool):
        super().__init__()
        # meta: the table holds no memory until `sparse.install` swaps it for rows on the shards
        device = torch.device("meta") if meta else None
        self.table = nn.EmbeddingBag(rows, dim, mode="sum", device=device)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.table(ids))


def dlrm(
    input_shape, num_classes, rows: int = 100000, dim: int = 32, hidden: int = 64, meta=False
) -> DLRM:
    """The model factory (`model.name: sparse_model:dlrm`); `meta: true` builds the
    table on the meta device (only usable with the table served sparse)."""
    return DLRM(num_classes, rows, dim, hidden, meta)


def power_law_ids(shape: tuple[int, ...], rows: int, g: torch.Generator) -> torch.Tensor:
    """Ids in [0, rows), log-uniform: floor((rows + 1) ** u) - 1 for u uniform in [0, 1)."""
    u = torch.rand(shape, generator=g, dtype=torch.float64)
    return (torch.exp(u * math.log(rows + 1)) - 1).long().clamp_(0, rows - 1)


def planted_sign(ids: torch.Tensor) -> torch.Tensor:
    """+1 or -1 per id, from a multiplicative hash (the same in every process)."""
    return ((ids * 2654435761) >> 11 & 1) * 2 - 1


def split(n: int, rows: int, bag: int, g: torch.Generator) -> TensorDataset:
    ids = power_law_ids((n, bag), rows, g)
    labels = (planted_sign(ids).sum(1) > 0).long()
    return TensorDataset(ids, labels)


def clicks(
    rows: int = 100000, bag: int = 7, train_size: int = 65536, test_size: int = 4096, seed: int = 0
):
    """The dataset factory (`data.dataset: sparse_model:clicks`): (train, test) of
    ((bag,) int64 ids, class 0/1), generated from `seed` (nothing is read)."""
    if bag % 2 == 0:
        raise ValueError(
            f"data.kwargs.bag: must be odd (labels are a majority of signs), got {bag}"
        )
    g = torch.Generator().manual_seed(seed)
    train, test = split(train_size, rows, bag, g), split(test_size, rows, bag, g)
    train.num_classes = test.num_classes = 2
    return train, test


def status_kb(pid: int, key: str) -> int | None:
    """`key` (VmRSS, VmHWM) of a live process in kB, from /proc; None once it is gone.
    (bench/sparse.py and tests/cluster/test_cluster_sparse_big.py sample workers with it.)"""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None
