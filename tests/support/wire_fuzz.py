"""Hypothesis strategies for fuzzing the wire (proto/codec.py): one valid message
of every op as a mutable template (tensors plain, or packed and compressed),
and the mutations that break it in one way with the statuses a decoder may
answer: a header field of a wrong type or missing, an unknown op or version,
tensor specs and frames that lie, a lying pack frame or compressed payload,
garbage frames. Used by the decoder's fuzz tests (tests/unit/test_fuzz_decoder.py)
and by the fuzzing of live daemons (tests/cluster/test_fuzz_daemons.py).

Every run is deterministic (derandomize=True, no example database).
"""

from __future__ import annotations

import math
from dataclasses import MISSING

import msgpack
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from hetps.proto import messages as m
from hetps.proto.codec import DEFAULT_MAX_TENSOR_BYTES, DTYPES, MAX_HEADER_BYTES, encode
from hetps.proto.compression import (
    Compressed,
    Fp16Compressor,
    TopKCompressor,
    index_dtype,
    payload_nbytes,
)
from hetps.proto.layout import PACK_BELOW, aligned
from hetps.proto.messages import (
    MESSAGES,
    PROTOCOL_VERSION,
    Op,
    Status,
    has_tensors,
    header_fields,
    wire_type,
)
from hetps.proto.plan import TensorSpec
from hetps.proto.records import NodeStats, PushInfo, read_plan

# ---------------------------------------------------------------- settings


def fuzz_settings(n: int) -> settings:
    return settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )


# ---------------------------------------------------------------- value strategies

HUGE = st.sampled_from([2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**64 - 1, -(2**31), -(2**63)])
INTS = st.one_of(st.integers(-3, 3), st.integers(-(2**63), 2**64 - 1), HUGE)
TEXT = st.text(max_size=12)
LEAF = st.one_of(st.none(), st.booleans(), INTS, st.floats(), TEXT, st.binary(max_size=12))
VALUES = st.recursive(
    LEAF,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=6), kids, max_size=4)
    ),
    max_leaves=12,
)
# A map whose keys are not strings: the header decoder (strict_map_key) refuses it.
BAD_MAP = st.dictionaries(
    st.one_of(st.integers(-5, 5), st.booleans()), LEAF, min_size=1, max_size=3
)

KINDS = {
    "none": st.none(),
    "bool": st.booleans(),
    "int": INTS,
    "float": st.floats(),
    "str": TEXT,
    "bytes": st.binary(max_size=12),
    "list": st.lists(VALUES, max_size=4),
    "dict": st.dictionaries(st.text(max_size=6), VALUES, max_size=4),
    "badmap": BAD_MAP,
}
# one value of another type for each declared type
PLAINLY_WRONG = {"int": "x", "float": "x", "str": 7, "bool": "x", "list": 7, "dict": 7}
ACCEPTS = {
    "int": {"int"},
    "float": {"int", "float"},
    "str": {"str"},
    "bool": {"bool"},
    "list": {"list"},
    "dict": {"dict"},
}


def wrong(type_name: str):
    """Values that a field declared `type_name` must refuse."""
    return st.one_of(*[s for k, s in KINDS.items() if k not in ACCEPTS[type_name]])


# ---------------------------------------------------------------- templates

SAME_SIZE = {
    "float32": "int32",
    "int32": "float32",
    "float64": "int64",
    "int64": "float64",
    "float16": "bfloat16",
    "bfloat16": "float16",
    "uint8": "bool",
    "bool": "uint8",
}


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 4, generator=g),
        "b": torch.randn(4, generator=g, dtype=torch.float64),
        "steps": torch.tensor(5, dtype=torch.int64),
        "mask": torch.tensor([[True, False], [False, True]]),
        "h": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "e": torch.empty(0, 3),
    }


def _ids():
    return torch.tensor([0, 2], dtype=torch.int64)


def sample_messages(tensors: dict, plan_id: int = 1, node_id: int = 1) -> dict[Op, m.Message]:
    out = {
        Op.REGISTER: m.Register(
            role="worker",
            rank=0,
            address="tcp://127.0.0.1:1",
            tensor_specs=[TensorSpec("w", "float32", (3, 4), "param")],
            schema_hash="abc",
            speed=2.5,
        ),
        Op.WELCOME: m.Welcome(node_id=node_id, role="ps", rank=0),
        Op.GET_PLAN: m.GetPlan(after=plan_id),
        Op.PLAN: m.Plan(
            plan_id=plan_id,
            plan=read_plan(
                {
                    "plan_id": plan_id,
                    "algorithm": "sync",
                    "workers": [],
                    "shards": [],
                    "tensors": [],
                    "placement": {},
                }
            ),
        ),
        Op.HEARTBEAT: m.Heartbeat(
            node_id=node_id, stats=NodeStats(steps=1), records=[{"step": 1, "ago": 0.5}]
        ),
        Op.INIT: m.Init(plan_id=plan_id, tensors=tensors),
        Op.PUSH: m.Push(
            plan_id=plan_id,
            clock=0,
            base_version=0,
            n_samples=4,
            info=PushInfo(steps=1),
            tensors=tensors,
        ),
        Op.PULL: m.Pull(plan_id=plan_id, clock=-1),
        Op.PARAMS: m.Params(version=3, tensors=tensors),
        Op.ACK: m.Ack(version=1, staleness=0, plan_id=plan_id, stop=False, info={"a": 1}),
        Op.BARRIER: m.Barrier(name="start", count=2),
        Op.STOP: m.Stop(reason="fuzz"),
        Op.ERROR: m.Error(status=int(Status.MALFORMED), message="x"),
        Op.REPORT: m.Report(node_id=node_id, kind="eval", values={"accuracy": 0.5}),
        Op.BYE: m.Bye(node_id=node_id, stats=NodeStats()),
        Op.FAILED: m.Failed(
            role="worker", rank=0, error="RuntimeError: x", host="h", node_id=node_id
        ),
        Op.SNAPSHOT: m.Snapshot(
            plan=read_plan(
                {
                    "plan_id": plan_id,
                    "algorithm": "sync",
                    "workers": [],
                    "shards": [],
                    "tensors": [],
                    "placement": {},
                }
            ),
            state={"d": [["version", 1], [0, {"t": "w"}]]},
            tensors=tensors,
        ),
        # sparse tables' rows: a daemon without them must answer ERROR too
        Op.PULL_ROWS: m.PullRows(plan_id=plan_id, clock=0, tensors={"w:ids": _ids()}),
        Op.PUSH_ROWS: m.PushRows(
            plan_id=plan_id,
            clock=0,
            n_samples=4,
            tensors={"w:ids": _ids(), "w:rows": torch.ones(2, 4)},
        ),
        Op.ROWS: m.Rows(version=1, tensors={"w:rows": torch.ones(2, 4)}),
    }
    assert set(out) == set(MESSAGES), "a new message type needs a fuzz template"
    return out


class Template:
    """One valid message as a mutable header dict plus its raw tensor frames."""

    def __init__(self, msg: m.Message, req_id: int, src: int, pack_below: int = 0):
        frames = encode(msg, req_id, src, pack_below=pack_below)  # default: one frame per tensor
        self.op = msg.OP
        self.cls = type(msg)
        self.header = msgpack.unpackb(bytes(frames[0]), raw=False)
        self.data = [bytes(memoryview(f)) for f in frames[1:]]
        self.types = {
            "op": "int",
            "id": "int",
            "src": "int",
            **{f.name: wire_type(f) for f in header_fields(self.cls)},
        }
        if has_tensors(self.cls):
            # `packed`, `enc`: optional
            self.types.update(tensors="list", packed="list", enc="list")
        self.required = ["v", "op", "id", "src"] + [
            f.name
            for f in header_fields(self.cls)
            if f.default is MISSING and f.default_factory is MISSING
        ]

    def copy(self) -> tuple[dict, list]:
        h = dict(self.header)
        if "tensors" in h:
            h["tensors"] = [[s[0], s[1], list(s[2])] for s in h["tensors"]]
        if "packed" in h:
            h["packed"] = list(h["packed"])
        if "enc" in h:
            h["enc"] = [list(e) for e in h["enc"]]
        return h, list(self.data)


def templates(
    tensors: dict, plan_id: int = 1, node_id: int = 1, req_id: int = 7
) -> dict[Op, Template]:
    return {
        op: Template(msg, req_id, node_id)
        for op, msg in sample_messages(tensors, plan_id, node_id).items()
    }


def compressed_template(
    tensors: dict, plan_id: int = 1, node_id: int = 1, req_id: int = 7
) -> Template:
    """A PUSH with its float32/float64 tensors compressed (topk and fp16 in
    turn), small payloads packed into one frame."""
    coders, out = [TopKCompressor(0.2), Fp16Compressor(0.0)], {}
    floats = [
        n for n, t in tensors.items() if t.dtype in (torch.float32, torch.float64) and t.numel()
    ]
    for name, t in tensors.items():
        out[name] = (
            coders[floats.index(name) % 2].compress({name: t}, {name})[name]
            if name in floats
            else t
        )
    kinds = {v.kind for v in out.values() if isinstance(v, Compressed)}
    assert kinds == {"topk", "fp16"}, kinds
    push = m.Push(plan_id=plan_id, clock=0, base_version=0, n_samples=4, tensors=out)
    t = Template(push, req_id, node_id, pack_below=PACK_BELOW)
    assert t.header.get("packed") and t.header.get("enc")
    return t


DECODER_TENSORS = sample_tensors()
DECODER_TEMPLATES = templates(DECODER_TENSORS)
DECODER_CATALOG = {
    n: (s[1], tuple(s[2]))
    for n, s in zip(DECODER_TENSORS, DECODER_TEMPLATES[Op.PUSH].header["tensors"])
}
TENSOR_OPS = [op for op, t in DECODER_TEMPLATES.items() if has_tensors(t.cls)]
DECODER_COMPRESSED = compressed_template(DECODER_TENSORS)

# ---------------------------------------------------------------- mutations

M = Status.MALFORMED


def pack(h) -> bytes:
    return msgpack.packb(h, use_bin_type=True)


def echo_id(frame0: bytes) -> int:
    """The request id a server can echo for this header (0 if it has none)."""
    if len(frame0) > MAX_HEADER_BYTES:
        return 0
    try:
        h = msgpack.unpackb(frame0, raw=False, strict_map_key=True)
    except Exception:
        return 0
    rid = h.get("id", 0) if isinstance(h, dict) else 0
    return rid if isinstance(rid, int) and not isinstance(rid, bool) else 0


def expect(frame0: bytes, statuses: set[Status]) -> set[Status]:
    """`statuses`, unless the header as a whole no longer parses (a map with
    non-string keys anywhere in it): then MALFORMED before anything else."""
    try:
        msgpack.unpackb(frame0, raw=False, strict_map_key=True)
    except Exception:
        return {M}
    return statuses


# per set of known keys: building the filtered strategy anew for every example was a fifth of
# the decoder fuzz tests' time (the strategy, and so the drawn cases, are the same)
_NOISE: dict[frozenset, st.SearchStrategy] = {}


def add_noise(draw, t: Template, h: dict) -> None:
    """Header keys no decoder knows (ignored by the compatibility rule)."""
    known = frozenset(t.types) | {"v"}
    if known not in _NOISE:
        _NOISE[known] = st.dictionaries(
            st.text(min_size=1, max_size=8).filter(lambda k: k not in known), VALUES, max_size=3
        )
    for key, value in draw(_NOISE[known]).items():
        h[key] = value


def field_error(draw, t: Template, h: dict) -> set[Status]:
    """Break one header field; the statuses the decoder may answer."""
    kind = draw(
        st.sampled_from(
            ["wrong_type", "wrong_type", "wrong_type", "missing", "bad_op", "bad_version"]
        )
    )
    if kind == "missing":
        name = draw(st.sampled_from(t.required))
        del h[name]
        return {Status.BAD_VERSION} if name == "v" else {M}
    if kind == "bad_op":
        h["op"] = draw(
            st.one_of(st.integers(-(2**63), 2**64 - 1), HUGE, st.integers(-2, 40)).filter(
                lambda x: x not in Op._value2member_map_
            )
        )
        return {Status.UNKNOWN_OP}
    if kind == "bad_version":
        h["v"] = draw(st.one_of(wrong("int"), INTS.filter(lambda x: x != PROTOCOL_VERSION)))
        return {Status.BAD_VERSION, M}
    name = draw(st.sampled_from(sorted(t.types)))
    h[name] = draw(wrong(t.types[name]))
    return {M}


def _shape_with_numel(draw, shape: list) -> list:
    """A different shape with a different element count (so a different byte length)."""
    numel = math.prod(shape)
    new = draw(st.lists(st.integers(0, 6), max_size=4))
    if math.prod(new) == numel:
        new.append(2 if numel else 3)
        if math.prod(new) == numel:  # numel 0 and a zero dim in `new`
            new = [numel + 1]
    return new


def tensor_error(draw, t: Template, h: dict, data: list, catalog: bool = False) -> set[Status]:
    """Make the tensor part of a tensor message lie in one way; the statuses expected.
    With `catalog`, also lies that only a catalog (a shard's) can catch."""
    specs = h["tensors"]
    n = len(specs)
    kinds = [
        "frame_len",
        "huge_shape",
        "long_huge_shape",
        "bad_dtype",
        "bad_dims",
        "shape_not_list",
        "bad_spec",
        "more_frames",
        "fewer_frames",
        "more_specs",
        "fewer_specs",
        "dup_name",
        "wrong_numel",
        "tensors_not_list",
    ]
    if catalog:
        kinds += ["unknown_name", "reshape", "retype"]
    kind = draw(st.sampled_from(kinds))
    i = draw(st.integers(0, n - 1))
    name, dtype, shape = specs[i]
    itemsize = DTYPES[dtype].itemsize
    if kind == "frame_len":
        delta = draw(st.integers(-len(data[i]), 64).filter(lambda d: d != 0))
        data[i] = (
            data[i][:delta]
            if delta < 0
            else data[i] + draw(st.binary(min_size=delta, max_size=delta))
        )
        return {M}
    if kind in ("huge_shape", "long_huge_shape"):
        big = st.integers(DEFAULT_MAX_TENSOR_BYTES + 1, 2**62) | st.sampled_from(
            [2**31, 2**62, 2**63 - 1, 2**64 - 1]
        )
        if kind == "huge_shape":
            dims = draw(st.lists(st.integers(0, 8) | big, max_size=6)) + [draw(big)]
        else:  # products far beyond 4,300 decimal digits
            dims = [draw(big)] * draw(st.integers(200, 600)) + draw(
                st.lists(st.integers(0, 2), max_size=3)
            )
        specs[i] = [name, dtype, draw(st.permutations(dims))]
        return {Status.TOO_LARGE}
    if kind == "bad_dtype":
        bad = draw(
            st.sampled_from(
                [
                    "complex64",
                    "float8_e4m3fn",
                    "int8",
                    "int16",
                    "object",
                    "",
                    "FLOAT32",
                    "torch.float32",
                    "float",
                    "<f4",
                    "qint8",
                ]
            )
            | TEXT
        )
        if bad in DTYPES:
            bad = bad + "?"
        specs[i] = [name, bad, shape]
        return {Status.DTYPE_NOT_ALLOWED}
    if kind == "bad_dims":
        bad_dim = draw(
            st.integers(-(2**63), -1)
            | st.booleans()
            | st.floats()
            | TEXT
            | st.none()
            | st.lists(st.integers(0, 3), max_size=2)
            | st.binary(max_size=4)
        )
        dims = list(shape)
        dims.insert(draw(st.integers(0, len(dims))), bad_dim)
        specs[i] = [name, dtype, dims]
        return {M}
    if kind == "shape_not_list":
        specs[i] = [name, dtype, draw(wrong("list"))]
        return {M}
    if kind == "bad_spec":
        choice = draw(st.sampled_from(["not_list", "short", "long", "name", "dtype"]))
        if choice == "not_list":
            specs[i] = draw(wrong("list"))
        elif choice == "short":
            specs[i] = specs[i][: draw(st.integers(0, 2))]
        elif choice == "long":
            specs[i] = specs[i] + draw(st.lists(VALUES, min_size=1, max_size=3))
        elif choice == "name":
            specs[i] = [draw(wrong("str")), dtype, shape]
        else:
            specs[i] = [name, draw(wrong("str")), shape]
        return {M}
    if kind == "more_frames":
        data += draw(st.lists(st.binary(max_size=32), min_size=1, max_size=3))
        return {M}
    if kind == "fewer_frames":
        k = draw(st.integers(1, len(data)))
        if draw(st.booleans()):
            del data[-k:]
        else:
            del data[:k]
        return {M}
    if kind == "more_specs":
        specs += draw(st.lists(st.sampled_from(specs), min_size=1, max_size=2))
        return {M}
    if kind == "fewer_specs":
        k = draw(st.integers(1, n))
        if draw(st.booleans()):
            del specs[-k:]
        else:
            del specs[:k]
        return {M}
    if kind == "dup_name":
        j = draw(st.integers(0, n - 1).filter(lambda j: j != i))
        specs[j] = [name, specs[j][1], specs[j][2]]
        return {M}
    if kind == "wrong_numel":
        specs[i] = [name, dtype, _shape_with_numel(draw, shape)]
        return {M}
    if kind == "tensors_not_list":
        h["tensors"] = draw(wrong("list"))
        return {M}
    if kind == "unknown_name":
        taken = {s[0] for s in specs}
        specs[i] = [draw(TEXT.filter(lambda x: x not in taken)), dtype, shape]
        return {Status.UNKNOWN_TENSOR}
    if kind == "reshape":
        numel = math.prod(shape)
        specs[i] = [name, dtype, draw(st.sampled_from([[1, *shape], [*shape, 1], [numel, 1]]))]
        return {Status.SHAPE_MISMATCH}
    assert kind == "retype"
    assert DTYPES[SAME_SIZE[dtype]].itemsize == itemsize
    specs[i] = [name, SAME_SIZE[dtype], shape]
    return {Status.DTYPE_NOT_ALLOWED}


def payload_at(h: dict, data: list, i: int) -> tuple[int, int]:
    """(frame index into `data`, byte offset) of tensor i's payload in a valid packed message."""
    enc = {e[0]: e for e in h.get("enc", [])}
    sizes = []
    for j, (_, dtype, shape) in enumerate(h["tensors"]):
        numel = math.prod(shape)
        sizes.append(
            payload_nbytes(enc[j][1], DTYPES[dtype], numel, enc[j][2])
            if j in enc
            else numel * DTYPES[dtype].itemsize
        )
    packed = h.get("packed", [])
    if i in packed:
        return len(data) - 1, sum(aligned(sizes[j]) for j in packed if j < i)
    return sum(1 for j in range(i) if j not in packed), 0


def compressed_error(draw, h: dict, data: list) -> set[Status]:
    """Make the pack frame or a compressed tensor of a packed, compressed
    message lie in one way: always MALFORMED."""
    specs, packed, enc = h["tensors"], h["packed"], h["enc"]
    n = len(specs)
    kind = draw(
        st.sampled_from(
            [
                "pack_len",
                "drop_packed",
                "packed_index",
                "enc_kind",
                "enc_count",
                "enc_index",
                "enc_entry",
                "drop_enc",
                "topk_index",
            ]
        )
    )
    e = draw(st.sampled_from(enc))
    if kind == "pack_len":
        delta = draw(st.integers(-len(data[-1]), 64).filter(lambda d: d != 0))
        data[-1] = data[-1][:delta] if delta < 0 else data[-1] + bytes(delta)
    elif kind == "drop_packed":
        del h["packed"]
    elif kind == "packed_index":
        choice = draw(st.sampled_from(["out_of_range", "negative", "repeat", "reverse", "not_int"]))
        j = draw(st.integers(0, len(packed) - 1))
        if choice == "out_of_range":
            packed[-1] = draw(st.integers(n, 2**63 - 1))
        elif choice == "negative":
            packed[0] = draw(st.integers(-(2**63), -1))
        elif choice == "repeat":
            packed.insert(j, packed[j])
        elif choice == "reverse":
            packed.reverse()
        else:
            packed[j] = draw(st.booleans() | st.floats() | TEXT | st.none())
    elif kind == "enc_kind":
        e[1] = draw(VALUES.filter(lambda k: k not in ("fp16", "topk")))
    elif kind == "enc_count":
        numel, dtype = math.prod(specs[e[0]][2]), DTYPES[specs[e[0]][1]]
        slot = aligned(payload_nbytes(e[1], dtype, numel, e[2]))

        # a topk count whose payload fills the same aligned slot is a valid message
        def still_valid(c) -> bool:
            return (
                type(c) is int
                and 0 <= c <= numel
                and (
                    c == numel
                    if e[1] == "fp16"
                    else aligned(payload_nbytes("topk", dtype, numel, c)) == slot
                )
            )

        e[2] = draw(
            st.one_of(
                st.integers(-(2**63), 2**64 - 1),
                st.integers(-1, numel + 1),
                st.booleans(),
                st.floats(),
                TEXT,
            ).filter(lambda c: not still_valid(c))
        )
    elif kind == "enc_index":
        not_float = [j for j, sp in enumerate(specs) if sp[1] not in ("float32", "float64")] or [n]
        e[0] = draw(
            st.sampled_from(not_float)
            | st.integers(n, 2**63 - 1)
            | st.integers(-(2**63), -1)
            | st.booleans()
            | st.sampled_from([x[0] for x in enc if x is not e] or [-1])
        )
    elif kind == "enc_entry":
        enc[enc.index(e)] = draw(
            VALUES.filter(lambda v: not (isinstance(v, list) and len(v) == 3)) | st.just(e[:2])
        )
    elif kind == "drop_enc":
        del h["enc"]
    else:
        return topk_index_error(draw, h, data)
    return {M}


def topk_index_error(draw, h: dict, data: list) -> set[Status]:
    """Corrupt the indices of a topk payload: out of range, repeated or decreasing."""
    i, _, k = draw(st.sampled_from([e for e in h["enc"] if e[1] == "topk" and e[2] >= 2]))
    numel = math.prod(h["tensors"][i][2])
    frame, offset = payload_at(h, data, i)
    raw = bytearray(data[frame])
    index = torch.frombuffer(raw, dtype=index_dtype(numel), count=k, offset=offset)
    choice = draw(st.sampled_from(["negative", "too_large", "repeat", "decrease"]))
    if choice == "negative":
        index[draw(st.integers(0, k - 1))] = draw(st.integers(-(2**31), -1))
    elif choice == "too_large":
        index[-1] = draw(st.integers(numel, 2**31 - 1))
    elif choice == "repeat":
        j = draw(st.integers(1, k - 1))
        index[j] = index[j - 1]
    else:
        index[0], index[1] = int(index[1]), int(index[0])
    data[frame] = bytes(raw)
    return {M}


@st.composite
def compressed_case(draw, t: Template):
    """(frames, expected statuses, req id): a packed, compressed PUSH with one lie."""
    h, data = t.copy()
    add_noise(draw, t, h)
    expected = compressed_error(draw, h, data)
    frames = [pack(h), *data]
    return frames, expect(frames[0], expected), echo_id(frames[0])


@st.composite
def random_frames(draw):
    """Garbage: raw bytes, or msgpack that is not a message."""
    kind = draw(st.sampled_from(["bytes", "bytes", "msgpack", "map", "truncated"]))
    rest = draw(st.lists(st.binary(max_size=64), max_size=4))
    if kind == "bytes":
        return [draw(st.binary(max_size=256))] + rest
    if kind in ("msgpack", "map"):
        if kind == "msgpack":
            h = draw(VALUES | BAD_MAP)
        else:
            h = draw(
                st.dictionaries(
                    st.sampled_from(["v", "op", "id", "src", "tensors", "clock", "x"]) | TEXT,
                    VALUES,
                    max_size=6,
                )
            )
        if isinstance(h, dict) and type(h.get("v")) is int and h["v"] == PROTOCOL_VERSION:
            # garbage must stay garbage (a bare {v, op: STOP, id, src} would be a valid STOP)
            del h["v"]
        return [pack(h)] + rest
    t = DECODER_TEMPLATES[draw(st.sampled_from(list(Op)))]
    raw = pack(t.header)
    return [raw[: draw(st.integers(0, len(raw) - 1))]] + t.data


@st.composite
def one_error(draw, temps: dict[Op, Template], ops: list[Op] | None = None, catalog: bool = False):
    """(frames, expected statuses, expected req id): one certain error, maybe
    with more damage behind it, plus unknown header keys."""
    t = temps[draw(st.sampled_from(ops or sorted(temps)))]
    # SNAPSHOT: never checked against it (a retype decodes fine)
    catalog = catalog and t.cls.CATALOGUED
    h, data = t.copy()
    add_noise(draw, t, h)
    if has_tensors(t.cls) and draw(st.booleans()):
        expected = tensor_error(draw, t, h, data, catalog)
    else:
        expected = field_error(draw, t, h)
        if (
            has_tensors(t.cls)
            and isinstance(h.get("tensors"), list)
            and h["tensors"]
            and draw(st.booleans())
        ):
            # later damage: the field error is still reported
            tensor_error(draw, t, h, data, catalog)
        elif draw(st.integers(0, 4)) == 0:
            data += draw(st.lists(st.binary(max_size=16), max_size=2))  # frame count may be off too
    frames = [pack(h), *data]
    return frames, expect(frames[0], expected), echo_id(frames[0])
