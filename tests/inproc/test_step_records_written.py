"""What the scheduler writes of a heartbeat's step records (scheduler/coordinator.py):
each worker's step as the sender's (its rank, whatever the record says), placed on
the run's clock and never before it began; a shard's records are not steps and are
dropped; a heartbeat with a bad record is refused whole, and the scheduler answers
the next one. A coordinator in this process over the in-memory transport, its nodes
registered through real frames; the run directory's metrics.jsonl is read back."""

from __future__ import annotations

import msgpack
from test_fuzz_registered import header, registered_cluster

from hetps.proto import messages as m
from hetps.proto.messages import Op, Status
from hetps.scheduler.runlog import read_metrics


def steps(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "step"]


def test_steps_are_written_as_the_senders_on_the_runs_clock(tmp_path):
    coord, wire, server, nodes = registered_cluster(tmp_path)
    try:
        worker1 = nodes["worker1"]
        ack = wire.call(
            m.Heartbeat(
                node_id=worker1,
                records=[
                    # claims another worker's rank; ended well before the run's clock began
                    {"worker": 0, "step": 7, "ago": 3600.0, "loss": 0.5, "note": "x"},
                    {"step": 8, "ago": 0.0},
                ],
            )
        )
        assert isinstance(ack, m.Ack)
        # a shard's records are no training steps
        assert isinstance(
            wire.call(m.Heartbeat(node_id=nodes["ps0"], records=[{"step": 1, "ago": 0}])), m.Ack
        )
        # refused whole, naming the field; the next heartbeat is answered
        frames = header(
            Op.HEARTBEAT, 9, worker1, node_id=worker1, records=[{"step": 9, "ago": 0}, {"ago": 0.1}]
        )
        env = wire.ask(frames)
        assert isinstance(env.msg, m.Error) and env.msg.status == Status.MALFORMED
        assert (
            "records[1].step" in env.msg.message and env.req_id == msgpack.unpackb(frames[0])["id"]
        )
        assert isinstance(
            wire.call(m.Heartbeat(node_id=worker1, records=[{"step": 10, "ago": 0.0}])), m.Ack
        )
    finally:
        server.close()
        coord.runlog.close()
    written = steps(tmp_path)
    assert [(r["worker"], r["step"]) for r in written] == [(1, 7), (1, 8), (1, 10)], written
    first = written[0]
    assert (
        first["t"] == 0.0 and first["loss"] == 0.5 and first["note"] == "x" and "ago" not in first
    )
    assert all(r["t"] >= 0 for r in written)
