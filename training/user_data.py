"""Your own dataset: `data.dataset: package.module:factory` with `data.kwargs`.

The contract (docs/own-model.md says the same to users):

* `factory(**data.kwargs)` returns `(train, test)`: two
  `torch.utils.data.Dataset`s, map-style (`__len__` and `__getitem__(i)`)
  or iterable (`torch.utils.data.IterableDataset`, a stream).
* An item is whatever the task takes once collated (the task's `collate`,
  torch's `default_collate` by default). The built-in tasks take `(x, y)`:
  x any tensor (or dict or tuple of tensors) the model takes; y an int
  class index (classification), a float or float tensor (regression),
  an int64 token tensor (language_model).
* Classification's class count: `data.num_classes`, else the train
  dataset's int attribute `num_classes`, else `len(train.classes)` (the
  torchvision convention).
* The input shape (what a model factory's `input_shape` receives) is the
  shape of the first item's x when it is a tensor, else ().
* The factory is called in every worker and in the evaluator, on every
  host: it must give the same examples in the same order everywhere (a
  fixed split) and should be cheap: read examples in `__getitem__`, not
  in the factory. A worker only ever asks for the indices of its own share
  (map-style), or keeps only its own share of the stream (iterable).
"""

from __future__ import annotations

import itertools
import json

import torch
from torch.utils.data import Dataset, IterableDataset, default_collate, get_worker_info

from hetps.runconfig.factories import FactoryError, load_factory

from .datasets import Datasets


class DatasetContractError(ValueError):
    """A dataset factory or its datasets break the contract above; the message says how."""


class MapDataset(Dataset):
    """A map-style Dataset as hetps reads it: `len`, `__getitem__` (the
    user's item as it is, read in this process or a loader process)."""

    iterable = False

    def __init__(self, dataset: Dataset, spec: str, split: str):
        self.dataset = dataset
        self.spec = spec
        self.split = split

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.dataset[index]

    def batch(self, indices: torch.Tensor):
        """The items at `indices` collated by torch's default_collate."""
        return default_collate([self.dataset[int(i)] for i in indices])


class StreamDataset(IterableDataset):
    """An iterable (streaming) Dataset as hetps reads it: iterated once per
    epoch (`set_epoch(epoch)` first when the dataset has it); `share` keeps
    one worker's part of the stream."""

    iterable = True

    def __init__(self, dataset: IterableDataset, spec: str, split: str):
        self.dataset = dataset
        self.spec = spec
        self.split = split

    def __iter__(self):
        return iter(self.dataset)

    def share(self, index: int, world: int, weights=None) -> "StreamShare":
        return StreamShare(self, index, world, weights)


GOLDEN = (5**0.5 - 1) / 2


def owner(i: int, world: int, cumulative: list[float] | None) -> int:
    """Which of `world` workers keeps element `i` of a stream: i mod world
    for equal shares; else the bucket of the low-discrepancy point
    frac(i x golden ratio) among the cumulative weights (shares follow the
    weights within a few elements)."""
    if cumulative is None:
        return i % world
    u = (i * GOLDEN) % 1.0
    return next((r for r, c in enumerate(cumulative) if u < c), world - 1)


class StreamShare(IterableDataset):
    """Worker `index` of `world`'s share of a StreamDataset, endless: element
    i of each epoch is kept when `owner(i)` is this worker, then spread over
    the DataLoader's processes (each keeps every n-th kept element); at the
    end of the stream the next epoch starts."""

    def __init__(self, stream: StreamDataset, index: int, world: int, weights=None):
        self.stream, self.index, self.world = stream, index, world
        self.cumulative = None
        if weights is not None and len(set(weights)) > 1:
            total = float(sum(weights))
            self.cumulative = list(itertools.accumulate(w / total for w in weights))

    def __iter__(self):
        info = get_worker_info()
        part, parts = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch = 0
        while True:
            set_epoch = getattr(self.stream.dataset, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
            kept = 0
            for i, item in enumerate(self.stream):
                if owner(i, self.world, self.cumulative) != self.index:
                    continue
                if kept % parts == part:
                    yield item
                kept += 1
            if kept < parts:
                raise DatasetContractError(
                    f"dataset {self.stream.spec!r}: the {self.stream.split} stream gave worker "
                    f"{self.index} of {self.world} {kept} elements in epoch {epoch}; it needs more"
                )
            epoch += 1


def num_classes_of(train: Dataset, spec: str) -> int | None:
    """The train dataset's class count (`num_classes`, or `len(classes)`); None when it has neither."""
    count = getattr(train, "num_classes", None)
    if count is None and getattr(train, "classes", None) is not None:
        count = len(train.classes)
    if count is None:
        return None
    if isinstance(count, bool) or not isinstance(count, int) or count < 2:
        raise DatasetContractError(
            f"dataset {spec!r}: the train dataset's num_classes must be an int >= 2 (or its "
            f"classes a list), got {count!r}"
        )
    return count


_LOADED: dict[tuple[str, str], Datasets] = {}  # (spec, kwargs as JSON) -> Datasets


def load_factory_datasets(spec: str, kwargs: dict) -> Datasets:
    """`Datasets` from `package.module:factory` called with `kwargs`; cached
    per process (a worker's check and its training share one dataset).
    Raises DatasetContractError (a factory that does not load, or a contract broken)."""
    key = (spec, json.dumps(kwargs, sort_keys=True, default=str))
    if key not in _LOADED:
        _LOADED[key] = _load(spec, kwargs)
    return _LOADED[key]


def _load(spec: str, kwargs: dict) -> Datasets:
    try:
        factory = load_factory(spec, "data.dataset")
    except FactoryError as exc:
        raise DatasetContractError(f"dataset {spec!r}: {exc.reason}") from None
    made = factory(**kwargs)
    if not isinstance(made, (tuple, list)) or len(made) != 2:
        raise DatasetContractError(
            f"dataset factory {spec!r} must return (train, test) datasets, "
            f"got {type(made).__name__}"
        )
    train, test = (wrap(d, spec, split) for d, split in zip(made, ("train", "test")))
    first = None
    for part in (train, test):
        if part.iterable:
            item = next(iter(part), None)
        else:
            item = part[0] if len(part) else None
        if item is None:
            raise DatasetContractError(f"dataset {spec!r}: the {part.split} split is empty")
        first = item if first is None else first
    x, y = first if isinstance(first, (tuple, list)) and len(first) == 2 else (None, None)
    return Datasets(
        train=train,
        test=test,
        in_shape=tuple(x.shape) if isinstance(x, torch.Tensor) else (),
        num_classes=num_classes_of(made[0], spec),
        target_size=y.numel() if isinstance(y, torch.Tensor) and y.dim() > 0 else 1,
    )


def wrap(dataset, spec: str, split: str) -> MapDataset | StreamDataset:
    """`dataset` as hetps reads it. Raises DatasetContractError for what is not a dataset."""
    if isinstance(dataset, IterableDataset):
        return StreamDataset(dataset, spec, split)
    if not (
        callable(getattr(dataset, "__getitem__", None))
        and callable(getattr(dataset, "__len__", None))
    ):
        raise DatasetContractError(
            f"dataset {spec!r}: the {split} split must be a torch Dataset (__len__ and "
            f"__getitem__) or an IterableDataset, got {type(dataset).__name__}"
        )
    return MapDataset(dataset, spec, split)
