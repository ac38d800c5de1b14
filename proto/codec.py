"""Encode and decode hetps messages: one msgpack header frame + raw tensor frames.

TRUST BOUNDARY. `decode` is the only place bytes from a peer become Python
objects. It checks everything once (version, op, field presence and types,
dtype allow-list, frame layout and byte lengths, compressed payloads,
optional tensor catalogue, and -- through records.py -- the contents of the
free-form fields: stats, info, ack, plan, tensor specs) and raises `ProtocolError` with a `Status`; it
never allocates memory sized by an unchecked header value (a compressed
tensor's dense size passed the same size limit as any tensor's) and never
unpickles anything.
A tensor layout (specs, `packed`) that passed these checks is remembered
(known_layouts.py): a message repeating it exactly skips the spec checks,
never the checks of its frames or of a new catalogue.

Received tensors are read-only views of the frame buffers (zero-copy): callers
must copy before writing into them. Small tensors travel together in one pack
frame (layout.py); compressed gradients are decoded to fresh dense tensors of
their declared dtype and shape here (compression.py), so no caller sees either.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import MISSING, dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Sequence

import msgpack
import numpy

from . import dtypes as _dt
from . import known_layouts
from .compression import Compressed, check_encoding, decompress, payload_nbytes
from .errors import ProtocolError
from .known_layouts import CheckedLayout, Spec, contiguous_strides
from .layout import (
    PACK_BELOW,
    aligned,
    build_pack,
    byte_view,
    check_packed,
    choose_packed,
    split_frames,
)
from .lazy import lazy_module
from .messages import (
    MESSAGES,
    PROTOCOL_VERSION,
    Error,
    Message,
    Op,
    Status,
    carries_tensors,
    has_tensors,
    header_fields,
    wire_form,
    wire_type,
)
from .pack_templates import packed_fields_and_frame
from .runs import flat_runs
from .tensors import Tensors

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")  # the scheduler decodes headers only and never loads it


def __getattr__(name: str):
    """DTYPES, DTYPE_NAMES, NUMPY_DTYPES (re-exported from dtypes.py, built on first use)."""
    if name in ("DTYPES", "DTYPE_NAMES", "NUMPY_DTYPES"):
        return getattr(_dt, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# torch warns that frame buffers are read-only; we never write into them.
warnings.filterwarnings("ignore", message="The given buffer is not writable")
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

# Tensor frames are the tensors' raw memory, so the wire's byte order is the host's: the
# protocol defines it as little-endian (docs/protocol.md) and refuses other hosts.
BYTE_ORDER = "little"
if sys.byteorder != BYTE_ORDER:
    raise ImportError(
        f"hetps needs a {BYTE_ORDER}-endian host: tensor frames are raw {BYTE_ORDER}-endian memory"
    )
DEFAULT_MAX_TENSOR_BYTES = 1 << 30
MAX_HEADER_BYTES = 1 << 20
_TYPES: dict[str, type | tuple[type, ...]] = {
    "int": int,
    "str": str,
    "list": list,
    "dict": dict,
    "bool": bool,
    "float": (int, float),
}


@dataclass(frozen=True)
class Envelope:
    """A decoded message plus its routing header fields."""

    msg: Message
    req_id: int
    src: int


TensorCatalog = Mapping[str, tuple[str, tuple[int, ...]]]  # name -> (dtype name, shape)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _dt.DTYPE_NAMES[dtype]
    except KeyError:
        raise ProtocolError(Status.DTYPE_NOT_ALLOWED, f"dtype {dtype} not allowed") from None


def tensor_frame(t: torch.Tensor) -> memoryview:
    """A flat byte view of a CPU tensor's data, copied only if it is not contiguous."""
    t = t.detach()
    # common case, fewer calls
    if t.dtype in _dt.NUMPY_DTYPES and t.numel() and t.dim() and t.is_contiguous():
        return t.numpy().data.cast("B")
    flat = t.reshape(-1)
    if flat.stride() != (1,):  # a strided 1-D view (e.g. every other entry): copy it
        flat = flat.contiguous()
    return flat.view(torch.uint8).numpy().data  # bool, like every dtype, views as bytes


@dataclass(frozen=True)
class EncodedTensors:
    """The tensor part of a message, encoded once: the header fields that
    describe it (`tensors`, and `packed`, `enc` when used) and its frames.
    Several replies carrying the same tensors (pulls of one version) send
    the same frames; only their headers differ."""

    fields: dict
    frames: list


def encode_tensors(
    tensors: Mapping[str, Any], pack_below: int = PACK_BELOW, arena: torch.Tensor | None = None
) -> EncodedTensors:
    """Specs and payload frames of `tensors` (CPU; `Compressed` values travel
    compressed). Payloads under `pack_below` bytes share one pack frame at
    the end (0: one frame each; all of them if their total is small, see
    layout.choose_packed). Large payloads are views of the tensors: do
    not write them until every message that carries them was sent.
    `arena`: a uint8 tensor that holds `tensors`, in order, in the pack
    layout (ps/arena.py): it is sent as it is, as the one pack frame."""
    if arena is not None and is_pack_of(tensors, arena):
        specs = [[n, _dt.DTYPE_NAMES[t.dtype], list(t.shape)] for n, t in tensors.items()]
        return EncodedTensors(
            {"tensors": specs, "packed": list(range(len(specs)))}, [tensor_frame(arena)]
        )
    template = packed_fields_and_frame(tensors, pack_below)  # a repeated tensor list of one dtype
    if template is not None:
        packed_fields, frame = template
        return EncodedTensors(packed_fields, [frame])
    specs, payloads, encodings = [], [], []
    names = _dt.DTYPE_NAMES
    for i, (name, t) in enumerate(tensors.items()):
        specs.append([name, names.get(t.dtype) or dtype_name(t.dtype), list(t.shape)])
        if type(t) is Compressed:
            encodings.append([i, t.kind, t.count])
            t = t.payload
        payloads.append(tensor_frame(t))
    fields: dict[str, Any] = {"tensors": specs}
    if encodings:
        fields["enc"] = encodings
    packed = choose_packed([p.nbytes for p in payloads], pack_below)
    if not packed:
        return EncodedTensors(fields, payloads)
    fields["packed"] = packed
    in_pack = set(packed)
    own = [p for i, p in enumerate(payloads) if i not in in_pack]
    return EncodedTensors(fields, [*own, build_pack([payloads[i] for i in packed])])


def is_pack_of(tensors: Mapping[str, Any], arena: torch.Tensor) -> bool:
    """Whether `arena`'s bytes are exactly `tensors` packed back to back (layout.py)."""
    if len(tensors) < 2 or arena.dtype != torch.uint8 or not arena.is_contiguous():
        return False
    at, offset = arena.data_ptr(), 0
    for t in tensors.values():
        if (
            type(t) is not torch.Tensor
            or not t.is_contiguous()
            or t.data_ptr() != at + offset
            or t.dtype not in _dt.DTYPE_NAMES
        ):
            return False
        offset += aligned(t.numel() * t.element_size())
    return offset == arena.numel()


def encode(
    msg: Message,
    req_id: int = 0,
    src: int = 0,
    pack_below: int = PACK_BELOW,
    encoded: EncodedTensors | None = None,
) -> list:
    """Frames for `msg`: [header bytes, tensor payloads ...] (see `encode_tensors`).
    `encoded`: `msg.tensors` encoded already (`encode_tensors`), sent as they are."""
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": int(msg.OP), "id": req_id, "src": src}
    for name, write in _schema(type(msg)).writes:  # records travel in their wire form
        value = getattr(msg, name)
        header[name] = value if write is None else write(value)
    if not carries_tensors(msg):
        return [msgpack.packb(header, use_bin_type=True)]
    if encoded is None:
        encoded = encode_tensors(msg.tensors, pack_below)
    header.update(encoded.fields)
    return [msgpack.packb(header, use_bin_type=True), *encoded.frames]


def _unpack_header(raw) -> dict:
    raw = bytes(raw)
    if len(raw) > MAX_HEADER_BYTES:  # msgpack.unpackb has no max_buffer_size argument
        raise ProtocolError(
            Status.MALFORMED, f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}"
        )
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
        raise ProtocolError(
            Status.MALFORMED,
            f"field {name!r} must be {type_name}, got {type(value).__name__}",
            req_id,
        )


class _Schema(NamedTuple):
    """A message class's header fields as the codec writes, checks and reads them."""

    # (name, writer): the writer gives a record's wire form (None: the value travels as it is)
    writes: tuple[tuple[str, Callable[[Any], Any] | None], ...]
    # (name, wire type, Python types, whether a bool is refused, whether it is required)
    checks: tuple[tuple[str, str, Any, bool, bool], ...]
    # (name, reader): the fields that hold more than their wire value, in field order
    reads: tuple[tuple[str, Callable[[Any], Any]], ...]


_schemas: dict[type[Message], _Schema] = {}


def _schema(cls: type[Message]) -> _Schema:
    """`cls`'s _Schema, worked out once per message class (on every encode and decode)."""
    schema = _schemas.get(cls)
    if schema is not None:
        return schema
    forms = [(f, wire_form(f), wire_type(f)) for f in header_fields(cls)]
    schema = _schemas[cls] = _Schema(
        writes=tuple((f.name, form.write if form else None) for f, form, _ in forms),
        checks=tuple(
            (
                f.name,
                wire,
                _TYPES[wire],
                wire in ("int", "float"),
                f.default is MISSING and f.default_factory is MISSING,
            )
            for f, _, wire in forms
        ),
        reads=tuple((f.name, form.read) for f, form, _ in forms if form is not None),
    )
    return schema


def _read_op(header: dict) -> tuple[type[Message], int, int]:
    req_id = header.get("id", 0)
    req_id = req_id if isinstance(req_id, int) and not isinstance(req_id, bool) else 0
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            Status.BAD_VERSION,
            f"protocol version {header.get('v')!r}, expected {PROTOCOL_VERSION}",
            req_id,
        )
    for key in ("op", "id", "src"):
        if key not in header:
            raise ProtocolError(Status.MALFORMED, f"missing field {key!r}", req_id)
        _check_type(key, header[key], "int", req_id)
    try:
        cls = MESSAGES[Op(header["op"])]
    except ValueError:
        raise ProtocolError(Status.UNKNOWN_OP, f"unknown op {header['op']}", req_id) from None
    return cls, req_id, header["src"]


def _read_spec(spec: Any, max_bytes: int, req_id: int) -> Spec:
    # type() rather than isinstance: msgpack makes exact lists, ints and strs, and a bool is no dim
    if not (
        type(spec) is list
        and len(spec) == 3
        and type(spec[0]) is str
        and type(spec[1]) is str
        and type(spec[2]) is list
        and all(type(d) is int and d >= 0 for d in spec[2])
    ):
        raise ProtocolError(Status.MALFORMED, f"bad tensor spec {spec!r:.80}", req_id)
    name, dtype_str, shape = spec
    dtype = _dt.DTYPES.get(dtype_str)
    if dtype is None:
        raise ProtocolError(
            Status.DTYPE_NOT_ALLOWED,
            f"tensor {name!r}: dtype {dtype_str!r} not in {sorted(_dt.DTYPES)}",
            req_id,
        )
    bound = dtype.itemsize  # >= nbytes; also bounds dims beside a 0
    for d in shape:  # stop as soon as it is too large: a shape may list thousands of huge dims
        if d > 1:
            bound *= d
            if bound > max_bytes:
                raise ProtocolError(
                    Status.TOO_LARGE,
                    f"tensor {name!r} declares more than {max_bytes} bytes, shape {shape!r:.80}",
                    req_id,
                )
    return Spec(name, dtype, tuple(shape), math.prod(shape))


def _read_encodings(raw: list, specs: list[Spec], req_id: int) -> dict[int, tuple[str, int]]:
    """The header's `enc` field (a list: `_decode_tensors` checked its type), checked entry by
    entry: tensor index -> (kind, count)."""
    out: dict[int, tuple[str, int]] = {}
    for entry in raw:
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and type(entry[0]) is int
            and 0 <= entry[0] < len(specs)
            and entry[0] not in out
        ):
            raise ProtocolError(Status.MALFORMED, f"bad 'enc' entry {entry!r:.60}", req_id)
        i, kind, count = entry
        check_encoding(kind, count, specs[i].dtype, specs[i].numel, specs[i].name, req_id)
        out[i] = (kind, count)
    return out


def _payload_size(spec: Spec, encoding: tuple[str, int] | None) -> int:
    if encoding is None:
        return spec.numel * spec.dtype.itemsize
    return payload_nbytes(encoding[0], spec.dtype, spec.numel, encoding[1])


def _dense_view(spec: Spec, payload: memoryview) -> torch.Tensor:
    if spec.numel == 0:
        return torch.empty(spec.shape, dtype=spec.dtype)
    np_dtype = _dt.NUMPY_DTYPES.get(spec.dtype)
    if np_dtype is not None:  # the same view as torch.frombuffer, in fewer calls
        return torch.from_numpy(numpy.frombuffer(payload, np_dtype).reshape(spec.shape))
    if spec.dtype == torch.bool:
        return torch.frombuffer(payload, dtype=torch.uint8).view(torch.bool).reshape(spec.shape)
    return torch.frombuffer(payload, dtype=spec.dtype).reshape(spec.shape)


def check_catalog(specs: Sequence[Spec], catalog: TensorCatalog, req_id: int = 0) -> None:
    """Raise unless every tensor is in `catalog` with the registered dtype and shape."""
    for s in specs:
        if s.name not in catalog:
            raise ProtocolError(
                Status.UNKNOWN_TENSOR, f"tensor {s.name!r} is not held here", req_id
            )
        dtype_str, shape = catalog[s.name]
        if s.shape != tuple(shape):
            raise ProtocolError(
                Status.SHAPE_MISMATCH,
                f"tensor {s.name!r}: shape {list(s.shape)}, registered {list(shape)}",
                req_id,
            )
        if _dt.DTYPE_NAMES[s.dtype] != dtype_str:
            raise ProtocolError(
                Status.DTYPE_NOT_ALLOWED,
                f"tensor {s.name!r}: dtype {_dt.DTYPE_NAMES[s.dtype]}, registered {dtype_str}",
                req_id,
            )


def _decode_tensors(
    header: dict, frames: Sequence, catalog: TensorCatalog | None, max_bytes: int, req_id: int
) -> Tensors:
    """Field types, then specs, then encodings, then frame layout and lengths, then the catalog;
    only then are tensors made (views of the frames, or decompressed). A layout seen before in
    one pack frame gives its runs with the tensors (known_layouts.py); others none."""
    for key in ("tensors", "enc", "packed"):  # field types first, like every header field
        if not isinstance(header.get(key, []), list):
            raise ProtocolError(Status.MALFORMED, f"field {key!r} must be a list", req_id)
    layout, specs, encodings, sizes = _checked_layout(header, max_bytes, req_id)
    # a layout seen before, in one pack frame of its length
    if layout is not None and layout.fits(frames):
        if catalog is not None and layout.catalog is not catalog:
            check_catalog(layout.specs, catalog, req_id)
            layout.catalog = catalog
        return layout.tensors(frames[0])
    payloads = split_frames(frames, sizes, header.get("packed", []), req_id)
    if catalog is not None:
        check_catalog(specs, catalog, req_id)
    in_pack = _pack_views(frames, specs, sizes, header.get("packed", []), encodings)
    return Tensors(
        (
            s.name,
            in_pack[i]
            if i in in_pack
            else _dense_view(s, p)
            if i not in encodings
            else decompress(*encodings[i], s.dtype, s.shape, p, s.name, req_id),
        )
        for i, (s, p) in enumerate(zip(specs, payloads))
    )


def _checked_layout(
    header: dict, max_bytes: int, req_id: int
) -> tuple[CheckedLayout | None, list[Spec], dict[int, tuple[str, int]], list[int]]:
    """The header's layout, checked: the dense one remembered (known_layouts.py; None for compressed
    tensors), the specs, the encodings and the payload sizes."""
    key = known_layouts.key_of(header, max_bytes)
    layout = known_layouts.known(key)
    if layout is not None:
        return layout, layout.specs, {}, layout.sizes
    specs = [_read_spec(s, max_bytes, req_id) for s in header.get("tensors", [])]
    if len({s.name for s in specs}) != len(specs):
        raise ProtocolError(Status.MALFORMED, "duplicate tensor names", req_id)
    encodings = _read_encodings(header.get("enc", []), specs, req_id)
    sizes = [_payload_size(s, encodings.get(i)) for i, s in enumerate(specs)]
    if key is None:
        return None, specs, encodings, sizes
    layout = CheckedLayout(specs, sizes, check_packed(header.get("packed", []), len(specs), req_id))
    known_layouts.remember(key, layout)
    return layout, specs, encodings, sizes


def _pack_views(
    frames: Sequence, specs: list[Spec], sizes: list[int], packed: list[int], encodings: dict
) -> dict[int, torch.Tensor]:
    """The dense packed tensors as views of one tensor over the pack frame
    (split_frames checked its length), so that the tensors of one dtype that
    lie back to back can be read as one run (`nonfinite_names`, the shard's
    flat gradients)."""
    if not packed:
        return {}
    pack = byte_view(frames[-1])
    if not pack.nbytes:
        return {}
    base = torch.frombuffer(pack, dtype=torch.uint8)
    as_dtype: dict = {}  # the whole frame as each dtype (its length is a multiple of ALIGN)
    views, offset = {}, 0
    for i in packed:
        s = specs[i]
        if s.numel and i not in encodings:
            dtype = s.dtype
            typed = as_dtype.get(dtype)
            if typed is None:
                typed = as_dtype[dtype] = base.view(dtype)
            views[i] = typed.as_strided(
                s.shape, contiguous_strides(s.shape), offset // dtype.itemsize
            )
        offset += aligned(sizes[i])
    return views


def decode(
    frames: Sequence,
    catalog: TensorCatalog | None = None,
    max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
) -> Envelope:
    """Validate and decode frames into an Envelope. Raises ProtocolError."""
    if not frames:
        raise ProtocolError(Status.MALFORMED, "empty message")
    header = _unpack_header(frames[0])
    cls, req_id, src = _read_op(header)
    values: dict[str, Any] = {}
    schema = _schema(cls)
    for name, type_name, want, numeric, required in schema.checks:
        if name in header:
            value = header[name]
            if not isinstance(value, want) or (numeric and isinstance(value, bool)):
                _check_type(name, value, type_name, req_id)  # raises, naming the field
            values[name] = value
        elif required:
            raise ProtocolError(Status.MALFORMED, f"{cls.OP.name}: missing field {name!r}", req_id)
    if has_tensors(cls):
        values["tensors"] = _decode_tensors(
            header, frames[1:], catalog if cls.CATALOGUED else None, max_tensor_bytes, req_id
        )
    elif len(frames) != 1:
        raise ProtocolError(
            Status.MALFORMED, f"{len(frames) - 1} tensor frames for 0 tensor specs", req_id
        )
    try:
        for name, read in schema.reads:  # the typed records (records.py); absent: the default's
            if name in values:
                values[name] = read(values[name])
        msg = cls(**values)
    except ProtocolError as err:
        raise ProtocolError(err.status, f"{cls.OP.name}: {err.message}", req_id) from None
    return Envelope(msg, req_id, src)


def nonfinite_names(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors that hold a NaN or an Inf. One
    sum per run: floating tensors of one dtype that lie back to back in one
    buffer (a pack frame, an arena; padding between them included) are
    checked as one tensor; only a run that is not all finite gets the exact
    test per tensor."""
    bad = []
    for run, names in flat_runs(tensors):
        # a finite sum proves every entry finite (a NaN or Inf makes it NaN or Inf), and costs a
        # fraction of isfinite(run).all(), which writes a mask; only a run whose sum is not finite
        # (or overflowed) gets the exact test
        if not math.isfinite(float(run.sum())) and not bool(torch.isfinite(run).all()):
            bad += [n for n in names if not bool(torch.isfinite(tensors[n]).all())]
    return bad


def error_frames(err: ProtocolError, src: int = 0) -> list:
    """Frames of the ERROR reply for a failed request."""
    return encode(Error(status=int(err.status), message=err.message), err.req_id, src)
