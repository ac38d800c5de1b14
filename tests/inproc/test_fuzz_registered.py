"""The typed wire boundary (proto/records.py) and the scheduler's guarded timers.

1. Decode: every statistic the scheduler counts or plans with, step records,
   push info, fused ACKs, plans and tensor specs are read into typed records;
   a wrong type, NaN, inf, a negative or huge value is refused with MALFORMED
   (a dtype outside the allow-list with DTYPE_NOT_ALLOWED) naming the field.
2. Fuzz (hypothesis, derandomized): a coordinator in this process, over the
   in-memory transport, with a shard and three workers REGISTERED through
   real frames, gets heartbeats and re-registrations from those registered
   nodes with wrong types, NaN, inf and huge values, interleaved with valid
   extreme ones; its timers run after every message (re-grouping on every
   tick). It refuses each bad one with its status, answers every valid one,
   never records a timer failure, and afterwards still answers and still
   plans: a fourth worker's registration produces a new plan.
3. A timer that fails for real (the run directory vanished) is logged and
   counted, and the other timers still run.
"""

from __future__ import annotations

import itertools
import math
import secrets
import shutil
from dataclasses import fields

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetps.proto import messages as m
from hetps.proto.codec import Envelope, decode, encode
from hetps.proto.errors import HetpsError, ProtocolError
from hetps.proto.messages import PROTOCOL_VERSION, Op, Status
from hetps.proto.plan import TensorSpec
from hetps.proto.read_values import MAX_COUNT, MAX_RATE
from hetps.proto.records import FusedAck, NodeStats, PushInfo, read_plan, read_tensor_specs
from hetps.proto.transport import MemClient, MemServer
from hetps.runconfig.load import load_config
from hetps.scheduler.coordinator import Coordinator

M, DTYPE = Status.MALFORMED, Status.DTYPE_NOT_ALLOWED
# the typed counts (`waiting` and `held`, whom a shard waits for, have their own tests in test_stall_waits.py)
COUNTS = [f.name for f in fields(NodeStats) if f.name not in ("speed", "extra", "waiting", "held")]
SPECS = [["w", "float32", [4, 3], "param"], ["b", "float32", [3], "param"]]  # as on the wire
N_EXAMPLES = 300


def header(op: Op, req_id: int, src: int, **values) -> list:
    return [
        msgpack.packb(
            {"v": PROTOCOL_VERSION, "op": int(op), "id": req_id, "src": src, **values},
            use_bin_type=True,
        )
    ]


def refused(frames: list) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    return info.value


# ---------------------------------------------------------------- 1. decode

BAD_NUMBERS = ["x", float("nan"), float("inf"), -1, 2**63, True, None, [1], {"n": 1}]


@pytest.mark.parametrize("key", [*COUNTS, "speed"])
@pytest.mark.parametrize("value", BAD_NUMBERS, ids=repr)
def test_bad_statistic_is_refused_at_decode_naming_it(key, value):
    err = refused(header(Op.HEARTBEAT, 77, 3, node_id=3, stats={key: value}, records=[]))
    assert err.status == M and err.req_id == 77 and f"stats.{key}" in err.message, err


def test_statistics_decode_into_typed_fields_and_extras():
    frames = encode(
        m.Heartbeat(
            node_id=2,
            stats=NodeStats(
                steps=5, speed=12, extra={"loss": float("nan"), "group_updates": {"0": 3}}
            ),
            records=[{"step": 5, "ago": 1}],
        )
    )
    msg = decode(frames).msg
    assert isinstance(msg.stats, NodeStats) and msg.stats.steps == 5 and msg.stats.speed == 12.0
    assert type(msg.stats.speed) is float and msg.stats.version is None
    # reported only
    assert math.isnan(msg.stats.extra["loss"]) and msg.stats.extra["group_updates"] == {"0": 3}
    assert msg.stats.get("steps") == 5 and msg.stats.get("version", 0) == 0
    assert msg.records == [{"step": 5, "ago": 1.0}]
    assert MAX_COUNT < 2**63 and MAX_RATE < 1e300  # bounds that sums and logs cannot overflow


@pytest.mark.parametrize(
    "records",
    [
        {"step": 1},
        [1],
        [{"ago": "x"}],
        [{"ago": float("nan")}],
        [{"ago": -1.0}],
        [{"t": 1.0, "ago": 0}],
        [{"kind": "x"}],
        [{"deep": [[[[[1]]]]]}],
    ],
    ids=repr,
)
def test_bad_step_records_are_refused(records):
    assert refused(header(Op.HEARTBEAT, 5, 3, node_id=3, stats={}, records=records)).status == M


@pytest.mark.parametrize(
    "spec,status",
    [
        (["w", "complex64", [2], "param"], DTYPE),
        (["w", "float8", [2], "param"], DTYPE),
        (["w", "float32", [-1], "param"], M),
        (["w", "float32", [True], "param"], M),
        (["w", "float32", [2.0], "param"], M),
        (["w", "float32", [2], "grad"], M),
        (["w", "float32", [2]], M),
        ("w", M),
    ],
    ids=repr,
)
def test_tensor_specs_are_checked_against_the_dtype_allow_list(spec, status):
    with pytest.raises(ProtocolError) as info:
        TensorSpec.from_wire(spec)
    assert info.value.status == status
    err = refused(header(Op.REGISTER, 9, 0, role="worker", rank=0, tensor_specs=[spec]))
    assert err.status == status and err.req_id == 9


def test_duplicate_tensor_names_and_bad_speeds_are_refused_at_registration():
    assert (
        refused(
            header(Op.REGISTER, 1, 0, role="worker", rank=0, tensor_specs=[SPECS[0], SPECS[0]])
        ).status
        == M
    )
    for speed in (float("nan"), float("inf"), -1.0, 1e300):
        assert refused(header(Op.REGISTER, 1, 0, role="worker", rank=0, speed=speed)).status == M


def plan_dict(**changes) -> dict:
    plan = {
        "plan_id": 2,
        "algorithm": "sync",
        "workers": [{"node_id": 2, "rank": 0, "address": ""}],
        "shards": [{"node_id": 1, "rank": 0, "address": "tcp://h:1"}],
        "tensors": SPECS,
        "placement": {"w": 0, "b": 0},
        "groups": [[2]],
        "speeds": {"1": 3.5},
    }
    return {**plan, **changes}


@pytest.mark.parametrize(
    "changes",
    [
        {"placement": {"w": 0, "b": 1}},
        {"placement": {"w": 0}},
        {"placement": {"w": 0, "b": 0, "x": 0}},
        {"groups": [[2, 9]]},
        {"speeds": {"1": float("nan")}},
        {"shares": {"2": -1.0}},
        {"workers": [{"node_id": "a"}]},
        {"tensors": [["w", "int128", [4, 3], "param"]]},
        {"algorithm": 3},
        {"plan_id": None},
    ],
    ids=repr,
)
def test_inconsistent_plans_are_refused_at_decode(changes):
    err = refused(header(Op.PLAN, 4, 0, plan_id=2, plan=plan_dict(**changes)))
    assert err.status in (M, DTYPE) and err.req_id == 4


def test_plan_decodes_into_a_checked_cluster_plan():
    plan = decode(encode(m.Plan(plan_id=2, plan=read_plan(plan_dict())))).msg.plan
    assert plan.owned(0)[0] == TensorSpec("w", "float32", (4, 3)) and plan.speeds == {"1": 3.5}


def test_push_info_and_fused_ack_are_typed_records():
    push = decode(
        encode(m.Push(plan_id=1, clock=0, base_version=0, info=PushInfo(steps=4, lr=0.1)))
    ).msg
    assert push.info == PushInfo(steps=4, lr=0.1) and push.info.as_dict() == {"steps": 4, "lr": 0.1}
    assert (
        refused(header(Op.PUSH, 3, 1, plan_id=1, clock=0, base_version=0, info={"bogus": 1})).status
        == M
    )
    ack = FusedAck(version=7, staleness=1, plan_id=2, info={"period": 4}, held_s=0.25)
    params = decode(encode(m.Params(version=7, ack=ack))).msg
    assert params.ack == ack
    assert m.Ack.of(params.ack) == m.Ack(version=7, staleness=1, plan_id=2, info={"period": 4})
    assert decode(encode(m.Params(version=7))).msg.ack is None  # a plain pull's reply
    for bad in ({"version": "x"}, {"staleness": 1}, {"version": 1, "held_s": float("inf")}):
        assert refused(header(Op.PARAMS, 3, 1, version=7, ack=bad)).status == M


def test_every_project_exception_is_a_hetps_error():
    from hetps.frontend.launcher import LaunchError
    from hetps.proto.errors import UnexpectedReply
    from hetps.proto.rpc import Aborted, RemoteError, RequestTimeout
    from hetps.proto.security import SecurityError
    from hetps.proto.transport import TransportError
    from hetps.runconfig.schema import ConfigError
    from hetps.runtime.membership import SchedulerUnreachable
    from hetps.training.data import DatasetUnavailable
    from hetps.training.models import ModelError

    for cls in (
        ConfigError,
        ProtocolError,
        UnexpectedReply,
        SchedulerUnreachable,
        Aborted,
        RemoteError,
        RequestTimeout,
        SecurityError,
        TransportError,
        LaunchError,
        DatasetUnavailable,
        ModelError,
    ):
        assert issubclass(cls, HetpsError), cls
    assert issubclass(ConfigError, ValueError)  # callers that catch the builtin keep working


# ---------------------------------------------------------------- 2. fuzz a coordinator with registered nodes


class Wire:
    """Raw frames to an in-process coordinator: each is served, then the
    timers run (as the daemon's loop does), then the reply is decoded."""

    def __init__(self, coord: Coordinator, address: str):
        self.coord = coord
        self.client = MemClient(address)
        self.ids = itertools.count(1)

    def ask(self, frames: list) -> Envelope:
        self.client.send(frames)
        assert self.coord.serve_once(5.0), "the coordinator got nothing"
        self.coord.tick()
        reply = self.client.recv(5.0)
        assert reply is not None, "the coordinator did not answer"
        return decode(reply)

    def call(self, msg: m.Message) -> m.Message:
        return self.ask(encode(msg, next(self.ids), 0)).msg


def registered_cluster(
    tmp_path, extra: list[str] = ()
) -> tuple[Coordinator, Wire, MemServer, dict]:
    cfg = load_config(
        None,
        [
            "cluster.workers=3",
            "cluster.shards=1",
            "algorithm.name=grouping",
            "algorithm.regroup_every_s=0",
            "algorithm.confirm_checks=1",
            "cluster.dead_after_s=600",
            "stop.max_seconds=600",
            *extra,
        ],
    )
    address = f"mem://fuzz-registered-{secrets.token_hex(4)}"
    server = MemServer(address)
    coord = Coordinator(server, cfg, run_dir=tmp_path)
    # a worker's NaN training loss rightly ends a run as diverged (test_run_outcome.py); this fuzz
    # is about the scheduler surviving bad values, so the divergence guard does not listen here
    coord.guard.loss = lambda value, source: None
    wire = Wire(coord, address)
    nodes = {
        "ps0": wire.call(m.Register(role="ps", rank=0, address="mem://ps0", speed=1e6)).node_id
    }
    for r, speed in enumerate((100.0, 110.0, 400.0)):
        welcome = wire.call(
            m.Register(
                role="worker",
                rank=r,
                tensor_specs=read_tensor_specs(SPECS),
                schema_hash="s",
                speed=speed,
            )
        )
        assert isinstance(welcome, m.Welcome), welcome
        nodes[f"worker{r}"] = welcome.node_id
    assert coord.plan is not None and coord.plan.plan_id == 1
    return coord, wire, server, nodes


TEXT = st.text(max_size=6)
INT64 = st.integers(-(2**63), 2**63 - 1)  # what msgpack can carry (and unsigned up to 2**64 - 1)
BAD_COUNT = st.one_of(
    TEXT,
    st.floats(),
    st.integers(-(2**63), -1),
    st.integers(MAX_COUNT + 1, 2**64 - 1),
    st.booleans(),
    st.none(),
    st.lists(INT64, max_size=2),
)
BAD_SPEED = st.one_of(
    TEXT,
    st.sampled_from([math.nan, math.inf, -math.inf, -1e-300, 1e300, 2**64 - 1]),
    st.floats(max_value=-1e-9),
    st.floats(min_value=MAX_RATE * 1.01),
    st.booleans(),
    st.none(),
    st.integers(-(2**63), -1),
)
BAD_RECORDS = st.one_of(
    st.lists(st.one_of(INT64, TEXT, st.none()), min_size=1, max_size=2),
    st.builds(
        lambda ago: [{"step": 1, "ago": ago}],
        st.one_of(TEXT, st.just(math.nan), st.just(math.inf), st.floats(max_value=-1e-9)),
    ),
    st.sampled_from([[{"t": 1.0}], [{"kind": "eval"}], [{"x": [[[[[1]]]]]}]]),
)
BAD_WAITS = st.one_of(  # a shard's `waiting`/`held` (proto/waits.py): every one of these is refused
    TEXT,
    INT64,
    st.none(),
    st.lists(INT64, min_size=1, max_size=2),
    st.builds(
        lambda node: [{"node": node, "for_s": 1.0, "waiters": []}],
        st.one_of(TEXT, st.integers(-(2**63), -1)),
    ),
    st.builds(
        lambda s: [{"node": 1, "for_s": s, "waiters": []}],
        st.sampled_from([math.nan, math.inf, -1.0, 1e300, "1"]),
    ),
    st.sampled_from(
        [
            [{"node": 1, "s": 1.0}],
            [{"node": 1, "s": 1.0, "waiters": -1}],
            [{"node": 1, "for_s": 1.0, "waiters": ["a"]}],
        ]
    ),
)
GOOD_EXTREMES = st.fixed_dictionaries(
    {
        "steps": st.sampled_from([0, 1, MAX_COUNT]),
        "speed": st.sampled_from([0.0, 1e-300, 1.0, MAX_RATE]),
        "loss": st.sampled_from([math.nan, math.inf, 0.5]),
        "bytes_sent": st.sampled_from([0, MAX_COUNT]),
    }
)


@st.composite
def registered_node_case(draw, nodes: dict, ranks: dict):
    """(header values or a message, statuses allowed in the reply); from a registered node."""
    name = draw(st.sampled_from(sorted(nodes)))
    node = nodes[name]
    kind = draw(
        st.sampled_from(
            [
                "count",
                "speed",
                "waits",
                "records",
                "reregister_speed",
                "reregister_dtype",
                "reregister_spec",
                "good",
            ]
        )
    )
    if kind == "waits":
        stats = {**draw(GOOD_EXTREMES), draw(st.sampled_from(["waiting", "held"])): draw(BAD_WAITS)}
        return header(Op.HEARTBEAT, draw(st.integers(1, 2**62)), node, node_id=node, stats=stats), {
            M
        }
    if kind in ("count", "speed"):
        key = draw(st.sampled_from(COUNTS)) if kind == "count" else "speed"
        stats = {**draw(GOOD_EXTREMES), key: draw(BAD_COUNT if kind == "count" else BAD_SPEED)}
        return header(Op.HEARTBEAT, draw(st.integers(1, 2**62)), node, node_id=node, stats=stats), {
            M
        }
    if kind == "records":
        return header(
            Op.HEARTBEAT,
            draw(st.integers(1, 2**62)),
            node,
            node_id=node,
            stats={},
            records=draw(BAD_RECORDS),
        ), {M}
    if kind == "good":  # valid, extreme: answered, and the timers plan with them
        stats = draw(GOOD_EXTREMES)
        return header(
            Op.HEARTBEAT,
            draw(st.integers(1, 2**62)),
            node,
            node_id=node,
            stats=stats,
            records=[{"step": 1, "loss": stats["loss"], "ago": 0.0}],
        ), {None}
    role, rank = ranks[name]
    again = dict(
        role=role,
        rank=rank,
        node_id=node,
        address="mem://ps0" if role == "ps" else "",
        schema_hash="s",
        tensor_specs=SPECS if role == "worker" else [],
    )
    if kind == "reregister_speed":
        again["speed"] = draw(BAD_SPEED)
        return header(Op.REGISTER, draw(st.integers(1, 2**62)), node, **again), {M}
    if kind == "reregister_dtype":
        again["tensor_specs"] = [
            [
                "w",
                draw(
                    TEXT.filter(
                        lambda d: (
                            d
                            not in (
                                "float32",
                                "float64",
                                "float16",
                                "bfloat16",
                                "int64",
                                "int32",
                                "uint8",
                                "bool",
                            )
                        )
                    )
                ),
                [4, 3],
                "param",
            ]
        ]
        return header(Op.REGISTER, draw(st.integers(1, 2**62)), node, **again), {DTYPE}
    again["tensor_specs"] = [
        ["w", "float32", [draw(st.one_of(st.integers(-(2**63), -1), st.floats(), TEXT))], "param"]
    ]
    return header(Op.REGISTER, draw(st.integers(1, 2**62)), node, **again), {M}


def test_registered_nodes_sending_bad_values_never_stop_the_scheduler_planning(tmp_path):
    coord, wire, server, nodes = registered_cluster(tmp_path)
    ranks = {name: (name.rstrip("0123456789"), int(name[-1])) for name in nodes}
    seen: dict[str, int] = {}
    try:

        @settings(
            max_examples=N_EXAMPLES,
            derandomize=True,
            database=None,
            deadline=None,
            print_blob=False,
            suppress_health_check=list(HealthCheck),
        )
        @given(registered_node_case(nodes, ranks))
        def run(case):
            frames, allowed = case
            env = wire.ask(frames)
            got = Status(env.msg.status) if isinstance(env.msg, m.Error) else None
            assert got in allowed, f"{got} not in {allowed}: {env.msg}"
            assert env.req_id == msgpack.unpackb(frames[0])["id"]
            seen[got.name if got else "ACK"] = seen.get(got.name if got else "ACK", 0) + 1
            assert coord.timer_errors == {} and coord.stop_reason is None, coord.failures

        run()
        print(f"replies: {seen}; plan {coord.plan.plan_id}")
        assert (
            seen.get("MALFORMED", 0) > 100
            and seen.get("DTYPE_NOT_ALLOWED", 0) > 10
            and seen.get("ACK", 0) > 10
        )
        assert all(math.isfinite(s) for s in coord.plan.speeds.values())

        # still answering, and still planning: a fourth worker joins and gets a new plan
        ack = wire.call(
            m.Heartbeat(node_id=nodes["worker0"], stats=NodeStats(steps=3, speed=120.0))
        )
        assert isinstance(ack, m.Ack) and ack.stop is False
        before = coord.plan.plan_id
        welcome = wire.call(
            m.Register(
                role="worker",
                rank=3,
                tensor_specs=read_tensor_specs(SPECS),
                schema_hash="s",
                speed=90.0,
            )
        )
        assert isinstance(welcome, m.Welcome)
        plan = wire.call(m.GetPlan(after=before))
        assert isinstance(plan, m.Plan) and plan.plan_id == before + 1
        assert sorted(plan.plan.worker_ids()) == sorted(
            [*(nodes[f"worker{r}"] for r in range(3)), welcome.node_id]
        )
        assert sorted(w for g in plan.plan.groups for w in g) == sorted(plan.plan.worker_ids())
        assert coord.timer_errors == {} and coord.failures == []
    finally:
        server.close()


# ---------------------------------------------------------------- 3. a timer that fails for real


def test_a_failing_timer_is_logged_and_counted_and_the_others_still_run(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    coord, wire, server, nodes = registered_cluster(run, ["stop.max_steps=50"])
    try:
        # the run directory vanished (a full or unmounted disk): state saving fails
        shutil.rmtree(run)
        coord.state_saved = -1e9  # a save is due
        # the step limit is passed
        wire.call(m.Heartbeat(node_id=nodes["worker0"], stats=NodeStats(steps=60)))
        assert coord.timer_errors == {"save_when_due": 1}
        assert [f.kind for f in coord.failures] == [
            "timer_error"
        ] and "FileNotFoundError" in coord.failures[0].error
        assert coord.stop_reason == "step limit 50"  # the timer after the failing one ran
        assert "timer save_when_due failed" in caplog.text
        coord.state_saved = -1e9
        coord.tick()
        # counted, recorded once
        assert coord.timer_errors == {"save_when_due": 2} and len(coord.failures) == 1
        ack = wire.call(m.Heartbeat(node_id=nodes["worker1"], stats=NodeStats(steps=1)))
        # still answering: now telling workers to stop
        assert isinstance(ack, m.Ack) and ack.stop is True
    finally:
        server.close()
