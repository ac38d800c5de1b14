"""docs/protocol.md against the code: its tables of op codes, status codes,
message fields, header keys, dtypes, constants and plan fields must say what
proto/ does, so the reference fails this test when either side drifts."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from hetps.proto import codec, layout, messages
from hetps.proto.plan import ClusterPlan

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def table(heading: str) -> list[dict[str, str]]:
    """The first markdown table under `heading` (a `#`-line), as rows keyed by
    the header cells; backticks are dropped from every cell."""
    lines = DOC.read_text().splitlines()
    start = next(
        i
        for i, line in enumerate(lines)
        if line.lstrip("#").strip() == heading and line.startswith("#")
    )
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append([c.strip().replace("`", "") for c in line.strip().strip("|").split("|")])
        elif rows:
            break
    assert len(rows) > 2 and set(rows[1][0]) <= set("-: "), f"no table under {heading!r}"
    return [dict(zip(rows[0], r)) for r in rows[2:]]


def test_op_codes_are_the_op_enum():
    documented = {(int(r["code"]), r["op"]) for r in table("Op codes")}
    assert documented == {(int(op), op.name) for op in messages.Op}


def test_status_codes_are_the_status_enum_each_with_a_meaning():
    rows = table("Status codes")
    assert {(int(r["code"]), r["status"]) for r in rows} == {
        (int(s), s.name) for s in messages.Status
    }
    assert all(r["meaning"] for r in rows)


def wire_type(field: dataclasses.Field) -> str:
    return "tensors" if field.name == "tensors" else messages.wire_type(field)


@pytest.mark.parametrize("op", list(messages.Op), ids=lambda op: op.name)
def test_every_message_field_is_documented_with_its_type_and_whether_required(op):
    cls = messages.MESSAGES[op]
    want = {
        f.name: (
            wire_type(f),
            "yes"
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            else "no",
        )
        for f in dataclasses.fields(cls)
    }
    got = {
        r["field"]: (r["type"], r["required"])
        for r in table("Message fields")
        if r["op"] == op.name
    }
    assert got == want


def test_message_field_table_names_only_real_ops():
    assert {r["op"] for r in table("Message fields")} <= {op.name for op in messages.Op}


def test_header_keys_and_dtypes():
    keys = {r["key"]: r for r in table("Header keys")}
    assert set(keys) == {"v", "op", "id", "src", "tensors", "packed", "enc"}
    assert all(keys[k]["required"] == "yes" for k in ("v", "op", "id", "src"))
    dtypes = {r["dtype"]: int(r["bytes per element"]) for r in table("Tensor frames")}
    assert dtypes == {name: d.itemsize for name, d in codec.DTYPES.items()}
    text = DOC.read_text()
    assert (
        codec.BYTE_ORDER == "little"
        and "**little-endian**" in text
        and "**C-contiguous (row-major)**" in text
    )


def test_constants():
    values = {r["constant"]: int(r["value"]) for r in table("Constants")}
    assert values == {
        "PROTOCOL_VERSION": messages.PROTOCOL_VERSION,
        "PACK_BELOW": layout.PACK_BELOW,
        "PACK_ALL_BELOW": layout.PACK_ALL_BELOW,
        "ALIGN": layout.ALIGN,
        "ZERO_COPY_BYTES": messages.ZERO_COPY_BYTES,
        "MAX_HEADER_BYTES": codec.MAX_HEADER_BYTES,
    }
    text = DOC.read_text()
    assert f"must equal the receiver's ({messages.PROTOCOL_VERSION})" in text
    assert (
        f"smaller than {layout.PACK_BELOW:,} bytes" in text
        and f"multiple of {layout.ALIGN} bytes" in text
    )
    assert f"total at most\n{layout.PACK_ALL_BELOW:,} bytes" in text


def test_plan_fields_are_the_plans_dict():
    documented = {r["key"] for r in table("Plan fields")}
    assert documented == {f.name for f in dataclasses.fields(ClusterPlan)}


def test_the_pack_layout_described_is_what_encode_makes():
    """Two small tensors and a large one (the three more than PACK_ALL_BELOW
    bytes): the large one in its own frame, the small ones packed in the last
    frame, each padded to 8 bytes, little-endian."""
    import torch

    from hetps.proto.messages import Push

    big = torch.arange(layout.PACK_ALL_BELOW // 4, dtype=torch.float32)
    small = {
        "a": torch.tensor([1, 2, 3], dtype=torch.int32),
        "b": torch.tensor([[1.5]], dtype=torch.float64),
    }
    frames = codec.encode(
        Push(
            plan_id=1,
            clock=0,
            base_version=0,
            tensors={"a": small["a"], "big": big, "b": small["b"]},
        ),
        req_id=7,
    )
    assert len(frames) == 1 + 1 + 1
    assert bytes(frames[1]) == big.numpy().astype("<f4").tobytes()
    pack = bytes(frames[2])
    assert pack == (
        small["a"].numpy().astype("<i4").tobytes()
        + bytes(4)
        + small["b"].numpy().astype("<f8").tobytes()
    )
    header = codec._unpack_header(frames[0])
    assert header["packed"] == [0, 2] and header["tensors"][1] == [
        "big",
        "float32",
        [layout.PACK_ALL_BELOW // 4],
    ]
    assert re.fullmatch(r"\d+", str(header["id"])) and header["v"] == messages.PROTOCOL_VERSION


def test_a_small_message_is_one_pack_frame():
    """Payloads totalling at most PACK_ALL_BELOW bytes: all of them, the one
    of PACK_BELOW bytes too, back to back in the one pack frame."""
    import torch

    from hetps.proto.messages import Push

    big = torch.arange(layout.PACK_BELOW // 4, dtype=torch.float32)
    small = torch.tensor([1, 2, 3], dtype=torch.int32)
    frames = codec.encode(
        Push(plan_id=1, clock=0, base_version=0, tensors={"a": small, "big": big}), req_id=7
    )
    assert len(frames) == 1 + 1
    assert (
        bytes(frames[1])
        == small.numpy().astype("<i4").tobytes() + bytes(4) + big.numpy().astype("<f4").tobytes()
    )
    assert codec._unpack_header(frames[0])["packed"] == [0, 1]
