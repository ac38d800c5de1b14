"""A peer's odd step records cannot end a run. An independent wire client (a
raw ZeroMQ DEALER socket, msgpack headers made by hand) registers as a worker
of a running `hetps run` and sends heartbeats whose step records lack a field
or hold a wrong type or an absurd `ago`: each is refused with MALFORMED naming
the field, the scheduler keeps serving (a lean valid record is taken and
written as the sender's), and the run completes with its summary and plots.
Real processes on loopback, the real mnist-5k digits."""

from __future__ import annotations

import json

import msgpack
import pytest
import zmq
from cluster_util import background_run, log_tails, records, run_hetps, summary, wait_for

from hetps.proto import messages as m
from hetps.proto.codec import decode, encode
from hetps.proto.messages import PROTOCOL_VERSION, Op, Status
from hetps.proto.records import read_tensor_specs

pytestmark = pytest.mark.cluster

REPLY_S = 15.0  # any one reply of the scheduler, on a loaded machine
RUN_S = 240.0  # the whole run, start-up included
STOPPED = "the wire client is done"


class WireClient:
    """One DEALER socket to the scheduler; `ask` returns the decoded reply, None when none came."""

    def __init__(self, address: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.ids = iter(range(1, 1 << 30))

    def ask(self, frames: list) -> m.Message | None:
        self.sock.send_multipart([bytes(memoryview(f)) for f in frames])
        if not self.sock.poll(int(REPLY_S * 1000)):
            return None
        return decode(self.sock.recv_multipart()).msg

    def call(self, msg: m.Message, src: int = 0) -> m.Message | None:
        return self.ask(encode(msg, next(self.ids), src))

    def beat(self, node_id: int, step_records: list) -> m.Message | None:
        """A HEARTBEAT carrying `step_records` exactly as given (no checks on this side)."""
        header = {
            "v": PROTOCOL_VERSION,
            "op": int(Op.HEARTBEAT),
            "id": next(self.ids),
            "src": node_id,
            "node_id": node_id,
            "stats": {},
            "records": step_records,
        }
        return self.ask([msgpack.packb(header, use_bin_type=True)])

    def close(self) -> None:
        self.sock.close(0)


ODD = [  # (step records, the field the refusal must name)
    ([{"ago": 0.1}], "records[0].step"),
    ([{"step": 1, "ago": 1e9}], "records[0].ago"),
    ([{"step": 1, "ago": -0.5}], "records[0].ago"),
    ([{"step": 1, "ago": 0.1, "loss": "low"}], "records[0].loss"),
    ([{"step": 1, "ago": 0.1, "worker": "me"}], "records[0].worker"),
    ([{"step": 2, "ago": 0.1}, {"step": -1, "ago": 0.0}], "records[1].step"),
    ([{"step": 2, "ago": 0.1, "compute_s": float("nan")}], "records[0].compute_s"),
]


def test_a_peers_odd_step_records_are_refused_and_the_run_completes(run_dir):
    args = [
        "configs/async.yaml",
        "cluster.workers=2",
        "cluster.shards=1",
        "cluster.profile_steps=2",
        "stop.target_accuracy=null",
        f"stop.max_seconds={RUN_S}",
        "eval.every_s=1.0",
        "--out",
        str(run_dir),
        "--quiet",
    ]
    replies = []
    with background_run(args) as proc:
        wait_for(
            lambda: (run_dir / "metrics.jsonl").exists() and records(run_dir, "step"),
            RUN_S / 2,
            "the first step",
        )
        plan = json.loads((run_dir / "plan.json").read_text())
        client = WireClient((run_dir / "scheduler.addr").read_text().strip())
        try:
            welcome = client.call(
                m.Register(
                    role="worker",
                    rank=-1,  # the scheduler picks a free rank
                    tensor_specs=read_tensor_specs(plan["tensors"]),
                    schema_hash=plan["schema_hash"],
                    host="wire-client",
                )
            )
            assert isinstance(welcome, m.Welcome), welcome
            replies = [client.beat(welcome.node_id, recs) for recs, _ in ODD]
            # a lean record, claiming another worker's rank: taken, written as the sender's
            lean = client.beat(welcome.node_id, [{"step": 3, "ago": 0.05, "worker": 0}])
            bye = client.call(m.Bye(node_id=welcome.node_id), src=welcome.node_id)
            stop = client.call(m.Stop(reason=STOPPED))
        finally:
            client.close()
        _, err = proc.communicate(timeout=RUN_S)
    assert proc.returncode == 0, err + log_tails(run_dir)
    s = summary(run_dir)
    assert s["status"] == "completed" and s["stop_reason"] == STOPPED, s
    assert (run_dir / "accuracy_vs_time.png").exists()

    for (recs, field), reply in zip(ODD, replies):
        assert isinstance(reply, m.Error), (recs, reply)
        assert reply.status == Status.MALFORMED and field in reply.message, (recs, reply)
    assert isinstance(lean, m.Ack) and isinstance(bye, m.Ack) and isinstance(stop, m.Ack)

    steps = records(run_dir, "step")
    mine = [r for r in steps if r["worker"] == welcome.rank]
    assert welcome.rank == 2 and [r["step"] for r in mine] == [3], mine
    assert "loss" not in mine[0] and "ago" not in mine[0]
    assert all(type(r["worker"]) is int and r["t"] >= 0 for r in steps), steps
    assert {0, 1} <= {r["worker"] for r in steps}  # the real workers trained on
    assert run_hetps(["plot", str(run_dir)], timeout_s=120).returncode == 0
