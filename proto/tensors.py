"""Named tensors as one immutable value that carries its flat runs.

On the push path, tensors go from the decoder (codec.py) to a round's sum
(ps/round_sums.py) and the shard's optimizer (ps/updater.py); on the way
back, a pull reply's go to the worker's flat model (training/flat_model.py).
Whoever lays them out -- the decoder of a pack frame (known_layouts.py), a
round's sum, a worker merging its shards' replies -- knows their flat runs
(runs.py): tensors of one dtype back to back in one buffer, read as one
1-D tensor. A `Tensors` carries them as `runs`, with their `layout` (what
another value's runs must match to be added run for run), beside the
read-only mapping name -> tensor. The mapping cannot change, so the runs
always describe its tensors; a changed mapping is a new value, whose maker
says which runs it keeps. The tensors' memory is not frozen: a round's sum
adds into its own tensors in place.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

    from .codec import EncodedTensors


class Run(NamedTuple):
    """Tensors of one dtype that lie back to back in one buffer, each at the
    previous one's ALIGN-rounded end (layout.py): `flat` is one 1-D tensor
    from the first one's start to the last one's end (the padding between
    them included), `names` theirs, in order."""

    flat: torch.Tensor
    names: tuple[str, ...]


class RunSpec(NamedTuple):
    """What a run of one value must share with a run of another for the two
    to be added whole: dtype, length in entries, the tensors' names in order."""

    dtype: torch.dtype
    numel: int
    names: tuple[str, ...]


def layout_of(runs: Iterable[Run]) -> tuple[RunSpec, ...]:
    """The specs of `runs`, in order."""
    return tuple(RunSpec(r.flat.dtype, r.flat.numel(), r.names) for r in runs)


class Tensors(Mapping[str, "torch.Tensor"]):
    """A read-only mapping name -> tensor (in its maker's order) and the
    flat runs known in it. `runs`: each run's tensors are this mapping's
    (empty: none known; `runs.flat_runs` then looks for them in memory).
    `layout`: the runs' specs. `encoded`: the tensors' wire form when its
    maker made it already (a shard's pull snapshot, ps/store.py), else None.
    Frozen: no entry or attribute can be set (they are read-only
    properties); `merge` and the constructor make new values."""

    __slots__ = ("_tensors", "_runs", "_layout", "_encoded")

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] = (),
        runs: Iterable[Run] = (),
        encoded: EncodedTensors | None = None,
    ):
        """`tensors` copied (the dict, not the tensors); `runs` must be runs of them."""
        self._tensors: dict[str, torch.Tensor] = dict(tensors)
        self._runs: tuple[Run, ...] = tuple(runs)
        self._layout: tuple[RunSpec, ...] | None = None  # worked out when first asked for
        self._encoded = encoded

    @property
    def runs(self) -> tuple[Run, ...]:
        return self._runs

    @property
    def layout(self) -> tuple[RunSpec, ...]:
        layout = self._layout
        if layout is None:
            layout = self._layout = layout_of(self._runs)
        return layout

    @property
    def encoded(self) -> EncodedTensors | None:
        return self._encoded

    @classmethod
    def merge(cls, parts: Iterable[Mapping[str, torch.Tensor]]) -> Tensors:
        """The tensors of every part in one value, in order, with the runs of
        the parts that are Tensors. A name in two parts takes the later
        part's tensor, and the runs that named the earlier one are dropped."""
        parts = list(parts)
        tensors: dict[str, torch.Tensor] = {}
        runs: list[Run] = []
        total = 0
        for part in parts:
            tensors.update(part._all() if isinstance(part, Tensors) else part)
            total += len(part)
            if isinstance(part, Tensors):
                runs += part.runs
        if total != len(tensors):  # some name came twice: keep the runs whose tensors are all kept
            last = {n: i for i, part in enumerate(parts) for n in part}
            runs = [
                r
                for i, part in enumerate(parts)
                if isinstance(part, Tensors)
                for r in part.runs
                if all(last[n] == i for n in r.names)
            ]
        out = cls.__new__(cls)
        out._tensors, out._runs, out._layout, out._encoded = tensors, tuple(runs), None, None
        return out

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def keys(self):  # type: ignore[override]  # the dict's read-only views: C speed
        return self._all().keys()

    def items(self):  # type: ignore[override]
        return self._all().items()

    def values(self):  # type: ignore[override]
        return self._all().values()

    def _all(self) -> dict[str, torch.Tensor]:
        """Every tensor, made (a subclass may make them when first read)."""
        return self._tensors

    def __reduce__(self) -> tuple[Any, ...]:
        # a copy (pickle, copy.copy) is the plain mapping: the runs are views of this value's memory
        return Tensors, (dict(self.items()),)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)}, runs={[r.names for r in self.runs]})"
