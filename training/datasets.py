"""`Datasets`: what a worker or the evaluator trains and tests on, whichever loader made it
(data.py for the builtin datasets, user_data.py for a `package.module:factory`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .data import ArrayDataset
    from .user_data import MapDataset, StreamDataset


@dataclass(frozen=True, eq=False)
class Datasets:
    """What a worker or the evaluator needs: both splits, the input shape, the
    class count (None: the dataset does not say), the size of one target
    (`y`'s values per example: a regression model's outputs). A split is an
    ArrayDataset or, for a package.module:factory dataset, a
    user_data.MapDataset (`len`, `__getitem__`) or user_data.StreamDataset
    (an iterable dataset: no `len`)."""

    train: ArrayDataset | MapDataset | StreamDataset
    test: ArrayDataset | MapDataset | StreamDataset
    in_shape: tuple[int, ...]
    num_classes: int | None
    target_size: int = 1
