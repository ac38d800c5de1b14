"""Compression of worker -> shard gradients (`comm.compression`), both ends.

Worker side: a Compressor (one per PSClient, found by name in COMPRESSORS)
replaces each float32/float64 gradient of a push by what travels:

- `fp16`: the gradient cast to float16 (half the bytes of float32). Round to
  nearest: relative error <= 2**-11 for |g| in float16's normal range
  [2**-14, 65504], absolute error <= 2**-25 below it; |g| > 65504 becomes
  +-Inf, which the shard then treats per `cluster.nonfinite`.
- `topk`: error feedback. Per tensor, acc = gradient + residual; the
  k = ceil(topk_ratio x numel) entries of acc largest in magnitude travel as
  (index, value) pairs and the residual keeps the rest (acc - sent) for the
  next push, so every gradient entry is sent eventually, only later. A
  tensor where k pairs would not be smaller than the dense tensor travels
  dense (acc, and its residual restarts at zero).

Wire form: the header's optional `enc` field lists `[index, kind, count]`
for each compressed tensor (index into `tensors`); the tensor's spec keeps
its dense dtype and shape. Its payload is, for `fp16`, numel float16 values;
for `topk`, `count` indices (int32, int64 for tensors of 2**31 entries or
more, strictly increasing), zero-padded to 8 bytes, then `count` values of
the dense dtype.

Shard side: `decompress`, called by codec.decode (the trust boundary), checks
the indices and returns the dense tensor of the declared dtype and shape, so
policies only ever see dense gradients. The payload's byte length is checked
before, against `payload_nbytes`.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Container, Mapping

from .errors import ProtocolError
from .layout import aligned
from .lazy import lazy_module
from .ops import Status

# the scheduler imports this module (through codec) and never loads torch
if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

_FLOATS: tuple = ()  # (torch.float32, torch.float64): dense dtypes that may travel compressed


def floats() -> tuple:
    """The dense dtypes that may travel compressed (built on first use: torch loads then)."""
    global _FLOATS
    if not _FLOATS:
        _FLOATS = (torch.float32, torch.float64)
    return _FLOATS


def __getattr__(name: str):
    if name == "FLOATS":  # the constant's old name, for importers
        return floats()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


KINDS = ("fp16", "topk")


@dataclass(frozen=True)
class Compressed:
    """A tensor as it travels compressed: its dense dtype and shape, how many
    values it carries (`count`) and its payload. The payload is a fresh 1-D
    uint8 tensor that nothing writes after it is made (it may leave zero-copy)."""

    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    count: int
    payload: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.payload.numel()


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= 2**31 else torch.int64


def payload_nbytes(kind: str, dtype: torch.dtype, numel: int, count: int) -> int:
    """Bytes of the payload of a valid `kind` encoding (checked by `check_encoding`)."""
    if kind == "fp16":
        return numel * 2
    return aligned(count * index_dtype(numel).itemsize) + count * dtype.itemsize


# ---------------------------------------------------------------- shard side (trust boundary)


def check_encoding(
    kind: object, count: object, dtype: torch.dtype, numel: int, name: str, req_id: int
) -> None:
    """Raise MALFORMED unless `[kind, count]` can describe a tensor of `dtype`, `numel` entries."""
    if kind not in KINDS:
        raise ProtocolError(
            Status.MALFORMED, f"tensor {name!r}: unknown encoding {kind!r:.20}", req_id
        )
    if dtype not in floats():
        raise ProtocolError(
            Status.MALFORMED, f"tensor {name!r}: {kind} of a {dtype} tensor", req_id
        )
    if type(count) is not int or not 0 <= count <= numel or (kind == "fp16" and count != numel):
        raise ProtocolError(
            Status.MALFORMED,
            f"tensor {name!r}: {kind} count {count!r:.20} for {numel} entries",
            req_id,
        )


def decompress(
    kind: str,
    count: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    payload: memoryview,
    name: str,
    req_id: int,
) -> torch.Tensor:
    """The dense tensor a checked encoding and a payload of `payload_nbytes` bytes describe."""
    numel = math.prod(shape)
    if kind == "fp16":
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(payload, dtype=torch.float16).to(dtype).reshape(shape)
    dense = torch.zeros(numel, dtype=dtype)
    if count:
        itype = index_dtype(numel)
        index = torch.frombuffer(payload, dtype=itype, count=count)
        values = torch.frombuffer(
            payload, dtype=dtype, count=count, offset=aligned(count * itype.itemsize)
        )
        if not (
            int(index[0]) >= 0 and int(index[-1]) < numel and bool((index[1:] > index[:-1]).all())
        ):
            raise ProtocolError(
                Status.MALFORMED,
                f"tensor {name!r}: topk indices must increase strictly within [0, {numel})",
                req_id,
            )
        dense[index.long()] = values
    return dense.reshape(shape)


# ---------------------------------------------------------------- worker side


def topk_payload(index: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """The `topk` payload bytes: indices (padded to 8 bytes), then values."""
    itype = index_dtype(numel)
    k = index.numel()
    offset = aligned(k * itype.itemsize)
    payload = torch.zeros(offset + k * values.element_size(), dtype=torch.uint8)
    payload[: k * itype.itemsize].view(itype).copy_(index)
    payload[offset:].view(values.dtype).copy_(values)
    return payload


class Compressor(ABC):
    """Replaces the gradients of a push by what travels. Keeps byte counts
    (`stats`). Thread-safe across tensor names: the overlap trainer pushes to
    different shards, whose tensors differ, from several threads."""

    name: ClassVar[str]

    def __init__(self, ratio: float):
        self.ratio = ratio
        self.dense_bytes = 0  # what the compressed tensors would have taken dense
        self.sent_bytes = 0  # what they took
        self._lock = threading.Lock()

    def compress(self, tensors: Mapping[str, torch.Tensor], names: Container[str]) -> dict:
        """`tensors`, with each non-empty float32/float64 tensor named in
        `names` replaced by a `Compressed` one (or a fresh dense tensor). The
        tensors given are only read."""
        out: dict = {}
        dense = sent = 0
        for name, t in tensors.items():
            if name in names and t.dtype in floats() and t.numel():
                out[name] = self.encode(name, t.detach())
                dense += t.numel() * t.element_size()
                sent += _nbytes(out[name])
            else:
                out[name] = t
        with self._lock:
            self.dense_bytes += dense
            self.sent_bytes += sent
        return out

    @abstractmethod
    def encode(self, name: str, grad: torch.Tensor) -> Compressed | torch.Tensor:
        """One gradient as it travels (the subclass's encoding)."""

    def stats(self) -> dict:
        return {
            "compression": self.name,
            "grad_dense_bytes": self.dense_bytes,
            "grad_sent_bytes": self.sent_bytes,
        }


def _nbytes(t: Compressed | torch.Tensor) -> int:
    return t.nbytes if isinstance(t, Compressed) else t.numel() * t.element_size()


class Fp16Compressor(Compressor):
    name = "fp16"

    def encode(self, name: str, grad: torch.Tensor) -> Compressed:
        half = grad.to(torch.float16).reshape(-1)
        return Compressed(
            "fp16", grad.dtype, tuple(grad.shape), half.numel(), half.view(torch.uint8)
        )


class TopKCompressor(Compressor):
    name = "topk"

    def __init__(self, ratio: float):
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"comm.topk_ratio must be in (0, 1], got {ratio}")
        super().__init__(ratio)
        self.residual: dict[str, torch.Tensor] = {}  # name -> flat (gradient + residual) - sent

    def k_for(self, numel: int) -> int:
        return max(1, math.ceil(self.ratio * numel))

    def encode(self, name: str, grad: torch.Tensor) -> Compressed | torch.Tensor:
        acc = self._accumulate(name, grad)
        numel, k = acc.numel(), self.k_for(acc.numel())
        if payload_nbytes("topk", acc.dtype, numel, k) >= numel * acc.element_size():
            dense = acc.clone().reshape(grad.shape)
            acc.zero_()
            return dense
        index = torch.topk(acc.abs(), k, sorted=False).indices.sort().values
        values = acc[index]
        acc[index] = 0
        return Compressed(
            "topk", acc.dtype, tuple(grad.shape), k, topk_payload(index, values, numel)
        )

    def _accumulate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """Flat gradient + residual, in this tensor's residual buffer."""
        flat = grad.reshape(-1)
        residual = self.residual.get(name)
        if residual is None or residual.shape != flat.shape or residual.dtype != flat.dtype:
            residual = self.residual[name] = flat.clone()
        else:
            residual.add_(flat)
        return residual


COMPRESSORS: dict[str, type[Compressor]] = {"fp16": Fp16Compressor, "topk": TopKCompressor}


def make_compressor(name: str, ratio: float) -> Compressor | None:
    """The compressor called `name` (`comm.compression`); None for "none"."""
    if name == "none":
        return None
    if name not in COMPRESSORS:
        raise ValueError(
            f"comm.compression: unknown value {name!r}; allowed: none, {', '.join(COMPRESSORS)}"
        )
    return COMPRESSORS[name](ratio)
