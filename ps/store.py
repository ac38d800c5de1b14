"""The named-tensor store of one shard.

Holds the tensors the plan assigned to this shard (parameters and buffers),
their per-tensor versions, and a shard-level version (updates applied). The
store is model-agnostic: it knows names, dtypes, shapes and kinds only.
The tensors are views of one arena (arena.py): the parameters of each dtype
form one flat run for the optimizer, and a pull reply sends the arena as one
frame.
Not thread-safe: owned by the shard's single loop.
"""

from __future__ import annotations

import logging
from typing import Mapping

import torch

from hetps.proto import dtypes
from hetps.proto.codec import (
    EncodedTensors,
    ProtocolError,
    TensorCatalog,
    encode_tensors,
    is_pack_of,
    tensor_frame,
)
from hetps.proto.layout import PACK_BELOW
from hetps.proto.messages import Status
from hetps.proto.plan import TensorSpec
from hetps.proto.tensors import Tensors

from .arena import Arena
from .snapshots import Snapshots

log = logging.getLogger(__name__)


class TensorStore:
    def __init__(self, specs: list[TensorSpec]):
        self.specs = {s.name: s for s in specs}
        self.param_order = tuple(s.name for s in specs if s.kind == "param")  # in spec order
        self.catalog: TensorCatalog = {s.name: (s.dtype, s.shape) for s in specs}
        # views of `arena`, in its order, once initialized
        self.tensors: dict[str, torch.Tensor] = {}
        self.arena: Arena | None = None
        self.versions: dict[str, int] = {s.name: 0 for s in specs}
        self.version = 0
        self._snapshot: Tensors | None = None  # lent since the last write
        # the header fields of the arena's snapshots, once one proved to be its pack
        self._pack_fields: dict | None = None
        self.snapshots = Snapshots()

    @property
    def initialized(self) -> bool:
        return bool(self.tensors) or not self.specs

    def param_names(self) -> list[str]:
        return list(self.param_order)

    def buffer_names(self) -> list[str]:
        return [n for n, s in self.specs.items() if s.kind == "buffer"]

    def initialize(self, values: Mapping[str, torch.Tensor]) -> bool:
        """Copy initial values in; False (and no change) if already initialized."""
        if self.initialized:
            return False
        missing = sorted(set(self.specs) - set(values))
        if missing:
            raise ProtocolError(Status.MALFORMED, f"INIT lacks tensors {missing[:5]}")
        self._fill(values)
        return True

    def _fill(self, values: Mapping[str, torch.Tensor]) -> None:
        """Lay the tensors out in a new arena and copy `values` in."""
        arena = Arena(
            (s.name, dtypes.DTYPES[s.dtype], tuple(s.shape), s.kind == "param")
            for s in self.specs.values()
        )
        views = arena.views
        torch._foreach_copy_([views[n] for n in arena.order], [values[n] for n in arena.order])
        self.arena, self.tensors = arena, dict(views)
        self._pack_fields = None  # found again for the new arena

    def state_dict(self) -> dict:
        # each tensor on its own memory: torch.save refuses views of one storage as several dtypes
        return {
            "tensors": {n: t.clone() for n, t in self.tensors.items()},
            "versions": self.versions,
            "version": self.version,
        }

    def load_state_dict(self, state: dict) -> None:
        """Values and versions from a checkpoint of this same tensor set."""
        tensors = state["tensors"]
        if set(tensors) != set(self.specs):
            raise ValueError(
                f"checkpoint holds tensors {sorted(tensors)[:5]}..., this shard owns "
                f"{sorted(self.specs)[:5]}...: not the same placement"
            )
        self._fill(tensors)
        self.versions = dict(state["versions"])
        self.version = int(state["version"])
        self._snapshot = None

    def mark_updated(self, names) -> None:
        """Bump per-tensor versions and the shard version after an update."""
        for n in names:
            self.versions[n] += 1
        self.version += 1
        self._snapshot = None

    def mix_buffers(self, buffers: Mapping[str, torch.Tensor], weight: float) -> None:
        """Buffer policy: float buffers move toward the pushed value by `weight`
        (a running mean); integer buffers (e.g. num_batches_tracked) take the max."""
        for name, value in buffers.items():
            current = self.tensors[name]
            if current.is_floating_point():
                current.lerp_(value.to(current.dtype), weight)
            else:
                torch.maximum(current, value, out=current)
        self._snapshot = None

    def snapshot(self) -> Tensors:
        """The tensors as they are now, for a pull reply, shared by every pull
        until the next write, with their wire encoding made once (`encoded`).
        Replies leave zero-copy, so these are aliases that no later write will
        reach: writers call `settle` first (see snapshots.py). Hand the value
        to `track` once it was sent."""
        if self._snapshot is None and self.snapshots.current is not None:
            log.error(
                "shard tensors were written without settle(): a reply in flight may have seen it"
            )
        self._snapshot = self.snapshots.lend(self.tensors, self.arena, self._encode)
        return self._snapshot

    def encoded(self, snapshot: Mapping[str, torch.Tensor]) -> EncodedTensors:
        """`snapshot` encoded for the wire: the encoding it carries (from
        `snapshot()`: made once for every reply of a version), else a new one."""
        if isinstance(snapshot, Tensors) and snapshot.encoded is not None:
            return snapshot.encoded
        return encode_tensors(snapshot)

    def _encode(
        self, snapshot: Mapping[str, torch.Tensor], memory: torch.Tensor | None
    ) -> EncodedTensors:
        if memory is None:
            return encode_tensors(snapshot)
        # a snapshot is the arena's views in its order, each time at the same offsets: once one
        # proved to be the pack of its memory, every later one is, with the same header fields
        if self._pack_fields is not None:
            return EncodedTensors(self._pack_fields, [tensor_frame(memory)])
        encoded = encode_tensors(snapshot, PACK_BELOW, memory)
        if is_pack_of(snapshot, memory):
            self._pack_fields = encoded.fields
        return encoded

    def track(self, snapshot: Tensors, tracker) -> None:
        """`snapshot` went out in a reply; the transport is done with its memory
        once `tracker.done` (None: already)."""
        self.snapshots.track(snapshot, tracker)

    def settle(self) -> None:
        """Call before writing the tensors in place: replies still reading
        their memory keep it, the tensors move to other memory."""
        self.snapshots.settle(self.tensors, self.arena)
