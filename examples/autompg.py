"""A regression on real tabular data: the miles per gallon of 392 cars of 1970-82 from
their cylinders, displacement, horsepower, weight, acceleration, model year and origin
(the UCI Auto MPG data as `mlxtend.data.autompg_data()` ships it: nothing is downloaded;
`pip install hetps[data]`).

The rows are shuffled once (a fixed seed, not `seed`: every run splits alike) and split 80/20;
the origin (1, 2, 3) becomes three 0/1 columns; features and target are standardized with
the training split's mean and standard deviation (so MSE is in units of the target's
variance: 1 - R² on the training split, near it on the test one).

    task: regression
    model: {name: hetps.examples.autompg:model}
    data: {dataset: hetps.examples.autompg:datasets}
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

FEATURES = 9  # 6 numeric columns and origin one-hot
SPLIT_SEED = 1234
TRAIN_SHARE = 0.8


def arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """(features (392, 9), mpg (392,)) as float32, in the file's order."""
    try:
        from mlxtend.data import autompg_data
    except ImportError:
        raise ImportError(
            "hetps.examples.autompg reads the Auto MPG data mlxtend ships: pip install hetps[data]"
        ) from None
    x, y = autompg_data()
    x = torch.as_tensor(x[:, :7], dtype=torch.float32)  # the 8th column (car name) is NaN
    origin = nn.functional.one_hot(x[:, 6].long() - 1, 3).float()
    return torch.cat([x[:, :6], origin], dim=1), torch.as_tensor(y, dtype=torch.float32)


def datasets():
    """(train, test) TensorDatasets of (features (9,), mpg ()) rows, standardized."""
    x, y = arrays()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    cut = int(len(y) * TRAIN_SHARE)
    train, test = order[:cut], order[cut:]
    mean, std = x[train].mean(0), x[train].std(0).clamp_min(1e-6)
    y_mean, y_std = y[train].mean(), y[train].std()
    x, y = (x - mean) / std, (y - y_mean) / y_std
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def model(hidden: int = 32) -> nn.Module:
    """An MLP with one hidden layer (hidden=0: a linear model); outputs (B, 1)."""
    if hidden <= 0:
        return nn.Linear(FEATURES, 1)
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, 1))
