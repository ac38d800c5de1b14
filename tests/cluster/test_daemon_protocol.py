"""Real daemons, real ZeroMQ over tcp: for each malformed class the right ERROR
code comes back and the daemon serves a following valid request.

One scheduler and one shard run as child processes on random loopback ports;
the test itself is the (only) worker: it joins through Membership, then sends
hand-made frames with raw DEALER sockets and valid requests with RpcClient.
Finally it stops the run and checks that both daemons exit 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
from shard_harness import tiny_model

from hetps.proto.codec import decode, encode
from hetps.proto.messages import (
    PROTOCOL_VERSION,
    Ack,
    Error,
    Heartbeat,
    Init,
    Op,
    Params,
    Pull,
    Push,
    Status,
    Stop,
)
from hetps.proto.plan import schema_hash
from hetps.proto.records import NodeStats
from hetps.proto.rpc import RemoteError, RpcClient
from hetps.runconfig.load import load_config
from hetps.runtime.membership import Membership
from hetps.training.state import model_specs, model_tensors

pytestmark = pytest.mark.cluster

START_S = 30.0  # daemon start-up (imports torch) and cluster formation
REPLY_S = 5.0  # any single reply
EXIT_S = 30.0  # both daemons gone after the stop
# the test is the worker and sends no heartbeats between its requests: it must not be declared dead
# while a loaded machine runs the shard cases
CLUSTER = ["cluster.workers=1", "cluster.shards=1", "cluster.dead_after_s=120"]


# ---------------------------------------------------------------- processes


class Daemons:
    """Child processes with logs in the run dir; every one is reaped in `close`."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.files = []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("HETPS_")}
        self.env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        out = open(self.run_dir / f"{name}.out", "wb")
        err = open(self.run_dir / f"{name}.err", "wb")
        self.files += [out, err]
        proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=self.env,
            cwd=self.run_dir,
        )
        self.procs[name] = proc
        return proc

    def alive_or_fail(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                pytest.fail(f"{name} exited early with {proc.returncode}\n{self.tails()}")

    def tails(self, n: int = 40) -> str:
        parts = []
        for name in self.procs:
            for ext in ("out", "err"):
                path = self.run_dir / f"{name}.{ext}"
                if path.exists():
                    lines = path.read_text(errors="replace").splitlines()[-n:]
                    parts.append(
                        f"----- {name}.{ext} (last {len(lines)} lines)\n" + "\n".join(lines)
                    )
        return "\n".join(parts)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for f in self.files:
            f.close()


@pytest.fixture
def daemons(tmp_path):
    d = Daemons(tmp_path)
    try:
        yield d
    finally:
        d.close()
        print(d.tails())  # shown by pytest only when the test failed


def wait_for_file(path: Path, daemons: Daemons, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            text = path.read_text().strip()
            if text:
                return text
        daemons.alive_or_fail()
        time.sleep(0.05)
    pytest.fail(f"{path.name} not written within {timeout_s}s\n{daemons.tails()}")


# ---------------------------------------------------------------- raw frames


class Raw:
    """A raw DEALER socket: send any frames, read back one decoded reply."""

    def __init__(self, address: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def ask(self, frames: list) -> tuple[Error, int]:
        self.sock.send_multipart([bytes(memoryview(f)) for f in frames])
        if not self.sock.poll(int(REPLY_S * 1000)):
            raise AssertionError(f"no reply within {REPLY_S}s")
        env = decode(self.sock.recv_multipart())
        assert isinstance(env.msg, Error), env.msg
        return env.msg, env.req_id

    def close(self) -> None:
        self.sock.close(0)


def header(frames: list) -> dict:
    return msgpack.unpackb(bytes(frames[0]), raw=False)


def with_header(h: dict, data: list) -> list:
    return [msgpack.packb(h, use_bin_type=True), *data]


def shard_cases(plan_id: int, node_id: int, grads: dict) -> list[tuple[str, list, Status, int]]:
    """(name, frames, expected status, expected echoed req id) for each malformed class."""
    push = encode(
        Push(plan_id=plan_id, clock=0, base_version=0, tensors=grads),
        req_id=1000,
        src=node_id,
        # one frame per tensor, so that each case can break one tensor's frame
        pack_below=0,
    )
    h, data = header(push), [bytes(memoryview(f)) for f in push[1:]]
    specs = h["tensors"]
    cases = []

    def case(name, frames, status, req_id):
        cases.append((name, frames, status, req_id))

    def variant(req_id, **changes):
        return {**h, "id": req_id, **changes}

    case(
        "bad version",
        with_header(variant(1001, v=PROTOCOL_VERSION + 1), data),
        Status.BAD_VERSION,
        1001,
    )
    case(
        "version missing",
        with_header({k: v for k, v in variant(1002).items() if k != "v"}, data),
        Status.BAD_VERSION,
        1002,
    )
    case(
        "truncated frames",
        with_header(variant(1003, tensors=specs[:2]), data[:1]),
        Status.MALFORMED,
        1003,
    )
    case("extra frames", with_header(variant(1004), [*data, data[0]]), Status.MALFORMED, 1004)
    case("no tensor frames", with_header(variant(1005), []), Status.MALFORMED, 1005)
    short = [data[0][:-4], *data[1:]]
    case("wrong byte length", with_header(variant(1006), short), Status.MALFORMED, 1006)
    case(
        "unknown tensor",
        with_header(variant(1007, tensors=[["ghost", *specs[0][1:]], *specs[1:]]), data),
        Status.UNKNOWN_TENSOR,
        1007,
    )
    n = 1
    for d in specs[0][2]:
        n *= d
    reshaped = [specs[0][0], specs[0][1], [n]]  # same bytes, other shape
    case(
        "wrong shape",
        with_header(variant(1008, tensors=[reshaped, *specs[1:]]), data),
        Status.SHAPE_MISMATCH,
        1008,
    )
    case(
        "dtype outside the allow-list",
        with_header(
            variant(1009, tensors=[[specs[0][0], "complex64", specs[0][2]], *specs[1:]]), data
        ),
        Status.DTYPE_NOT_ALLOWED,
        1009,
    )
    as_double = [*data]
    as_double[0] = bytes(
        memoryview(torch.zeros(specs[0][2], dtype=torch.float64).numpy()).cast("B")
    )
    case(
        "dtype not the registered one",
        with_header(
            variant(1010, tensors=[[specs[0][0], "float64", specs[0][2]], *specs[1:]]), as_double
        ),
        Status.DTYPE_NOT_ALLOWED,
        1010,
    )
    case(
        "declared size too large",
        with_header(
            variant(1011, tensors=[[specs[0][0], "float32", [1 << 20, 1 << 20]], *specs[1:]]), data
        ),
        Status.TOO_LARGE,
        1011,
    )
    case("garbage bytes", [b"\xc1garbage\x00\xff", *data], Status.MALFORMED, 0)
    case("header not a map", [msgpack.packb([1, 2, 3])], Status.MALFORMED, 0)
    case("unknown op number", with_header(variant(1012, op=99), data), Status.UNKNOWN_OP, 1012)
    case(
        "op the shard does not serve",
        with_header(
            {
                "v": PROTOCOL_VERSION,
                "op": int(Op.REGISTER),
                "id": 1013,
                "src": node_id,
                "role": "worker",
                "rank": 0,
            },
            [],
        ),
        Status.UNKNOWN_OP,
        1013,
    )
    case(
        "missing field",
        with_header({k: v for k, v in variant(1014).items() if k != "clock"}, data),
        Status.MALFORMED,
        1014,
    )
    case(
        "missing routing field",
        with_header({k: v for k, v in variant(1015).items() if k != "src"}, data),
        Status.MALFORMED,
        1015,
    )
    case("ill-typed field", with_header(variant(1016, clock="zero"), data), Status.MALFORMED, 1016)
    case(
        "bad tensor spec",
        with_header(variant(1017, tensors=[["x"], *specs[1:]]), data),
        Status.MALFORMED,
        1017,
    )
    return cases


def beat_header(node_id: int, req_id: int) -> dict:
    return {
        "v": PROTOCOL_VERSION,
        "op": int(Op.HEARTBEAT),
        "id": req_id,
        "src": node_id,
        "node_id": node_id,
        "stats": {},
        "records": [],
    }


def scheduler_cases(node_id: int) -> list[tuple[str, list, Status, int]]:
    beat = beat_header(node_id, 2000)
    return [
        ("garbage bytes", [b"\xc1garbage\x00\xff"], Status.MALFORMED, 0),
        ("empty header", [b""], Status.MALFORMED, 0),
        ("bad version", with_header({**beat, "id": 2001, "v": 0}, []), Status.BAD_VERSION, 2001),
        (
            "unknown op number",
            with_header({**beat, "id": 2002, "op": 77}, []),
            Status.UNKNOWN_OP,
            2002,
        ),
        (
            "op the scheduler does not serve",
            with_header(
                {
                    "v": PROTOCOL_VERSION,
                    "op": int(Op.PULL),
                    "id": 2003,
                    "src": node_id,
                    "plan_id": 1,
                },
                [],
            ),
            Status.UNKNOWN_OP,
            2003,
        ),
        (
            "missing field",
            with_header({k: v for k, v in {**beat, "id": 2004}.items() if k != "node_id"}, []),
            Status.MALFORMED,
            2004,
        ),
        (
            "missing op",
            with_header({k: v for k, v in {**beat, "id": 2005}.items() if k != "op"}, []),
            Status.MALFORMED,
            2005,
        ),
        (
            "ill-typed field",
            with_header({**beat, "id": 2006, "stats": [1]}, []),
            Status.MALFORMED,
            2006,
        ),
        (
            "unexpected tensor frames",
            with_header({**beat, "id": 2007}, [b"\x00" * 4]),
            Status.MALFORMED,
            2007,
        ),
        (
            "unknown node id",
            with_header({**beat, "id": 2008, "node_id": 4242}, []),
            Status.BAD_STATE,
            2008,
        ),
    ]


# ---------------------------------------------------------------- the test


def test_daemons_refuse_malformed_requests_and_keep_serving(daemons, tmp_path):
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
            "stop.max_seconds=60",
        ],
    )
    sched_addr = wait_for_file(tmp_path / "scheduler.addr", daemons, START_S)
    assert sched_addr.startswith("tcp://127.0.0.1:")
    daemons.start("shard", ["-m", "hetps.ps", "--rank", "0", "--scheduler", sched_addr, *CLUSTER])

    cfg = load_config(
        None,
        [*CLUSTER, f"cluster.startup_timeout_s={START_S}", f"cluster.request_timeout_s={REPLY_S}"],
    )
    model = tiny_model(batchnorm=False)
    specs = model_specs(model)
    member = Membership(sched_addr, "worker", 0, cfg.cluster)
    closers = [member.close]
    try:
        node_id = member.join(tensor_specs=specs, schema_hash=schema_hash(specs))
        plan = member.wait_plan()
        assert plan.worker_ids() == [node_id] and len(plan.shards) == 1
        daemons.alive_or_fail()
        shard_addr = plan.shards[0].address
        assert shard_addr.startswith("tcp://127.0.0.1:")

        shard = RpcClient(shard_addr, src=node_id, timeout_s=REPLY_S)
        closers.append(shard.close)
        values = {n: t.detach().clone() for n, (t, _) in model_tensors(model).items()}
        ack = shard.call(Init(plan_id=plan.plan_id, tensors=values))
        assert isinstance(ack, Ack) and ack.info["first"] is True

        def valid_pull() -> Params:
            reply = shard.call(Pull(plan_id=plan.plan_id, clock=0))
            assert isinstance(reply, Params), reply
            return reply

        assert valid_pull().version == 0
        grads = {n: torch.full_like(t, 0.5) for n, t in values.items()}

        raw = Raw(shard_addr)
        closers.append(raw.close)
        for name, frames, status, req_id in shard_cases(plan.plan_id, node_id, grads):
            err, got_id = raw.ask(frames)
            assert Status(err.status) == status, (
                f"shard, {name}: {Status(err.status).name}: {err.message}"
            )
            assert got_id == req_id, f"shard, {name}: reply id {got_id}"
            reply = valid_pull()
            assert reply.version == 0, f"shard, {name}: version moved"
            for n, t in values.items():
                assert torch.equal(reply.tensors[n], t), f"shard, {name}: {n} changed"
        # handler-level refusals over the wire, too
        for name, msg, status in [
            (
                "stale plan",
                Push(plan_id=plan.plan_id - 1, clock=0, base_version=0, tensors=grads),
                Status.STALE_PLAN,
            ),
            (
                "non-finite",
                Push(
                    plan_id=plan.plan_id,
                    clock=0,
                    base_version=0,
                    tensors={**grads, specs[0].name: torch.full(specs[0].shape, float("nan"))},
                ),
                Status.NONFINITE,
            ),
        ]:
            with pytest.raises(RemoteError) as info:
                shard.call(msg)
            assert info.value.status == status, f"shard, {name}: {info.value}"
            assert valid_pull().version == 0
        # and a valid push is applied after all that
        ack = shard.call(Push(plan_id=plan.plan_id, clock=0, base_version=0, tensors=grads))
        assert isinstance(ack, Ack) and ack.version == 1
        reply = shard.call(Pull(plan_id=plan.plan_id, clock=1))
        assert isinstance(reply, Params) and reply.version == 1
        lr = cfg.optimizer.lr
        torch.testing.assert_close(reply.tensors[specs[0].name], values[specs[0].name] - lr * 0.5)

        raw_sched = Raw(sched_addr)
        closers.append(raw_sched.close)
        for name, frames, status, req_id in scheduler_cases(node_id):
            err, got_id = raw_sched.ask(frames)
            assert Status(err.status) == status, (
                f"scheduler, {name}: {Status(err.status).name}: {err.message}"
            )
            assert got_id == req_id, f"scheduler, {name}: reply id {got_id}"
            ack = member.rpc.call(
                Heartbeat(node_id=node_id, stats=NodeStats(steps=1)), timeout_s=REPLY_S
            )
            assert isinstance(ack, Ack) and ack.stop is False and ack.plan_id == plan.plan_id, name
        # stats that are not counts are refused at decode (records.NodeStats), naming the field
        evaluator = Membership(sched_addr, "evaluator", 0, cfg.cluster)
        closers.append(evaluator.close)
        eval_id = evaluator.join()
        for key, odd in (
            ("steps", "many"),
            ("bytes_sent", float("inf")),
            ("bytes_received", b"\x00"),
            ("version", None),
        ):
            err, got_id = raw_sched.ask(
                with_header({**beat_header(eval_id, 2100), "stats": {key: odd}}, [])
            )
            assert Status(err.status) == Status.MALFORMED and f"stats.{key}" in err.message, (
                err.message
            )
        ack = evaluator.rpc.call(
            Heartbeat(node_id=eval_id, stats=NodeStats(extra={"evals": 1})), timeout_s=REPLY_S
        )
        assert isinstance(ack, Ack)
        daemons.alive_or_fail()

        # stop the run: STOP, then this worker's goodbye lets the shard be told
        ctl = RpcClient(sched_addr, timeout_s=REPLY_S)
        closers.append(ctl.close)
        ack = ctl.call(Stop(reason="test done"))
        assert isinstance(ack, Ack) and ack.stop is True
        evaluator.bye({"evals": 1}, timeout_s=REPLY_S)
        member.bye({"steps": 1}, timeout_s=REPLY_S)
    finally:
        for close in reversed(closers):
            close()

    deadline = time.monotonic() + EXIT_S
    for name in ("shard", "scheduler"):
        proc = daemons.procs[name]
        try:
            code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} still running {EXIT_S}s after the stop\n{daemons.tails()}")
        assert code == 0, f"{name} exited with {code}\n{daemons.tails()}"
    summary = tmp_path / "summary.json"
    assert summary.exists(), daemons.tails()
    data = json.loads(summary.read_text())
    assert data["stop_reason"] == "test done"
    assert data["not_left"] == []
    assert data["shard_versions"] == {"ps0": 1}
    assert data["global_steps"] == 1
    assert {k: data["per_node"]["evaluator0"][k] for k in ("sent", "received", "steps")} == {
        "sent": 0,
        "received": 0,
        "steps": 0,
    }
