"""Property-based fuzzing of the wire decoder (hypothesis), pure, no sockets:
random byte frames, random msgpack headers, valid headers with a wrong-typed
value in each field (or a required field left out, or an unknown op), tensor
specs that lie (wrong byte lengths, huge shapes, zeros beside huge dims, bad
dtypes, non-list shapes, wrong spec and frame counts, duplicate names), packed
and compressed payloads that lie. `decode` must return an Envelope or raise
ProtocolError with a Status -- nothing else -- and must never allocate memory
sized by a header value: every decoded tensor is a view of exactly its own
frame. Single mutations must be refused with the status that names them.

The strategies and templates: support/wire_fuzz.py; the same messages sent to a
live shard and scheduler: tests/cluster/test_fuzz_daemons.py. Every run is
deterministic (derandomize=True, no example database).
"""

from __future__ import annotations

import math
import resource
import time

import msgpack
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from wire_fuzz import (
    DECODER_CATALOG,
    DECODER_COMPRESSED,
    DECODER_TEMPLATES,
    HUGE,
    INTS,
    PLAINLY_WRONG,
    TENSOR_OPS,
    TEXT,
    VALUES,
    M,
    add_noise,
    compressed_case,
    echo_id,
    expect,
    field_error,
    fuzz_settings,
    one_error,
    pack,
    random_frames,
    tensor_error,
)

from hetps.proto import messages as m
from hetps.proto.codec import DEFAULT_MAX_TENSOR_BYTES, DTYPES, Envelope, ProtocolError, decode
from hetps.proto.messages import MESSAGES, Op, Status, has_tensors

# Examples per decoder test: 7,200 in all.
N_RANDOM_FRAMES = 1200
N_RANDOM_HEADERS = 1200
N_FIELD_ERRORS = 1500
N_TENSOR_ERRORS = 1500
N_MIXED = 900
N_COMPRESSED = 900


# ---------------------------------------------------------------- checks


def check_decode(frames: list, catalog=None, max_bytes: int = DEFAULT_MAX_TENSOR_BYTES):
    """decode returns an Envelope or raises ProtocolError; never anything else,
    and never a tensor that is not a view of exactly its own frame."""
    try:
        env = decode(frames, catalog, max_bytes)
    except ProtocolError as err:
        assert isinstance(err.status, Status) and err.status not in (
            Status.UNSET,
            Status.INTERNAL,
        ), err
        assert isinstance(err.req_id, int)
        return err
    assert isinstance(env, Envelope) and isinstance(env.msg, m.Message)
    assert type(env.msg) is MESSAGES[env.msg.OP]
    tensors = getattr(env.msg, "tensors", {})
    compressed = {e[0] for e in msgpack.unpackb(frames[0], raw=False).get("enc", [])}
    assert len(frames) <= 2 + len(tensors)  # a frame per tensor, or fewer and a pack frame
    for i, t in enumerate(tensors.values()):
        nbytes = t.numel() * t.element_size()
        assert nbytes <= max_bytes
        # its own bytes, or (packed) those of the pack frame it is a view of: nothing allocated beside them
        assert t.untyped_storage().nbytes() in (
            nbytes,
            len(frames[-1]) if len(frames) > 1 else nbytes,
        )
        assert i in compressed or nbytes == 0 or inside_a_frame(t, frames[1:])  # a view of a frame
    return env


def inside_a_frame(t: torch.Tensor, frames: list) -> bool:
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    for f in frames:
        if len(f):
            base = torch.frombuffer(f, dtype=torch.uint8).data_ptr()
            if base <= start and end <= base + len(f):
                return True
    return False


class Budget:
    """Counts examples and bounds the process's peak memory growth over a test."""

    LIMIT_MB = 256

    def __init__(self):
        self.count = 0
        self.rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def done(self, want: int) -> None:
        grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - self.rss0) / 1024
        assert grown_mb < self.LIMIT_MB, f"peak RSS grew by {grown_mb:.0f} MB"
        assert self.count >= want, f"only {self.count} examples ran"
        print(f"{self.count} examples, peak RSS +{grown_mb:.1f} MB")


# ---------------------------------------------------------------- 1. decoder


def test_decoder_random_frames():
    budget = Budget()

    @fuzz_settings(N_RANDOM_FRAMES)
    @given(random_frames())
    @example([b""])
    @example([b"\xdd\xff\xff\xff\xff"])  # array32 claiming 4G elements
    @example([b"\xdf\xff\xff\xff\xff"])  # map32 claiming 4G entries
    @example([b"\xc6\xff\xff\xff\xff"])  # bin32 claiming 4 GiB
    @example([b"\x91" * 100_000])  # deeply nested arrays
    @example([pack({"v": 1})] + [b""] * 1000)
    def run(frames):
        budget.count += 1
        err = check_decode(frames)
        assert isinstance(err, ProtocolError), "garbage decoded"  # no template frame is whole

    run()
    budget.done(N_RANDOM_FRAMES)


SPEC = st.one_of(
    st.tuples(
        st.sampled_from(["w", "b", "x"]) | TEXT,
        st.sampled_from(sorted(DTYPES)) | TEXT | VALUES,
        st.lists(st.integers(0, 4) | HUGE | st.integers(-2, -1) | VALUES, max_size=5),
    ).map(list),
    VALUES,
)


@st.composite
def random_header_message(draw):
    """Headers assembled from the real field names with arbitrary values, and
    frames that sometimes fit the specs: these can decode, or fail anywhere."""
    op = draw(INTS) if draw(st.integers(0, 4)) == 0 else draw(st.sampled_from(list(Op)))
    t = DECODER_TEMPLATES.get(op) or DECODER_TEMPLATES[Op.PUSH]
    keys = ["v", "op", "id", "src", *t.types]
    h = {**t.header, "op": int(op), "id": draw(INTS), "src": draw(INTS)}
    for key in draw(st.sets(st.sampled_from(keys), max_size=2)):  # 0 to 2 fields damaged
        if draw(st.booleans()):
            h.pop(key, None)
        else:
            h[key] = draw(VALUES)
    if has_tensors(t.cls) and draw(st.booleans()):
        h["tensors"] = draw(st.lists(SPEC, max_size=4))
    data = []
    for spec in h.get("tensors", []) if isinstance(h.get("tensors"), list) else []:
        size = None  # the byte length the spec declares, when it is a small, sane one
        if (
            isinstance(spec, list)
            and len(spec) == 3
            and isinstance(spec[1], str)
            and spec[1] in DTYPES
            and isinstance(spec[2], list)
            and len(spec[2]) <= 8
            and all(type(d) is int and 0 <= d <= 512 for d in spec[2])
        ):
            size = math.prod(spec[2]) * DTYPES[spec[1]].itemsize
        if size is not None and size <= 512 and draw(st.integers(0, 3)):
            data.append(bytes(draw(st.binary(min_size=size, max_size=size))))
        else:
            data.append(draw(st.binary(max_size=64)))
    if draw(st.integers(0, 4)) == 0:
        data.append(draw(st.binary(max_size=16)))  # one frame too many
    return [pack(h), *data]


def test_decoder_random_headers():
    budget = Budget()
    outcome = []  # decoded op names and refusal status names

    @fuzz_settings(N_RANDOM_HEADERS)
    @given(random_header_message(), st.sampled_from([None, DECODER_CATALOG]))
    def run(frames, catalog):
        budget.count += 1
        got = check_decode(frames, catalog)
        outcome.append(got.msg.OP.name if isinstance(got, Envelope) else got.status.name)

    run()
    budget.done(N_RANDOM_HEADERS)
    outcomes = {k: outcome.count(k) for k in sorted(set(outcome))}
    print(outcomes)
    # Op and Status names differ
    n_decoded = sum(n for k, n in outcomes.items() if k in Op.__members__)
    assert n_decoded >= N_RANDOM_HEADERS // 10, outcomes  # the envelope checks ran, too


def test_decoder_field_errors():
    """Every header field, routing ones included, with a value of a wrong
    type (or left out when required, or an unknown op): refused with the
    status that names it, echoing the request id when it is readable."""
    budget = Budget()
    seen: set = set()

    @fuzz_settings(N_FIELD_ERRORS)
    @given(st.data())
    def run(data):
        budget.count += 1
        t = DECODER_TEMPLATES[data.draw(st.sampled_from(list(Op)))]
        h, frames = t.copy()
        if data.draw(st.booleans()):
            add_noise(data.draw, t, h)
        expected = field_error(data.draw, t, h)
        seen.update(k for k in t.types if h.get(k) != t.header.get(k))
        raw = pack(h)
        err = check_decode([raw, *frames], DECODER_CATALOG if data.draw(st.booleans()) else None)
        assert isinstance(err, ProtocolError), "decoded a message with a broken field"
        assert err.status in expect(raw, expected), err
        assert err.req_id == echo_id(raw)

    run()
    budget.done(N_FIELD_ERRORS)
    # a field the random draws missed (they spread over every message's fields, which grow): broken once here
    for t in DECODER_TEMPLATES.values():
        for name in sorted(
            k for k in t.types if k not in seen and k in t.header and t.types[k] in PLAINLY_WRONG
        ):
            h, frames = t.copy()
            h[name] = PLAINLY_WRONG[t.types[name]]
            raw = pack(h)
            err = check_decode([raw, *frames], None)
            assert isinstance(err, ProtocolError), f"decoded {t.op.name} with {name}={h[name]!r}"
            assert err.status in expect(raw, {M}) and err.req_id == echo_id(raw), (
                t.op.name,
                name,
                err,
            )
            seen.add(name)
    every = {k for t in DECODER_TEMPLATES.values() for k in t.types}
    assert seen == every, f"fields never broken: {sorted(every - seen)}"


def test_decoder_tensor_errors():
    """Tensor specs and frames that lie: refused with the status that names it."""
    budget = Budget()
    statuses: dict = {}

    @fuzz_settings(N_TENSOR_ERRORS)
    @given(st.data())
    @example(None)  # 300 dims of 2**62: a product of ~5,600 decimal digits
    def run(data):
        budget.count += 1
        t = DECODER_TEMPLATES[Op.PUSH]
        h, frames = t.copy()
        if data is None:
            h["tensors"][0][2] = [2**62] * 300
            expected, catalog = {Status.TOO_LARGE}, None
        else:
            t = DECODER_TEMPLATES[data.draw(st.sampled_from(TENSOR_OPS))]
            h, frames = t.copy()
            # SNAPSHOT: never checked against it
            use_catalog = data.draw(st.booleans()) and t.cls.CATALOGUED
            expected = tensor_error(data.draw, t, h, frames, use_catalog)
            catalog = DECODER_CATALOG if use_catalog else None
        raw = pack(h)
        err = check_decode([raw, *frames], catalog)
        assert isinstance(err, ProtocolError), "decoded lying tensor specs"
        assert err.status in expect(raw, expected), err
        assert err.req_id == echo_id(raw) == (7 if expect(raw, set()) == set() else 0)
        statuses[err.status.name] = statuses.get(err.status.name, 0) + 1

    run()
    budget.done(N_TENSOR_ERRORS)
    print(statuses)
    assert set(statuses) == {
        "MALFORMED",
        "TOO_LARGE",
        "DTYPE_NOT_ALLOWED",
        "UNKNOWN_TENSOR",
        "SHAPE_MISMATCH",
    }


def test_decoder_mixed_damage():
    """One certain error plus more damage and unknown keys, with and without a
    catalog and a small size limit: always a ProtocolError."""
    budget = Budget()

    @fuzz_settings(N_MIXED)
    @given(
        one_error(DECODER_TEMPLATES, catalog=False),
        st.sampled_from([None, DECODER_CATALOG]),
        st.sampled_from([DEFAULT_MAX_TENSOR_BYTES, 1 << 10]),
    )
    def run(case, catalog, max_bytes):
        budget.count += 1
        frames, expected, rid = case
        err = check_decode(frames, catalog, max_bytes)
        assert isinstance(err, ProtocolError), "decoded a broken message"
        assert err.req_id == rid
        if max_bytes == DEFAULT_MAX_TENSOR_BYTES and catalog is None:
            assert err.status in expected, err

    run()
    budget.done(N_MIXED)


def test_decoder_packed_and_compressed_errors():
    """A pack frame, `packed` and `enc` fields and topk indices that lie:
    always MALFORMED, never a crash, never a tensor beyond its declared size."""
    budget = Budget()

    @fuzz_settings(N_COMPRESSED)
    @given(compressed_case(DECODER_COMPRESSED), st.sampled_from([None, DECODER_CATALOG]))
    def run(case, catalog):
        budget.count += 1
        frames, expected, rid = case
        err = check_decode(frames, catalog)
        assert isinstance(err, ProtocolError), "decoded a lying compressed message"
        assert err.status in expected, err
        assert err.req_id == rid

    run()
    budget.done(N_COMPRESSED)


def test_huge_shapes_refused_quickly_and_briefly():
    """Regression: the size bound used to multiply every dim first, so a spec
    of 300 dims of 2**62 raised ValueError (an int past 4,300 digits in the
    error text) -- killing the daemon that decoded it -- and a 1 MB header of
    100,000 huge dims took ~30 s. Now both are TOO_LARGE at once, with a
    short message."""
    for shape in ([2**62] * 300, [2**64 - 1] * 100_000, [0] * 50_000 + [2**40] * 50_000):
        h = {**DECODER_TEMPLATES[Op.PUSH].header, "tensors": [["w", "float32", shape]]}
        started = time.monotonic()
        err = check_decode([pack(h), DECODER_TEMPLATES[Op.PUSH].data[0]])
        assert time.monotonic() - started < 5.0
        assert (
            isinstance(err, ProtocolError)
            and err.status == Status.TOO_LARGE
            and len(err.message) < 300
        )


def test_valid_messages_still_decode():
    """Sanity for the templates the fuzzers start from: unbroken, they decode."""
    for t in [*DECODER_TEMPLATES.values(), DECODER_COMPRESSED]:
        env = check_decode([pack(t.header), *t.data], DECODER_CATALOG)
        assert isinstance(env, Envelope) and env.msg.OP == t.op and env.req_id == 7
