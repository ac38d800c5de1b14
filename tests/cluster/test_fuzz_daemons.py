"""Property-based fuzzing (hypothesis) of live daemons: a real scheduler and a
real shard (child processes, ZeroMQ over loopback, started as in
test_daemon_protocol.py), the shard INIT-ed and pushed once; then thousands of
malformed messages over raw DEALER sockets, made by the decoder's strategies
(support/wire_fuzz.py; the decoder alone: tests/unit/test_fuzz_decoder.py) and
by well-formed requests each handler must refuse. Each is answered ERROR
(echoing its request id when it has one), the daemons stay up, the shard's
tensors stay bit-identical, its version does not move, valid requests are
still served, and both exit 0 after a clean stop.

Every run is deterministic (derandomize=True, no example database).
"""

from __future__ import annotations

import json
import math
import subprocess
import time

import pytest
import torch
import zmq
from hypothesis import given
from hypothesis import strategies as st
from shard_harness import tiny_model
from test_daemon_protocol import (
    CLUSTER,
    EXIT_S,
    REPLY_S,
    START_S,
    Daemons,
    wait_for_file,
)
from wire_fuzz import (
    INTS,
    TEXT,
    VALUES,
    M,
    Template,
    add_noise,
    compressed_case,
    compressed_template,
    echo_id,
    fuzz_settings,
    one_error,
    pack,
    random_frames,
    templates,
)

from hetps.proto import messages as m
from hetps.proto.codec import decode
from hetps.proto.messages import PROTOCOL_VERSION, Op, Status
from hetps.proto.records import NodeStats

# Messages sent to the live daemons.
N_SHARD = 700  # the decoder's fuzz tests send many more of each kind
N_SCHEDULER = 400


class RawSocket:
    """One DEALER socket: send any frames, collect the replies."""

    def __init__(self, address: str):
        self.address = address
        self._connect()
        self.sent = 0
        self.answered = 0
        # garbage not answered within its wait (a loaded machine may answer later)
        self.dropped = 0
        self.statuses: dict[str, int] = {}

    def _connect(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.address)

    def recv(self, timeout_s: float):
        """The next reply within `timeout_s`, or None."""
        if self.sock.poll(max(0, int(timeout_s * 1000))):
            return decode(self.sock.recv_multipart())
        return None

    def ask(
        self, frames: list, expected: set[Status] | None, req_id: int, must_answer: bool = True
    ) -> None:
        """Send; the reply must be an ERROR with a status in `expected` (any, if
        None) echoing `req_id`. Garbage (`must_answer` False) may go unanswered."""
        self.sock.send_multipart(frames)
        self.sent += 1
        env = self.recv(REPLY_S if must_answer else 1.0)
        if env is None:
            assert not must_answer, f"no reply within {REPLY_S}s to {frames[0][:80]!r}"
            self.dropped += 1
            # a new connection: a late reply to this garbage goes to the old one and is dropped, never
            # taken for the next request's (garbage without a readable id is answered with id 0)
            self.sock.close(0)
            self._connect()
            return
        self.answered += 1
        assert isinstance(env.msg, m.Error), f"{m.describe(env.msg)} reply to {frames[0][:120]!r}"
        status = Status(env.msg.status)
        self.statuses[status.name] = self.statuses.get(status.name, 0) + 1
        assert env.req_id == req_id, f"reply id {env.req_id}, expected {req_id}: {env.msg.message}"
        if expected is not None and Status.MALFORMED in expected:
            # a mutated shape may also declare too many bytes
            expected = expected | {Status.TOO_LARGE}
        assert expected is None or status in expected, (
            f"{status.name} not in {expected}: {env.msg.message}"
        )
        assert status is not Status.INTERNAL, env.msg.message

    def assert_quiet(self) -> None:
        assert self.recv(0.5) is None, "an unexpected extra reply"

    def close(self) -> None:
        self.sock.close(0)


@st.composite
def garbage_case(draw):
    frames = draw(random_frames())
    return frames, None, echo_id(frames[0])


@st.composite
def shard_handler_case(draw, temps: dict[Op, Template], plan_id: int):
    """Well-formed PUSHes the shard's handler must refuse before applying:
    made for a plan before the placement, or carrying NaN/Inf."""
    t = temps[Op.PUSH]
    h, data = t.copy()
    add_noise(draw, t, h)
    for key in ("clock", "base_version", "n_samples"):
        h[key] = draw(INTS)
    h["info"] = draw(
        st.dictionaries(st.sampled_from(["steps", "period"]), st.integers(0, 2**40), max_size=2)
        | st.dictionaries(st.sampled_from(["lr", "weight_decay"]), st.floats(0, 10), max_size=2)
    )
    if draw(st.booleans()):
        h["plan_id"] = draw(st.integers(-(2**63), 0) | st.sampled_from([-(2**63), -1, 0]))
        expected = {Status.STALE_PLAN}
    else:
        h["plan_id"] = plan_id
        i = draw(st.integers(0, len(data) - 1))
        values = torch.frombuffer(bytearray(data[i]), dtype=torch.float32).clone()
        values[draw(st.integers(0, values.numel() - 1))] = draw(
            st.sampled_from([math.nan, math.inf, -math.inf])
        )
        data[i] = values.numpy().tobytes()
        expected = {Status.NONFINITE}
    frames = [pack(h), *data]
    return frames, expected, echo_id(frames[0])


@st.composite
def scheduler_handler_case(draw, known_ids: set[int], schema: str):
    """Well-formed requests the scheduler must refuse without a state change:
    unknown node ids with arbitrary stats, records and values; registrations
    with an unknown role or another model schema. Arbitrary stats, records
    and tensor specs may already fail their typed reading at decode
    (MALFORMED, before the handler's BAD_STATE)."""
    rid = draw(st.integers(1, 2**63 - 1))
    node = draw(INTS.filter(lambda x: x not in known_ids and -(2**63) <= x < 2**63))
    free_dict = st.dictionaries(st.text(max_size=8), VALUES, max_size=4)
    kind = draw(st.sampled_from(["heartbeat", "report", "bye", "role", "schema"]))
    if kind == "heartbeat":
        op, fields = (
            Op.HEARTBEAT,
            dict(
                node_id=node,
                stats=draw(free_dict),
                records=draw(st.lists(free_dict | VALUES, max_size=3)),
            ),
        )
        expected = {Status.BAD_STATE, M}
    elif kind == "report":
        op, fields = (
            Op.REPORT,
            dict(node_id=node, kind=draw(st.just("eval") | TEXT), values=draw(free_dict)),
        )
        # values the scheduler reads (`loss`, `final`, ...) are typed at decode
        expected = {Status.BAD_STATE, M}
    elif kind == "bye":
        op, fields = Op.BYE, dict(node_id=node, stats=draw(free_dict))
        expected = {Status.BAD_STATE, M}
    elif kind == "role":
        op, fields = (
            Op.REGISTER,
            dict(
                role=draw(TEXT.filter(lambda r: r not in ("ps", "worker", "evaluator"))),
                rank=draw(INTS),
                tensor_specs=draw(st.lists(VALUES, max_size=3)),
            ),
        )
        expected = {M}
    else:
        op, fields = (
            Op.REGISTER,
            dict(
                role="worker",
                rank=draw(INTS),
                tensor_specs=draw(st.lists(VALUES, max_size=3)),
                schema_hash=draw(TEXT.filter(lambda s: s != schema)),
                speed=draw(st.floats()),
            ),
        )
        expected = {Status.BAD_STATE, M}
    frames = [pack({"v": PROTOCOL_VERSION, "op": int(op), "id": rid, "src": node, **fields})]
    return frames, expected, rid


def fuzz_daemon(raw: RawSocket, cases, n: int) -> None:
    @fuzz_settings(n)
    @given(cases)
    def run(case):
        frames, expected, rid = case
        raw.ask(frames, expected, rid, must_answer=expected is not None)

    run()


def test_live_shard_and_scheduler_survive_fuzzing(tmp_path):
    from hetps.proto.plan import schema_hash
    from hetps.proto.rpc import RpcClient
    from hetps.runconfig.load import load_config
    from hetps.runtime.membership import Membership
    from hetps.training.state import model_specs, model_tensors

    started = time.monotonic()
    daemons = Daemons(tmp_path)
    closers = []
    try:
        daemons.start(
            "scheduler",
            [
                "-m",
                "hetps.scheduler",
                "--run-dir",
                str(tmp_path),
                "--bind",
                "tcp://127.0.0.1:0",
                *CLUSTER,
                "eval.enabled=false",
                "stop.max_seconds=600",
                "cluster.dead_after_s=600",
            ],
        )
        sched_addr = wait_for_file(tmp_path / "scheduler.addr", daemons, START_S)
        daemons.start(
            "shard", ["-m", "hetps.ps", "--rank", "0", "--scheduler", sched_addr, *CLUSTER]
        )
        cfg = load_config(
            None,
            [
                *CLUSTER,
                f"cluster.startup_timeout_s={START_S}",
                f"cluster.request_timeout_s={REPLY_S}",
            ],
        )
        model = tiny_model(batchnorm=False)
        specs = model_specs(model)
        schema = schema_hash(specs)
        member = Membership(sched_addr, "worker", 0, cfg.cluster)
        closers.append(member.close)
        node_id = member.join(tensor_specs=specs, schema_hash=schema)
        plan = member.wait_plan()
        shard_node = plan.shards[0].node_id
        shard = RpcClient(plan.shards[0].address, src=node_id, timeout_s=REPLY_S)
        closers.append(shard.close)

        # INIT with known values, then one valid push: version 1
        values = {n: t.detach().clone() for n, (t, _) in model_tensors(model).items()}
        ack = shard.call(m.Init(plan_id=plan.plan_id, tensors=values))
        assert isinstance(ack, m.Ack) and ack.info["first"] is True
        grads = {n: torch.full_like(t, 0.25) for n, t in values.items()}
        ack = shard.call(m.Push(plan_id=plan.plan_id, clock=0, base_version=0, tensors=grads))
        assert isinstance(ack, m.Ack) and ack.version == 1
        before = shard.call(m.Pull(plan_id=plan.plan_id, clock=-1))
        assert isinstance(before, m.Params) and before.version == 1
        before_tensors = {n: t.clone() for n, t in before.tensors.items()}
        # the push applied
        assert not torch.equal(before_tensors[specs[0].name], values[specs[0].name])
        setup_s = time.monotonic() - started

        # --- the shard: every op, broken header fields and lying tensors (incl.
        # catalog mismatches), garbage, and well-formed pushes it must refuse
        shard_temps = templates(values, plan.plan_id, node_id, req_id=4242)
        raw_shard = RawSocket(plan.shards[0].address)
        closers.append(raw_shard.close)
        t0 = time.monotonic()
        fuzz_daemon(
            raw_shard,
            st.one_of(
                one_error(shard_temps, catalog=True),
                one_error(shard_temps, [Op.PUSH, Op.INIT, Op.PULL], catalog=True),
                garbage_case(),
                compressed_case(compressed_template(values, plan.plan_id, node_id, req_id=4244)),
                shard_handler_case(shard_temps, plan.plan_id),
            ),
            N_SHARD,
        )
        shard_s = time.monotonic() - t0
        daemons.alive_or_fail()

        # --- the scheduler
        sched_temps = templates(values, plan.plan_id, node_id, req_id=4243)
        raw_sched = RawSocket(sched_addr)
        closers.append(raw_sched.close)
        t0 = time.monotonic()
        fuzz_daemon(
            raw_sched,
            st.one_of(
                one_error(sched_temps),
                one_error(
                    sched_temps,
                    [
                        Op.REGISTER,
                        Op.HEARTBEAT,
                        Op.STOP,
                        Op.BYE,
                        Op.GET_PLAN,
                        Op.BARRIER,
                        Op.REPORT,
                    ],
                ),
                garbage_case(),
                scheduler_handler_case({node_id, shard_node}, schema),
            ),
            N_SCHEDULER,
        )
        sched_s = time.monotonic() - t0
        raw_shard.assert_quiet()
        raw_sched.assert_quiet()
        daemons.alive_or_fail()
        print(
            f"shard: {raw_shard.sent} sent in {shard_s:.1f}s, {raw_shard.dropped} dropped, {raw_shard.statuses}"
        )
        print(
            f"scheduler: {raw_sched.sent} sent in {sched_s:.1f}s, {raw_sched.dropped} dropped, "
            f"{raw_sched.statuses}"
        )
        assert raw_shard.sent >= N_SHARD * 0.9 and raw_sched.sent >= N_SCHEDULER * 0.9

        # --- afterwards: bit-identical tensors, same version, valid requests served
        after = shard.call(m.Pull(plan_id=plan.plan_id, clock=1))
        assert isinstance(after, m.Params) and after.version == 1
        assert list(after.tensors) == list(before_tensors)
        for n, t in before_tensors.items():
            assert after.tensors[n].dtype == t.dtype and torch.equal(after.tensors[n], t), (
                f"{n} changed"
            )
        ack = member.rpc.call(
            m.Heartbeat(node_id=node_id, stats=NodeStats(steps=1)), timeout_s=REPLY_S
        )
        assert isinstance(ack, m.Ack) and ack.stop is False and ack.plan_id == plan.plan_id
        plan_now = member.wait_plan()
        assert plan_now.plan_id == plan.plan_id and plan_now.worker_ids() == [node_id]
        daemons.alive_or_fail()

        # --- a clean stop
        ctl = RpcClient(sched_addr, timeout_s=REPLY_S)
        closers.append(ctl.close)
        ack = ctl.call(m.Stop(reason="fuzz done"))
        assert isinstance(ack, m.Ack) and ack.stop is True
        member.bye({"steps": 1}, timeout_s=REPLY_S)
        deadline = time.monotonic() + EXIT_S
        for name in ("shard", "scheduler"):
            try:
                code = daemons.procs[name].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} still running {EXIT_S}s after the stop\n{daemons.tails()}")
            assert code == 0, f"{name} exited with {code}\n{daemons.tails()}"
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["stop_reason"] == "fuzz done"
        assert summary["not_left"] == []
        assert summary["shard_versions"] == {"ps0": 1}
        refused_in_handler = sum(raw_shard.statuses.get(s, 0) for s in ("STALE_PLAN", "NONFINITE"))
        # garbage dropped by the wait may still have been refused (and counted) after it
        malformed = summary["shard_stats"]["ps0"]["malformed"] + refused_in_handler
        assert raw_shard.answered <= malformed <= raw_shard.answered + raw_shard.dropped, summary[
            "shard_stats"
        ]
        assert summary["shard_stats"]["ps0"]["nonfinite"] == raw_shard.statuses.get("NONFINITE", 0)
        print(f"setup {setup_s:.1f}s, total {time.monotonic() - started:.1f}s")
    finally:
        for close in reversed(closers):
            close()
        daemons.close()  # terminates (then kills) whatever still runs, and reaps it
        print(daemons.tails())  # shown by pytest only when the test failed
