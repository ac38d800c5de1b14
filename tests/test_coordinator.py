"""The scheduler's coordinator in one process (an in-memory transport, no
daemons): liveness is judged from the first plan on, not from registration."""
from __future__ import annotations

import time

from hetps.proto.codec import Envelope
from hetps.proto.config import load_config
from hetps.proto.messages import Register
from hetps.proto.plan import TensorSpec
from hetps.proto.transport import MemServer
from hetps.scheduler.coordinator import Coordinator

SPECS = [TensorSpec("w", "float32", (2, 3)).to_wire()]
DEAD_AFTER_S = 0.2


def register(coord: Coordinator, role: str, rank: int) -> int:
    msg = Register(role=role, rank=rank, address=f"mem://{role}{rank}" if role == "ps" else "",
                   tensor_specs=SPECS if role == "worker" else [], speed=1.0)
    return coord.on_register(b"peer", Envelope(msg, req_id=1, src=0)).node_id


def test_nodes_that_registered_long_before_the_plan_are_not_declared_dead(tmp_path):
    cfg = load_config(None, ["cluster.workers=2", "cluster.shards=1", f"cluster.dead_after_s={DEAD_AFTER_S}",
                             "cluster.heartbeat_s=0.05"])  # heartbeats must be more frequent than dead_after_s
    server = MemServer("mem://coordinator-liveness")
    try:
        coord = Coordinator(server, cfg, run_dir=tmp_path)
        register(coord, "ps", 0)
        register(coord, "worker", 0)
        time.sleep(3 * DEAD_AFTER_S)  # the last worker is slow to start: the others only wait for the plan
        register(coord, "worker", 1)
        assert coord.plan is not None and coord.plan.plan_id == 1
        coord.tick()
        assert coord.failures == [] and coord.plan.plan_id == 1
        # silence after the plan is still detected: nobody heartbeats here
        time.sleep(2 * DEAD_AFTER_S)
        coord.tick()
        assert sorted(f["node"] for f in coord.failures) == ["ps0", "worker0", "worker1"]
    finally:
        server.close()
