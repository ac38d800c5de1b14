"""Encode and decode hetps messages: one msgpack header frame + raw tensor frames.

TRUST BOUNDARY. `decode` is the only place bytes from a peer become Python
objects. It checks everything once (version, op, field presence and types,
dtype allow-list, frame count, byte length, optional tensor catalogue) and
raises `ProtocolError` with a `Status`; it never allocates memory sized by an
unchecked header value and never unpickles anything.

Received tensors are read-only views of the frame buffers (zero-copy): callers
must copy before writing into them.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import MISSING, dataclass
from typing import Any, Mapping, Sequence

import msgpack
import torch

from .messages import (MESSAGES, PROTOCOL_VERSION, Error, Message, Op, Status,
                       has_tensors, header_fields)

# torch warns that frame buffers are read-only; we never write into them.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DEFAULT_MAX_TENSOR_BYTES = 1 << 30
MAX_HEADER_BYTES = 1 << 20
_TYPES = {"int": int, "str": str, "list": list, "dict": dict, "bool": bool, "float": (int, float)}


class ProtocolError(Exception):
    """A message failed validation; `status` says why, `req_id` is echoed if known."""

    def __init__(self, status: Status, message: str, req_id: int = 0):
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message
        self.req_id = req_id


@dataclass(frozen=True)
class Envelope:
    """A decoded message plus its routing header fields."""

    msg: Message
    req_id: int
    src: int


TensorCatalog = Mapping[str, tuple[str, tuple[int, ...]]]  # name -> (dtype name, shape)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ProtocolError(Status.DTYPE_NOT_ALLOWED, f"dtype {dtype} not allowed") from None


def tensor_frame(t: torch.Tensor) -> memoryview:
    """A byte view of a CPU tensor's data, copied only if it is not contiguous."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return memoryview(flat.contiguous().view(torch.uint8).numpy()).cast("B")


def encode(msg: Message, req_id: int = 0, src: int = 0) -> list:
    """Frames for `msg`: [header bytes, tensor data ...]. Tensors must be on the CPU."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": int(msg.OP), "id": req_id, "src": src}
    for f in header_fields(type(msg)):
        header[f.name] = getattr(msg, f.name)
    frames: list = [None]
    if has_tensors(type(msg)):
        specs = []
        for name, t in msg.tensors.items():
            specs.append([name, dtype_name(t.dtype), list(t.shape)])
            frames.append(tensor_frame(t))
        header["tensors"] = specs
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


def _unpack_header(raw) -> dict:
    raw = bytes(raw)
    if len(raw) > MAX_HEADER_BYTES:  # msgpack.unpackb has no max_buffer_size argument
        raise ProtocolError(Status.MALFORMED, f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(Status.MALFORMED, f"header is not msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(Status.MALFORMED, "header is not a map")
    return header


def _check_type(name: str, value: Any, type_name: str, req_id: int) -> None:
    want = _TYPES[type_name]
    ok = isinstance(value, want) and not (isinstance(value, bool) and type_name in ("int", "float"))
    if not ok:
        raise ProtocolError(Status.MALFORMED,
                            f"field {name!r} must be {type_name}, got {type(value).__name__}", req_id)


def _read_op(header: dict) -> tuple[type[Message], int, int]:
    req_id = header.get("id", 0)
    req_id = req_id if isinstance(req_id, int) and not isinstance(req_id, bool) else 0
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(Status.BAD_VERSION,
                            f"protocol version {header.get('v')!r}, expected {PROTOCOL_VERSION}", req_id)
    for key in ("op", "id", "src"):
        if key not in header:
            raise ProtocolError(Status.MALFORMED, f"missing field {key!r}", req_id)
        _check_type(key, header[key], "int", req_id)
    try:
        cls = MESSAGES[Op(header["op"])]
    except ValueError:
        raise ProtocolError(Status.UNKNOWN_OP, f"unknown op {header['op']}", req_id) from None
    return cls, req_id, header["src"]


def _decode_tensor(spec: Any, buf, max_bytes: int, req_id: int) -> tuple[str, torch.Tensor]:
    if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str)
            and isinstance(spec[1], str) and isinstance(spec[2], list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in spec[2])):
        raise ProtocolError(Status.MALFORMED, f"bad tensor spec {spec!r:.80}", req_id)
    name, dtype_str, shape = spec
    if dtype_str not in DTYPES:
        raise ProtocolError(Status.DTYPE_NOT_ALLOWED,
                            f"tensor {name!r}: dtype {dtype_str!r} not in {sorted(DTYPES)}", req_id)
    dtype = DTYPES[dtype_str]
    bound = dtype.itemsize  # >= nbytes; also bounds dims beside a 0
    for d in shape:  # stop as soon as it is too large: a shape may list thousands of huge dims
        bound *= max(d, 1)
        if bound > max_bytes:
            raise ProtocolError(Status.TOO_LARGE, f"tensor {name!r} declares more than {max_bytes} bytes, "
                                                  f"shape {shape!r:.80}", req_id)
    nbytes = math.prod(shape) * dtype.itemsize
    view = memoryview(buf)
    if view.nbytes != nbytes:
        raise ProtocolError(Status.MALFORMED,
                            f"tensor {name!r}: frame has {view.nbytes} bytes, shape needs {nbytes}", req_id)
    if nbytes == 0:
        return name, torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        return name, torch.frombuffer(view, dtype=torch.uint8).view(torch.bool).reshape(shape)
    return name, torch.frombuffer(view, dtype=dtype).reshape(shape)


def check_catalog(tensors: Mapping[str, torch.Tensor], catalog: TensorCatalog, req_id: int = 0) -> None:
    """Raise unless every tensor is in `catalog` with the registered dtype and shape."""
    for name, t in tensors.items():
        if name not in catalog:
            raise ProtocolError(Status.UNKNOWN_TENSOR, f"tensor {name!r} is not held here", req_id)
        dtype_str, shape = catalog[name]
        if tuple(t.shape) != tuple(shape):
            raise ProtocolError(Status.SHAPE_MISMATCH,
                                f"tensor {name!r}: shape {list(t.shape)}, registered {list(shape)}", req_id)
        if DTYPE_NAMES[t.dtype] != dtype_str:
            raise ProtocolError(Status.DTYPE_NOT_ALLOWED,
                                f"tensor {name!r}: dtype {DTYPE_NAMES[t.dtype]}, registered {dtype_str}", req_id)


def decode(frames: Sequence, catalog: TensorCatalog | None = None,
           max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> Envelope:
    """Validate and decode frames into an Envelope. Raises ProtocolError."""
    if not frames:
        raise ProtocolError(Status.MALFORMED, "empty message")
    header = _unpack_header(frames[0])
    cls, req_id, src = _read_op(header)
    values: dict[str, Any] = {}
    for f in header_fields(cls):
        if f.name in header:
            _check_type(f.name, header[f.name], str(f.type), req_id)
            values[f.name] = header[f.name]
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ProtocolError(Status.MALFORMED, f"{cls.OP.name}: missing field {f.name!r}", req_id)
    specs = header.get("tensors", []) if has_tensors(cls) else []
    if not isinstance(specs, list):
        raise ProtocolError(Status.MALFORMED, "field 'tensors' must be a list", req_id)
    if len(frames) - 1 != len(specs):
        raise ProtocolError(Status.MALFORMED,
                            f"{len(frames) - 1} tensor frames for {len(specs)} tensor specs", req_id)
    if has_tensors(cls):
        tensors = dict(_decode_tensor(s, b, max_tensor_bytes, req_id) for s, b in zip(specs, frames[1:]))
        if len(tensors) != len(specs):
            raise ProtocolError(Status.MALFORMED, "duplicate tensor names", req_id)
        if catalog is not None:
            check_catalog(tensors, catalog, req_id)
        values["tensors"] = tensors
    return Envelope(cls(**values), req_id, src)


def error_frames(err: ProtocolError, src: int = 0) -> list:
    """Frames of the ERROR reply for a failed request."""
    return encode(Error(status=int(err.status), message=err.message), err.req_id, src)
