"""A heartbeat's step records are typed at decode (proto/records.py): `step`
and `ago` required, every other field a worker sends typed and bounded, any
other key plain data. A bad record is refused with MALFORMED naming the field
(`records[i].key`), in a sender as at decode; docs/protocol.md's table of the
fields is the code's."""

from __future__ import annotations

import math

import msgpack
import pytest
from test_protocol_doc import table

from hetps.proto import messages as m
from hetps.proto.codec import decode, encode
from hetps.proto.errors import ProtocolError
from hetps.proto.messages import PROTOCOL_VERSION, Op, Status
from hetps.proto.read_values import MAX_COUNT, MAX_SECONDS
from hetps.proto.records import MAX_RECORD_AGE_S, STEP_RECORD_FIELDS, read_step_records


def beat(*records) -> list:
    """A HEARTBEAT's frames as a peer sends them, with `records` as they are."""
    header = {
        "v": PROTOCOL_VERSION,
        "op": int(Op.HEARTBEAT),
        "id": 41,
        "src": 3,
        "node_id": 3,
        "records": list(records),
    }
    return [msgpack.packb(header, use_bin_type=True)]


def refused(*records) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(beat(*records))
    assert info.value.status == Status.MALFORMED and info.value.req_id == 41, info.value
    return info.value


# what hetps's workers send (worker/trainer.py, local.py, diloco.py, overlap.py, sim/), `ago` added
TRAINER = {
    "worker": 1,
    "step": 12,
    "loss": 0.53125,
    "staleness": 2,
    "group": 0,
    "compute_s": 0.0123,
    "step_s": 0.02,
    "grad_norm": 3.5,
    "ago": 0.25,
}
AVERAGING = {
    **TRAINER,
    "grad_norm": None,  # clipping on, the norm was not finite
    "round": 3,
    "period": None,  # time-based periods (wpsgd)
    "variance": 0.125,
    "weights": [0.25, 0.75],
    "weights_round": 2,
    "wait_s": 0.001,
}


@pytest.mark.parametrize("record", [TRAINER, AVERAGING], ids=["trainer", "averaging"])
def test_what_hetps_workers_send_decodes_to_the_same_values_typed(record):
    (got,) = decode(beat(record)).msg.records
    assert got == record
    assert type(got["step"]) is int and type(got["loss"]) is float and type(got["ago"]) is float


def test_the_least_a_record_needs_is_its_step_and_when_it_ended():
    (got,) = decode(beat({"step": 0, "ago": 0})).msg.records
    assert got == {"step": 0, "ago": 0.0} and type(got["ago"]) is float


def test_a_diverged_loss_is_reported_not_refused():
    nan, inf = decode(
        beat({"step": 1, "loss": math.nan, "ago": 0}, {"step": 2, "loss": -math.inf, "ago": 0})
    ).msg.records
    assert math.isnan(nan["loss"]) and inf["loss"] == -math.inf


def test_other_keys_are_plain_data_kept_as_sent():
    (got,) = decode(
        beat({"step": 1, "ago": 0, "lr": 0.1, "note": "warm-up", "x": [1, {"a": 2}]})
    ).msg.records
    assert got["lr"] == 0.1 and got["note"] == "warm-up" and got["x"] == [1, {"a": 2}]


@pytest.mark.parametrize("missing", ["step", "ago"])
def test_a_record_without_a_required_field_is_refused_naming_it(missing):
    record = {k: v for k, v in {"step": 1, "ago": 0.1, "loss": 0.5}.items() if k != missing}
    err = refused({"step": 0, "ago": 0.0}, record)
    assert f"records[1].{missing}" in err.message and "missing" in err.message, err.message


def test_the_record_that_ended_a_run_is_refused():
    """`{"ago": 0.1}`: a step record with no step (and no worker, no loss)."""
    assert "records[0].step" in refused({"ago": 0.1}).message


COUNT = ["x", -1, 1.5, 2.0, True, None, [1], MAX_COUNT + 1]
SECONDS = ["1", -0.001, math.nan, math.inf, True, None, MAX_SECONDS * 2]
NUMBER = ["0.5", True, None, [0.5], {"v": 1}]
BAD = {
    "step": COUNT,
    "worker": COUNT,
    "staleness": COUNT,
    "group": COUNT,
    "round": COUNT,
    "weights_round": COUNT,
    "period": [c for c in COUNT if c is not None],
    "ago": [*SECONDS, MAX_RECORD_AGE_S * 1.01, 1e9],
    "compute_s": SECONDS,
    "step_s": SECONDS,
    "wait_s": SECONDS,
    "grad_norm": ["1", -1.0, math.nan, math.inf, True],
    "loss": NUMBER,
    "variance": NUMBER,
    "weights": [0.5, "0.5", [0.5, "x"], [True], {"0": 0.5}],
}


def test_every_typed_field_has_bad_values_here():
    assert set(BAD) == set(STEP_RECORD_FIELDS)


@pytest.mark.parametrize(
    "key,value", [(k, v) for k, values in BAD.items() for v in values], ids=repr
)
def test_a_bad_field_is_refused_naming_it(key, value):
    record = {"step": 1, "ago": 0.5, key: value}
    err = refused(record)
    assert f"records[0].{key}" in err.message, err.message


def test_ago_is_bounded_by_what_it_means():
    """Seconds since the step ended: at most MAX_RECORD_AGE_S (a day), not any float."""
    (ok,) = decode(beat({"step": 1, "ago": MAX_RECORD_AGE_S})).msg.records
    assert ok["ago"] == MAX_RECORD_AGE_S == 86400.0
    assert "records[0].ago" in refused({"step": 1, "ago": 1e9}).message


def test_a_sender_reads_its_records_as_the_scheduler_does():
    """A node reads its step records before they leave (runtime/membership.py), with the
    decoder's reader: a bad one is refused in the sender."""
    with pytest.raises(ProtocolError, match=r"records\[0\]\.step"):
        read_step_records([{"ago": 0.1}])
    good = m.Heartbeat(node_id=1, records=read_step_records([{"step": 4, "ago": 0.5, "loss": 1}]))
    assert good.records == [{"step": 4, "ago": 0.5, "loss": 1.0}]
    assert decode(encode(good, req_id=5)).msg.records == good.records


def test_the_protocol_docs_step_record_table_is_the_decoders():
    documented = {r["key"]: (r["type"], r["required"]) for r in table("Step records")}
    assert documented == {
        key: (f.kind, "yes" if f.required else "no") for key, f in STEP_RECORD_FIELDS.items()
    }
    assert all(r["meaning"] for r in table("Step records"))
