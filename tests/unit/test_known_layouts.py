"""Repeated layouts. The decoder remembers the ones it checked
(proto/known_layouts.py): a repeated pack-frame layout decodes to the same
tensors and runs as a first one, and every check that depends on the message
or the receiver still runs. The sender keeps a template per tensor list
(proto/pack_templates.py) whose frames are the bytes of the general way.
No sockets."""

from __future__ import annotations

import msgpack
import pytest
import torch

from hetps.proto import known_layouts, pack_templates
from hetps.proto.codec import (
    DTYPE_NAMES,
    ProtocolError,
    decode,
    encode,
    encode_tensors,
    nonfinite_names,
    tensor_frame,
)
from hetps.proto.known_layouts import FrameTensors
from hetps.proto.layout import PACK_ALL_BELOW, PACK_BELOW, build_pack
from hetps.proto.messages import Push, Status
from hetps.proto.runs import flat_runs
from hetps.proto.tensors import Tensors


def mixed() -> dict:
    """Two float32 runs split by an int64 buffer, a float64 tensor, an empty one, odd sizes (padding)."""
    g = torch.Generator().manual_seed(3)
    return {
        "a": torch.randn(3, 5, generator=g),
        "b": torch.randn(7, generator=g),
        "steps": torch.tensor([4, 5, 6], dtype=torch.int64),
        "c": torch.randn(2, 3, generator=g),
        "empty": torch.empty(0, 4),
        "d": torch.randn(5, generator=g, dtype=torch.float64),
        "e": torch.randn(1, generator=g, dtype=torch.float64),
    }


def push_frames(tensors: dict, clock: int = 1) -> list:
    return [
        bytes(memoryview(f))
        for f in encode(Push(plan_id=1, clock=clock, base_version=0, tensors=tensors))
    ]


def catalog_of(tensors: dict) -> dict:
    return {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()}


def refused(frames, catalog=None) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frames, catalog)
    return info.value


def test_a_repeated_layout_decodes_to_the_same_values_and_runs_as_a_fresh_check():
    known_layouts._known.clear()
    sent = mixed()
    first = decode(push_frames(sent, 1), catalog_of(sent)).msg.tensors
    assert len(push_frames(sent)) == 2  # the header and one pack frame
    again = [{n: t * (k + 2) for n, t in sent.items()} for k in range(2)]
    for k, values in enumerate(again):
        got = decode(push_frames(values, 2 + k), catalog_of(sent)).msg.tensors
        assert isinstance(got, FrameTensors) and got.runs
        assert list(got) == list(sent)
        for n, t in values.items():
            assert got[n].dtype == t.dtype and got[n].shape == t.shape and torch.equal(got[n], t)
        fresh = flat_runs(dict(got))  # worked out from the tensors' memory, as for any dict
        assert (
            [names for _, names in got.runs]
            == [names for _, names in fresh]
            == [("a", "b"), ("c",), ("d", "e")]
        )
        assert got.layout == first.layout  # the same specs, message after message
        for (run, _), (want, _) in zip(got.runs, fresh):
            assert (
                run.data_ptr() == want.data_ptr()
                and run.shape == want.shape
                and run.dtype == want.dtype
            )
    assert first.runs


def test_decoded_tensors_cannot_be_changed_so_their_runs_stay_true():
    """A decoded push is a frozen Tensors value: no entry or attribute can be
    set; a changed mapping is a new value, which knows no runs unless given."""
    sent = mixed()
    frames = push_frames(sent)
    for change in (
        lambda t: t.__setitem__("a", torch.zeros(3, 5)),
        lambda t: t.__delitem__("b"),
        lambda t: t.pop("c"),
        lambda t: t.update(a=torch.zeros(3, 5)),
        lambda t: t.clear(),
        lambda t: setattr(t, "runs", ()),
    ):
        got = decode(frames).msg.tensors
        runs = got.runs
        with pytest.raises((TypeError, AttributeError)):
            change(got)
        assert got.runs is runs and list(got) == list(sent)
    changed = Tensors({**got, "a": torch.zeros(3, 5)})
    assert changed.runs == () and changed.layout == ()
    assert [names for _, names in flat_runs(changed)] == [
        names for _, names in flat_runs(dict(changed))
    ]


def test_decoded_tensors_keep_the_layout_order_whatever_is_read_first():
    sent = mixed()
    frames = push_frames(sent)
    decode(frames)  # the layout is remembered: the next decode makes views when read
    got = decode(frames).msg.tensors
    d = got["d"]
    assert "e" in got and "zz" not in got and len(got) == len(sent)
    assert list(got) == list(got.keys()) == list(sent) and got["d"] is d
    assert [n for n, _ in got.items()] == list(sent) and dict(got.items())["d"] is d
    for n in sent:
        assert torch.equal(got[n], sent[n]) and got[n].dtype == sent[n].dtype
    with pytest.raises(KeyError):
        got["zz"]


def test_a_lone_tensor_in_its_own_frame_is_a_remembered_layout_too():
    """A shard's push of one large tensor (a chunk: not packed) decodes through
    the remembered layout: the same values and run, and a frame of another
    length is still refused."""
    known_layouts._known.clear()
    sent = {"w": torch.randn(70_000)}  # over PACK_BELOW: a frame of its own
    frames = push_frames(sent)
    assert len(frames) == 2
    decode(frames, catalog_of(sent))
    got = decode(push_frames({"w": sent["w"] * 2}, 2), catalog_of(sent)).msg.tensors
    assert isinstance(got, FrameTensors) and list(got) == ["w"]
    assert torch.equal(got["w"], sent["w"] * 2)
    ((run, names),) = got.runs
    assert names == ("w",) and run.numel() == 70_000 and run.data_ptr() == got["w"].data_ptr()
    short = push_frames(sent)
    assert refused([short[0], short[1][:-4]], catalog_of(sent)).status == Status.MALFORMED


def test_a_nonfinite_value_is_found_through_the_remembered_runs():
    sent = mixed()
    decode(push_frames(sent))
    sent["b"][3] = float("nan")
    sent["e"][0] = float("inf")
    assert nonfinite_names(decode(push_frames(sent)).msg.tensors) == ["b", "e"]


def test_a_remembered_layout_is_checked_against_each_new_catalog():
    sent = mixed()
    frames = push_frames(sent)
    decode(frames, catalog_of(sent))
    other = {**catalog_of(sent), "c": ("float32", (3, 2))}
    assert refused(frames, other).status == Status.SHAPE_MISMATCH
    assert (
        refused(frames, {n: v for n, v in catalog_of(sent).items() if n != "d"}).status
        == Status.UNKNOWN_TENSOR
    )
    assert decode(frames, catalog_of(sent)).msg.tensors["c"].shape == (2, 3)


def test_a_remembered_layout_still_checks_each_frame():
    sent = mixed()
    header, pack = push_frames(sent)
    decode([header, pack])
    assert refused([header, pack[:-8]]).status == Status.MALFORMED
    assert refused([header, pack + bytes(8)]).status == Status.MALFORMED
    assert refused([header, pack, b""]).status == Status.MALFORMED
    assert refused([header]).status == Status.MALFORMED


@pytest.mark.parametrize(
    "packed", [[1, 0, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 9], [0, 1, 2, True, 4, 5, 6]]
)
def test_a_remembered_spec_list_with_other_packed_indices_is_checked(packed):
    sent = mixed()
    header, pack = push_frames(sent)
    decode([header, pack])
    fields = msgpack.unpackb(header)
    fields["packed"] = packed
    assert refused([msgpack.packb(fields), pack]).status == Status.MALFORMED


def test_the_remembered_layouts_are_bounded():
    known_layouts._known.clear()
    for n in range(known_layouts.MAX_LAYOUTS + 5):
        decode(push_frames({f"t{n}": torch.zeros(2), "u": torch.zeros(3)}))
    assert len(known_layouts._known) <= known_layouts.MAX_LAYOUTS


# ---------------------------------------------------------------- the sender's side (pack_templates.py)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.bool]
)
def test_a_repeated_tensor_list_packs_to_the_bytes_of_the_general_way(dtype):
    g = torch.Generator().manual_seed(5)
    shapes = [(3, 5), (7,), (), (0, 4), (2, 3, 1), (1,)]  # odd sizes: padding after most of them
    for step in range(3):  # the first makes the template, the others use it
        values = {
            f"t{i}": (torch.randn(s, generator=g) * 50).to(dtype) for i, s in enumerate(shapes)
        }
        values["t1"] = values["t1"][::1]  # a view works like any tensor
        encoded = encode_tensors(values)
        assert len(encoded.frames) == 1
        assert encoded.fields == {
            "tensors": [[n, DTYPE_NAMES[dtype], list(t.shape)] for n, t in values.items()],
            "packed": list(range(len(shapes))),
        }
        assert bytes(encoded.frames[0]) == build_pack([tensor_frame(t) for t in values.values()])
    assert (
        sum(1 for key in pack_templates._templates if key[0][0] == "t0" and key[0][1] == dtype) == 1
    )


def test_tensor_lists_a_template_does_not_fit_go_the_general_way():
    mixed_dtypes = {"a": torch.ones(3), "b": torch.ones(2, dtype=torch.float64)}
    strided = {"a": torch.arange(12.0).reshape(3, 4).t(), "b": torch.ones(2)}
    large = {"a": torch.ones(PACK_ALL_BELOW // 4), "b": torch.ones(2)}
    for values in (mixed_dtypes, strided, large):
        for _ in range(2):
            got = decode(
                encode(Push(plan_id=1, clock=0, base_version=0, tensors=values))
            ).msg.tensors
            assert all(torch.equal(got[n], t) for n, t in values.items())
    assert pack_templates.packed_fields_and_frame(mixed_dtypes, PACK_BELOW) is None
    assert pack_templates.packed_fields_and_frame(large, PACK_BELOW) is None
    assert pack_templates.packed_fields_and_frame(strided, 0) is None  # packing turned off


def test_a_disallowed_dtype_is_still_refused_when_sent_twice():
    for _ in range(2):
        with pytest.raises(ProtocolError) as info:
            encode_tensors(
                {"a": torch.ones(3, dtype=torch.int8), "b": torch.ones(2, dtype=torch.int8)}
            )
        assert info.value.status == Status.DTYPE_NOT_ALLOWED


def test_the_kept_templates_are_bounded():
    for n in range(pack_templates.MAX_TEMPLATES + 5):
        values = {f"t{n}": torch.full((3,), float(n)), "u": torch.ones(2)}
        assert torch.equal(
            decode(encode(Push(plan_id=1, clock=0, base_version=0, tensors=values))).msg.tensors[
                f"t{n}"
            ],
            values[f"t{n}"],
        )
    assert len(pack_templates._templates) <= pack_templates.MAX_TEMPLATES
