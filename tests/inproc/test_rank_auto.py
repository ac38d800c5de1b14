"""`--rank auto`: a node without an index (a scaled compose service, a Job without
completion indices) claims its rank from the scheduler when it registers.
In one process: the coordinator on the in-memory transport, real Membership clients."""

from __future__ import annotations

import argparse
import threading

import pytest

from hetps.proto.codec import Envelope, ProtocolError
from hetps.proto.messages import Register, Status
from hetps.proto.plan import TensorSpec
from hetps.proto.transport import MemServer
from hetps.runconfig.load import load_config
from hetps.runtime.daemon import AUTO_RANK, common_args, rank_arg
from hetps.runtime.membership import Membership
from hetps.scheduler.coordinator import Coordinator

SPECS = [TensorSpec("w", "float32", (2, 3))]


def register(coord: Coordinator, role: str, rank: int, address: str = "") -> tuple[int, int]:
    """(node id, rank) the scheduler's WELCOME gives."""
    msg = Register(
        role=role,
        rank=rank,
        address=address,
        tensor_specs=SPECS if role == "worker" else [],
        speed=1.0,
    )
    welcome = coord.on_register(b"peer", Envelope(msg, req_id=1, src=0))
    return welcome.node_id, welcome.rank


def test_rank_flag_takes_a_number_or_auto(monkeypatch):
    assert rank_arg("3") == 3 and rank_arg("auto") == AUTO_RANK and rank_arg(" AUTO ") == AUTO_RANK
    for bad in ("-1", "two", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="rank >= 0 or 'auto'"):
            rank_arg(bad)
    monkeypatch.setenv("HETPS_RANK", "auto")
    parser = argparse.ArgumentParser()
    common_args(parser)
    assert parser.parse_args([]).rank == AUTO_RANK
    assert parser.parse_args(["--rank", "5"]).rank == 5


def test_workers_claim_ranks_beyond_the_configured_ones(tmp_path):
    cfg = load_config(None, ["cluster.workers=2", "cluster.shards=1"])
    server = MemServer("mem://rank-auto-workers")
    try:
        coord = Coordinator(server, cfg, run_dir=tmp_path)
        # an auto worker before the indexed ones: it must not take rank 0 or 1 from them
        assert register(coord, "worker", AUTO_RANK)[1] == 2
        assert register(coord, "worker", 0)[1] == 0
        assert register(coord, "worker", AUTO_RANK)[1] == 3
        node, rank = register(coord, "worker", 1)
        assert rank == 1
        coord.nodes[next(n.node_id for n in coord.nodes.values() if n.rank == 2)].dead = True
        assert register(coord, "worker", AUTO_RANK)[1] == 2  # a dead worker's rank is free again
        assert sorted(n.rank for n in coord.members("worker")) == [0, 1, 2, 2, 3]
        assert register(coord, "evaluator", AUTO_RANK)[1] == 0
    finally:
        server.close()


def test_shards_claim_a_configured_rank_and_a_dead_shards_place(tmp_path):
    cfg = load_config(None, ["cluster.workers=1", "cluster.shards=2"])
    server = MemServer("mem://rank-auto-shards")
    try:
        coord = Coordinator(server, cfg, run_dir=tmp_path)
        first, rank0 = register(coord, "ps", AUTO_RANK, "mem://shard-a")
        second, rank1 = register(coord, "ps", AUTO_RANK, "mem://shard-b")
        assert (rank0, rank1) == (0, 1)
        register(coord, "worker", 0)
        assert coord.plan is not None and [
            s.rank for s in sorted(coord.plan.shards, key=lambda s: s.rank)
        ] == [0, 1]
        with pytest.raises(ProtocolError) as refused:  # a third shard has no configured rank left
            register(coord, "ps", AUTO_RANK, "mem://shard-c")
        assert refused.value.status == Status.BAD_STATE and "every ps rank 0..1" in str(
            refused.value
        )
        coord.nodes[second].dead = True
        # a replacement (no index, same advertised address) takes the dead shard's rank and node
        assert register(coord, "ps", AUTO_RANK, "mem://shard-b") == (second, 1)
        assert not coord.nodes[second].dead
    finally:
        server.close()


def test_membership_keeps_the_rank_the_scheduler_gave(tmp_path):
    cfg = load_config(
        None, ["cluster.workers=1", "cluster.shards=1", "cluster.startup_timeout_s=10"]
    )
    server = MemServer("mem://rank-auto-member")
    member = Membership("mem://rank-auto-member", "worker", AUTO_RANK, cfg.cluster)
    done = threading.Event()
    coord = Coordinator(server, cfg, run_dir=tmp_path)
    loop = threading.Thread(
        target=lambda: [coord.serve_once(0.02) for _ in iter(done.is_set, True)]
    )
    loop.start()  # the scheduler's loop, as in its daemon
    try:
        node_id = member.join(tensor_specs=SPECS)
        assert member.rank == 1 and coord.nodes[node_id].rank == 1
        # a re-registration (scheduler restart) names the same rank
        assert member._registration.rank == 1
    finally:
        done.set()
        loop.join(timeout=10)
        member.close()
        server.close()
