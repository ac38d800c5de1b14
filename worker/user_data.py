"""Your own dataset: `data.dataset: package.module:factory` with `data.kwargs`.

The contract (docs/own-model.md says the same to users):

* `factory(**data.kwargs)` returns `(train, test)`: two map-style
  `torch.utils.data.Dataset`s (`__len__` and `__getitem__(i)`).
* `dataset[i]` is `(x, y)`: `x` a floating-point tensor of one fixed shape,
  images as (C, H, W), already normalised as the model wants it; `y` an int
  (or an integer 0-d tensor) in `0 .. num_classes-1`.
* The class count is `train.num_classes` (an int attribute) or, failing
  that, `len(train.classes)` (the torchvision convention).
* The input shape is the shape of `train[0][0]`.
* The factory is called in every worker and in the evaluator, on every
  host: it must give the same examples in the same order everywhere (a
  fixed split) and should be cheap: read examples in `__getitem__`, not
  in the factory. A worker only ever asks for the indices of its own share.
"""

from __future__ import annotations

import importlib
import json

import torch
from torch.utils.data import Dataset


class DatasetContractError(ValueError):
    """A dataset factory or its datasets break the contract above; the message says how."""


class MapDataset:
    """A map-style Dataset seen as hetps sees its datasets: `len` and
    `batch(indices)`, which reads only the examples at `indices` (one
    `__getitem__` each, in this process)."""

    def __init__(self, dataset: Dataset, spec: str, split: str):
        self.dataset = dataset
        self.spec = spec
        self.split = split

    def __len__(self) -> int:
        return len(self.dataset)

    def example(self, index: int) -> tuple[torch.Tensor, int]:
        """Example `index` as (float tensor, int label). Raises DatasetContractError."""
        item = self.dataset[index]
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise DatasetContractError(
                f"dataset {self.spec!r}: {self.split}[{index}] must be (x, y), "
                f"got {type(item).__name__}"
            )
        x, y = item
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            kind = f"{x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
            raise DatasetContractError(
                f"dataset {self.spec!r}: {self.split}[{index}] x must be a float "
                f"tensor, got {kind} (convert and normalise in __getitem__)"
            )
        if isinstance(y, torch.Tensor) and y.numel() == 1 and not y.is_floating_point():
            y = int(y)
        if isinstance(y, bool) or not isinstance(y, int):
            raise DatasetContractError(
                f"dataset {self.spec!r}: {self.split}[{index}] y must be an int "
                f"class index, got {type(y).__name__} {y!r}"
            )
        return x, y

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The examples at `indices` stacked: (float32 x, int64 y)."""
        examples = [self.example(int(i)) for i in indices]
        try:
            x = torch.stack([e[0] for e in examples]).float()
        except RuntimeError as exc:
            raise DatasetContractError(
                f"dataset {self.spec!r}: examples of different shapes in one batch ({exc})"
            ) from None
        return x, torch.tensor([e[1] for e in examples], dtype=torch.long)


def num_classes_of(train: Dataset, spec: str) -> int:
    count = getattr(train, "num_classes", None)
    if count is None and getattr(train, "classes", None) is not None:
        count = len(train.classes)
    if isinstance(count, bool) or not isinstance(count, int) or count < 2:
        raise DatasetContractError(
            f"dataset {spec!r}: the train dataset needs an int attribute num_classes "
            f">= 2 (or a list attribute classes), got {count!r}"
        )
    return count


_LOADED: dict[tuple[str, str], object] = {}  # (spec, kwargs as JSON) -> Datasets


def load_factory_datasets(spec: str, kwargs: dict):
    """`Datasets` from `package.module:factory` called with `kwargs`; cached
    per process (a worker's check and its training share one dataset).
    Raises DatasetContractError (a contract broken) or ImportError."""
    key = (spec, json.dumps(kwargs, sort_keys=True, default=str))
    if key not in _LOADED:
        _LOADED[key] = _load(spec, kwargs)
    return _LOADED[key]


def _load(spec: str, kwargs: dict):
    from .data import Datasets  # data.py dispatches here: import at call time

    module_name, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    made = factory(**kwargs)
    if not isinstance(made, (tuple, list)) or len(made) != 2:
        raise DatasetContractError(
            f"dataset factory {spec!r} must return (train, test) datasets, "
            f"got {type(made).__name__}"
        )
    train, test = (MapDataset(d, spec, split) for d, split in zip(made, ("train", "test")))
    for part in (train, test):
        if len(part) == 0:
            raise DatasetContractError(f"dataset {spec!r}: the {part.split} split is empty")
    x, _ = train.example(0)
    return Datasets(
        train=train, test=test, in_shape=tuple(x.shape), num_classes=num_classes_of(made[0], spec)
    )
