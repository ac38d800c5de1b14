"""The wire codec: round trips of every message and every refusal class (no sockets)."""

from __future__ import annotations

import msgpack
import pytest
import torch

from hetps.proto import messages as m
from hetps.proto.codec import ProtocolError, decode, encode, error_frames
from hetps.proto.layout import PACK_ALL_BELOW, PACK_BELOW, aligned
from hetps.proto.messages import MESSAGES, PROTOCOL_VERSION, Op, Status
from hetps.proto.plan import TensorSpec
from hetps.proto.records import NodeStats, read_plan


def sample_tensors() -> dict:
    big = torch.arange(20_000, dtype=torch.float32)  # 80 000 bytes >= 64 KiB
    assert big.numel() * big.element_size() >= 64 * 1024
    return {
        "w.f32": torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),
        "idx.i64": torch.tensor([[-5, 0, 2**40]], dtype=torch.int64),
        "h.bf16": torch.tensor([1.5, -2.25, 3e4], dtype=torch.bfloat16),
        "mask.bool": torch.tensor([[True, False], [False, True]]),
        "scalar": torch.tensor(7.25),
        "empty": torch.empty(0, 5, dtype=torch.float32),
        "big": big.reshape(100, 200),
        "noncontig": torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),
    }


SAMPLES: dict[Op, m.Message] = {
    Op.REGISTER: m.Register(
        role="ps",
        rank=3,
        address="tcp://10.0.0.1:5555",
        tensor_specs=[
            TensorSpec("fc.weight", "float32", (10, 20), "param"),
            TensorSpec("bn.running_mean", "float32", (20,), "buffer"),
        ],
        schema_hash="abc123",
    ),
    Op.WELCOME: m.Welcome(node_id=17, role="worker", rank=2),
    Op.GET_PLAN: m.GetPlan(after=41),
    Op.PLAN: m.Plan(
        plan_id=5,
        plan=read_plan(
            {
                "plan_id": 5,
                "algorithm": "ssp",
                "workers": [{"node_id": 2, "rank": 0, "address": ""}],
                "shards": [{"node_id": 1, "rank": 0, "address": "tcp://h:1"}],
                "tensors": [["a", "float32", [2, 3], "param"], ["b", "int64", [], "buffer"]],
                "placement": {"a": 0, "b": 0},
                "groups": [[2]],
                "info": {"staleness": 3, "stop": False},
            }
        ),
    ),
    Op.HEARTBEAT: m.Heartbeat(
        node_id=4,
        stats=NodeStats(steps=10, extra={"loss": 0.5}),
        records=[{"step": 1, "ago": 0.25}, {"step": 2, "ago": 0.0}],
    ),
    Op.INIT: m.Init(plan_id=2, tensors=sample_tensors()),
    Op.PUSH: m.Push(plan_id=3, clock=12, base_version=99, n_samples=32, tensors=sample_tensors()),
    Op.PULL: m.Pull(plan_id=3, clock=7),
    Op.PARAMS: m.Params(version=1234, tensors=sample_tensors()),
    Op.ACK: m.Ack(version=8, staleness=2, plan_id=6, stop=True, info={"why": "done", "n": 3}),
    Op.BARRIER: m.Barrier(name="start", count=5),
    Op.STOP: m.Stop(reason="target accuracy reached"),
    Op.ERROR: m.Error(status=int(Status.NOT_READY), message="no INIT yet"),
    Op.REPORT: m.Report(node_id=9, kind="eval", values={"accuracy": 0.93, "loss": 0.2}),
    Op.BYE: m.Bye(node_id=11, stats=NodeStats(extra={"pushes": 100})),
    Op.FAILED: m.Failed(
        role="worker", rank=3, error="ValueError: no data (at data.py:12 in load)", host="h1"
    ),
    Op.SNAPSHOT: m.Snapshot(
        plan=read_plan(
            {
                "plan_id": 5,
                "algorithm": "sync",
                "workers": [{"node_id": 2, "rank": 0, "address": ""}],
                "shards": [{"node_id": 1, "rank": 0, "address": "tcp://h:1"}],
                "tensors": [["a", "float32", [2, 3], "param"]],
                "placement": {"a": 0},
                "groups": [[2]],
            }
        ),
        state={"d": [["version", 3], [0, {"t": "w.f32"}]]},
        tensors=sample_tensors(),
    ),
    Op.PULL_ROWS: m.PullRows(plan_id=5, clock=2, tensors={"emb:ids": torch.tensor([0, 4, 8])}),
    Op.PUSH_ROWS: m.PushRows(
        plan_id=5,
        clock=2,
        n_samples=32,
        tensors={"emb:ids": torch.tensor([0, 4]), "emb:rows": torch.randn(2, 3)},
    ),
    Op.ROWS: m.Rows(version=7, tensors={"emb:rows": torch.randn(3, 3)}),
}


def test_samples_cover_every_message():
    assert set(SAMPLES) == set(MESSAGES)
    for op, msg in SAMPLES.items():
        assert type(msg) is MESSAGES[op]


def assert_same_tensors(got: dict, want: dict) -> None:
    assert list(got) == list(want)  # order is preserved
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype, name
        assert g.shape == t.shape, name
        assert torch.equal(g, t), name


def assert_same_message(got: m.Message, want: m.Message) -> None:
    assert type(got) is type(want)
    for f in m.header_fields(type(want)):
        assert getattr(got, f.name) == getattr(want, f.name), f.name
    if m.has_tensors(type(want)):
        assert_same_tensors(got.tensors, want.tensors)


def expected_frames(msg: m.Message, pack_below: int) -> int:
    """1 header + one frame per payload of `pack_below` bytes or more + one pack
    frame for the smaller ones, when there are at least two; all of them in
    one pack frame when they total at most PACK_ALL_BELOW bytes."""
    if not m.has_tensors(type(msg)):
        return 1
    sizes = [aligned(t.numel() * t.element_size()) for t in msg.tensors.values()]
    if pack_below and len(sizes) >= 2 and sum(sizes) <= PACK_ALL_BELOW:
        return 2
    small = sum(t.numel() * t.element_size() < pack_below for t in msg.tensors.values())
    return 1 + len(msg.tensors) - small + (1 if small >= 2 else small)


@pytest.mark.parametrize("pack_below", [PACK_BELOW, 0], ids=["packed", "frame-per-tensor"])
@pytest.mark.parametrize("op", list(MESSAGES), ids=lambda op: op.name)
def test_round_trip(op, pack_below):
    msg = SAMPLES[op]
    frames = encode(msg, req_id=123456, src=42, pack_below=pack_below)
    assert len(frames) == expected_frames(msg, pack_below)
    env = decode(frames)
    assert env.req_id == 123456
    assert env.src == 42
    assert_same_message(env.msg, msg)
    # also when the frames arrive as plain bytes (as from the in-process transport)
    env2 = decode([bytes(f) for f in frames])
    assert_same_message(env2.msg, msg)


def test_a_snapshot_skips_the_tensor_catalog_a_push_is_checked_against():
    """A SNAPSHOT carries optimizer moments and open rounds, not the shard's tensors."""
    catalog = {"a": ("float32", (2, 3))}
    env = decode(encode(SAMPLES[Op.SNAPSHOT]), catalog)
    assert_same_tensors(env.msg.tensors, SAMPLES[Op.SNAPSHOT].tensors)
    with pytest.raises(ProtocolError) as err:
        decode(encode(SAMPLES[Op.PUSH]), catalog)
    assert err.value.status == Status.UNKNOWN_TENSOR


def test_round_trip_defaults():
    for cls in (m.GetPlan, m.Stop, m.Ack):
        env = decode(encode(cls()))
        assert env.msg == cls()
        assert (env.req_id, env.src) == (0, 0)


def test_encode_refuses_disallowed_dtype():
    with pytest.raises(ProtocolError) as ei:
        encode(m.Params(version=1, tensors={"c": torch.zeros(2, dtype=torch.complex64)}))
    assert ei.value.status == Status.DTYPE_NOT_ALLOWED


# ------------------------------------------------------------ malformed input


def hdr(op: Op = Op.PULL, req_id: int = 77, **fields) -> dict:
    h = {"v": PROTOCOL_VERSION, "op": int(op), "id": req_id, "src": 1}
    h.update(fields)
    return h


def pack(header) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def refused(frames, catalog=None, **kw) -> ProtocolError:
    with pytest.raises(ProtocolError) as ei:
        decode(frames, catalog, **kw)
    return ei.value


def params_frames(**tensors) -> list:
    return encode(m.Params(version=1, tensors=tensors), req_id=77)


def test_bad_version():
    err = refused([pack(hdr(plan_id=1) | {"v": 99})])
    assert err.status == Status.BAD_VERSION
    assert err.req_id == 77
    err = refused([pack({k: v for k, v in hdr(plan_id=1).items() if k != "v"})])
    assert err.status == Status.BAD_VERSION


def test_truncated_frames():
    frames = params_frames(a=torch.zeros(3), b=torch.ones(2))
    err = refused(frames[:-1])
    assert err.status == Status.MALFORMED
    assert err.req_id == 77
    assert refused(frames[:1]).status == Status.MALFORMED


def test_extra_frames():
    frames = params_frames(a=torch.zeros(3))
    assert refused(frames + [b"\0" * 4]).status == Status.MALFORMED
    # a message without tensors must come as exactly one frame
    assert refused([pack(hdr(plan_id=1)), b"x"]).status == Status.MALFORMED


def test_empty_message():
    assert refused([]).status == Status.MALFORMED


@pytest.mark.parametrize("delta", [-1, 1])
def test_wrong_byte_length(delta):
    frames = params_frames(a=torch.zeros(3, dtype=torch.float32))
    data = bytes(frames[1])
    bad = data[:delta] if delta < 0 else data + b"\0"
    err = refused([frames[0], bad])
    assert err.status == Status.MALFORMED
    assert err.req_id == 77


CATALOG = {"w": ("float32", (2, 3)), "b": ("int64", (3,))}


def test_catalog_accepts_matching_tensors():
    env = decode(params_frames(w=torch.zeros(2, 3), b=torch.zeros(3, dtype=torch.int64)), CATALOG)
    assert set(env.msg.tensors) == {"w", "b"}


def test_unknown_tensor():
    err = refused(params_frames(x=torch.zeros(2, 3)), CATALOG)
    assert err.status == Status.UNKNOWN_TENSOR
    assert err.req_id == 77
    assert "x" in err.message


def test_shape_mismatch():
    err = refused(params_frames(w=torch.zeros(3, 2)), CATALOG)
    assert err.status == Status.SHAPE_MISMATCH
    assert err.req_id == 77


def test_dtype_differs_from_catalog():
    err = refused(params_frames(w=torch.zeros(2, 3, dtype=torch.float64)), CATALOG)
    assert err.status == Status.DTYPE_NOT_ALLOWED


@pytest.mark.parametrize("dtype", ["complex64", "object", "float128", ""])
def test_disallowed_dtype(dtype):
    err = refused([pack(hdr(Op.PARAMS, version=1, tensors=[["a", dtype, [2]]])), b"\0" * 16])
    assert err.status == Status.DTYPE_NOT_ALLOWED
    assert err.req_id == 77


@pytest.mark.parametrize("garbage", [b"\xc1\xc1\xc1garbage", b"hello world", b"", b"\x92\x01"])
def test_garbage_header(garbage):
    assert refused([garbage]).status == Status.MALFORMED


def test_oversized_header():
    err = refused([pack(hdr(plan_id=1, pad="x" * (2 << 20)))])
    assert err.status == Status.MALFORMED


def test_header_not_a_map():
    assert refused([pack([PROTOCOL_VERSION, int(Op.PULL), 1, 0])]).status == Status.MALFORMED
    assert refused([pack(5)]).status == Status.MALFORMED


def test_header_with_non_string_keys():
    assert refused([pack({1: 2, "v": 1})]).status == Status.MALFORMED


def test_unknown_op():
    err = refused([pack(hdr(op=99) | {"op": 99})])
    assert err.status == Status.UNKNOWN_OP
    assert err.req_id == 77


@pytest.mark.parametrize("key", ["op", "id", "src"])
def test_missing_routing_field(key):
    h = hdr(plan_id=1)
    del h[key]
    assert refused([pack(h)]).status == Status.MALFORMED


def test_missing_required_field():
    err = refused([pack(hdr(Op.PUSH, plan_id=1, base_version=0, tensors=[]))])
    assert err.status == Status.MALFORMED
    assert err.req_id == 77
    assert "clock" in err.message


@pytest.mark.parametrize(
    "fields",
    [
        {"clock": "3"},
        {"clock": True},
        {"clock": 1.5},
        {"n_samples": None},
        {"plan_id": [1]},
    ],
)
def test_wrong_field_type(fields):
    h = hdr(Op.PUSH, plan_id=1, clock=0, base_version=0, tensors=[]) | fields
    err = refused([pack(h)])
    assert err.status == Status.MALFORMED
    assert err.req_id == 77


def test_wrong_field_type_other_kinds():
    assert refused([pack(hdr(Op.ACK, stop=1))]).status == Status.MALFORMED  # int for bool
    # list for dict
    assert refused([pack(hdr(Op.PLAN, plan_id=1, plan=[1]))]).status == Status.MALFORMED
    assert refused([pack(hdr(Op.STOP, reason=b"bytes"))]).status == Status.MALFORMED  # bin for str
    assert refused([pack(hdr(plan_id=1) | {"src": "me"})]).status == Status.MALFORMED


def test_bad_request_id_is_not_echoed():
    err = refused([pack(hdr(plan_id=1) | {"id": "x"})])
    assert err.status == Status.MALFORMED
    assert err.req_id == 0


@pytest.mark.parametrize(
    "shape", [[2**40, 2**40], [2**62, 2**62, 0], [2**30, 2**30, 2**30, 0], [2**64 - 1, 0]]
)
def test_absurd_size_is_too_large(shape):
    err = refused([pack(hdr(Op.PARAMS, version=1, tensors=[["a", "float32", shape]])), b""])
    assert err.status == Status.TOO_LARGE
    assert err.req_id == 77


def test_max_tensor_bytes_is_enforced():
    frames = params_frames(a=torch.zeros(100))  # 400 bytes
    assert refused(frames, max_tensor_bytes=399).status == Status.TOO_LARGE
    assert decode(frames, max_tensor_bytes=400).msg.tensors["a"].shape == (100,)


@pytest.mark.parametrize(
    "spec",
    [
        ["a", "float32", [-1, 4]],
        ["a", "float32", [2, 2.0]],
        ["a", "float32", [True]],
        ["a", "float32"],
        ["a", "float32", 4],
        [1, "float32", [1]],
        "a:float32:4",
    ],
)
def test_bad_tensor_spec(spec):
    err = refused([pack(hdr(Op.PARAMS, version=1, tensors=[spec])), b"\0" * 16])
    assert err.status == Status.MALFORMED
    assert err.req_id == 77


@pytest.mark.parametrize("dims", [[True, 4], [1.0, 4], [1, 4.0]])
def test_a_remembered_layout_is_not_reused_for_a_lookalike_spec(dims):
    """A header that repeats the last checked layout skips the spec checks,
    but one equal to it only under `==` (True == 1 == 1.0) is checked and refused."""
    good = pack(hdr(Op.PARAMS, version=1, tensors=[["a", "float32", [1, 4]]]))
    assert decode([good, b"\0" * 16]).msg.tensors["a"].shape == (1, 4)
    assert decode([good, b"\0" * 16]).msg.tensors["a"].shape == (1, 4)  # the remembered layout
    err = refused([pack(hdr(Op.PARAMS, version=1, tensors=[["a", "float32", dims]])), b"\0" * 16])
    assert err.status == Status.MALFORMED


def test_a_remembered_layout_still_meets_each_limit_and_frame_check():
    frames = params_frames(a=torch.zeros(100))  # 400 bytes
    assert decode(frames).msg.tensors["a"].shape == (100,)
    assert refused(frames, max_tensor_bytes=399).status == Status.TOO_LARGE
    assert refused([frames[0], bytes(frames[1])[:-4]]).status == Status.MALFORMED
    assert refused(frames, {"a": ("float32", (99,))}).status == Status.SHAPE_MISMATCH


def test_tensors_not_a_list():
    err = refused([pack(hdr(Op.PARAMS, version=1, tensors={"a": "float32"})), b"\0" * 4])
    assert err.status == Status.MALFORMED


def test_duplicate_tensor_names():
    h = hdr(Op.PARAMS, version=1, tensors=[["a", "float32", [1]], ["a", "float32", [1]]])
    err = refused([pack(h), b"\0" * 4, b"\0" * 4])
    assert err.status == Status.MALFORMED
    assert err.req_id == 77


def test_unknown_header_keys_are_ignored():
    h = hdr(Op.PULL, plan_id=4, clock=2, future_field={"x": [1, 2]}, another=7)
    env = decode([pack(h)])
    assert env.msg == m.Pull(plan_id=4, clock=2)
    assert env.req_id == 77
    # tensors on a message that has none are ignored too
    env = decode([pack(hdr(Op.BARRIER, name="b", count=2, tensors=[]))])
    assert env.msg == m.Barrier(name="b", count=2)


def test_error_frames():
    err = ProtocolError(Status.SHAPE_MISMATCH, "tensor 'w' has the wrong shape", req_id=31)
    env = decode(error_frames(err, src=5))
    assert env.msg == m.Error(
        status=int(Status.SHAPE_MISMATCH), message="tensor 'w' has the wrong shape"
    )
    assert Status(env.msg.status) is Status.SHAPE_MISMATCH
    assert (env.req_id, env.src) == (31, 5)


def test_error_frames_from_a_real_refusal():
    err = refused([pack(hdr(plan_id=1) | {"v": 0, "id": 9})])
    env = decode(error_frames(err))
    assert env.msg.status == Status.BAD_VERSION
    assert env.req_id == 9


# ------------------------------------------------------------ zero-copy


def test_decoded_large_tensor_shares_the_received_buffer():
    t = torch.randn(64, 1024, generator=torch.Generator().manual_seed(1))  # 256 KiB
    frames = encode(m.Params(version=3, tensors={"big": t, "small": torch.ones(2)}), req_id=5)
    received = [bytearray(f) for f in frames]  # stands in for the transport's receive buffers
    env = decode([memoryview(b) for b in received])
    got = env.msg.tensors["big"]
    assert torch.equal(got, t)
    buf = received[1]
    start = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    assert start <= got.data_ptr() < start + len(buf)
    assert got.data_ptr() + got.numel() * got.element_size() <= start + len(buf)
    # the tensor really is a view: a change to the buffer shows through
    buf[0:4] = torch.tensor([123.0]).numpy().tobytes()
    assert got.reshape(-1)[0].item() == 123.0


def test_decoded_bool_tensor_shares_the_received_buffer():
    mask = torch.arange(100_000) % 3 == 0
    frames = encode(m.Params(version=1, tensors={"mask": mask}))
    received = [bytearray(f) for f in frames]
    got = decode([memoryview(b) for b in received]).msg.tensors["mask"]
    assert got.dtype == torch.bool and torch.equal(got, mask)
    start = torch.frombuffer(received[1], dtype=torch.uint8).data_ptr()
    assert start <= got.data_ptr() < start + len(received[1])


def test_encode_large_tensor_without_copy():
    t = torch.zeros(32_768)  # 128 KiB, contiguous
    frames = encode(m.Params(version=1, tensors={"t": t}))
    view = memoryview(frames[1])
    assert view.nbytes == t.numel() * 4
    assert torch.frombuffer(view, dtype=torch.uint8).data_ptr() == t.data_ptr()


@pytest.mark.parametrize(
    "values, where",
    [
        ({"accuracy": "high"}, "values.accuracy"),
        ({"loss": "low"}, "values.loss"),
        ({"metrics": {"r2": "0.9"}}, "values.metrics.r2"),
        ({"num_classes": "ten"}, "values.num_classes"),
        ({"final": "yes"}, "values.final"),
        ({"watch": 3}, "values.watch"),
        ({"higher_is_better": {"r2": "yes"}}, "values.higher_is_better.r2"),
        ({"versions": ["a"]}, "values.versions"),
    ],
)
def test_a_report_value_of_the_wrong_type_is_malformed_at_decode(values, where):
    err = refused([pack(hdr(Op.REPORT, node_id=3, kind="eval", values=values))])
    assert err.status == Status.MALFORMED and where in err.message, err.message


def test_report_values_of_their_types_decode_as_sent():
    values = {
        "metrics": {"loss": float("nan"), "r2": 1},
        "higher_is_better": {"r2": True},
        "watch": "r2",
        "loss": float("inf"),  # a diverged loss is worth reporting
        "num_classes": None,
        "final": True,
        "versions": [3, 4],
        "eval_s": 0.2,  # a field the scheduler does not know: plain data
    }
    got = decode([pack(hdr(Op.REPORT, node_id=3, kind="eval", values=values))]).msg.values
    assert got["metrics"]["r2"] == 1.0 and got["loss"] == float("inf")
    assert {k: v for k, v in got.items() if k not in ("metrics", "loss")} == {
        k: v for k, v in values.items() if k not in ("metrics", "loss")
    }
