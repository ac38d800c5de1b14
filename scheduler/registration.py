"""The scheduler's registration desk (a part of `Coordinator`): REGISTER
gives a node its id, or takes a node back (a restarted shard, a node
registering again after a scheduler restart), gives `--rank auto` nodes a
free rank, and checks every worker's model schema against the cluster's."""
from __future__ import annotations

import dataclasses
import logging

from hetps.proto.codec import Envelope, ProtocolError
from hetps.proto.messages import Status, Welcome
from hetps.proto.plan import TensorSpec

from . import failover, state
from .nodes import Node, free_rank
from .status import ROLES

log = logging.getLogger(__name__)


class Registration:
    """REGISTER handling for `Coordinator` (it provides nodes, plan, expected,
    specs/schema, failures, runlog, clock, elapsed, _maybe_plan, _replan)."""

    def on_register(self, peer: bytes, env: Envelope):
        msg = env.msg
        if msg.role not in ROLES:
            raise ProtocolError(Status.MALFORMED, f"role {msg.role!r} not in {ROLES}")
        if msg.role == "worker":
            self._check_schema(msg.tensor_specs, msg.schema_hash)
        if msg.rank < 0:  # `--rank auto`: the node takes the rank given here (nodes.free_rank)
            msg = dataclasses.replace(msg, rank=self._claim_rank(msg.role))
        known = self._known(msg)
        if known is not None:
            return self._readmit(known, msg)
        node_id = len(self.nodes) + 1
        self.nodes[node_id] = Node(node_id, msg.role, msg.rank, msg.address, self.clock(),
                                   profiled_speed=msg.speed, host=msg.host, replica_address=msg.replica_address,
                                   spare_slots=msg.spare_slots)
        log.info("registered %s %d as node %d %s", msg.role, msg.rank, node_id, msg.address)
        self.runlog.record("register", t=round(self.elapsed(), 4), node=f"{msg.role}{msg.rank}", host=msg.host,
                           **({"startup": msg.startup} if msg.startup else {}))
        self._maybe_plan()
        if msg.role == "spare":  # a range left without a backup by an earlier failover gets one now
            failover.on_spare_joined(self)
        if msg.role == "worker" and self.plan is not None and node_id not in self.plan.worker_ids():
            self._replan(f"worker {msg.rank} joined as node {node_id}")
        if self.plan is None:  # the start-up burst: written once per tick (coordinator._save_when_due)
            self.state_dirty = True
        else:
            state.save(self)
        return Welcome(node_id=node_id, role=msg.role, rank=msg.rank)

    def _claim_rank(self, role: str) -> int:
        rank = free_rank(list(self.nodes.values()), role, self.expected.get(role, 0))
        if rank is None:
            raise ProtocolError(Status.BAD_STATE, f"--rank auto: every {role} rank 0..{self.expected[role] - 1} "
                                                  "is held by a live node")
        return rank

    def _known(self, msg) -> Node | None:
        """The node a registration comes back as: the one whose id it names
        (a node re-registering, e.g. after a scheduler restart), or, for a
        shard, the plan's shard of that rank (a restarted shard process)."""
        node = self.nodes.get(msg.node_id) if msg.node_id else None
        if node is not None and (node.role, node.rank) == (msg.role, msg.rank):
            return node
        if msg.role == "ps" and self.plan is not None:
            return next((self.nodes[s.node_id] for s in self.plan.shards if s.rank == msg.rank), None)
        return None

    def _readmit(self, node: Node, msg) -> Welcome:
        failover.check_readmit(self.plan, node)
        planned = {s.node_id: s.address for s in self.plan.shards} if self.plan else {}
        if node.node_id in planned and msg.address != planned[node.node_id]:
            raise ProtocolError(Status.BAD_STATE, f"shard {msg.rank} must come back at {planned[node.node_id]} "
                                                  f"(the plan's address), not {msg.address}")
        if node.role == "ps":
            self.failures.append({"kind": "shard_restarted", "node": f"ps{node.rank}",
                                  "t": round(self.elapsed(), 3), "was_dead": node.dead})
        node.dead = node.left = False
        node.last_seen = self.clock()
        log.info("%s %d came back as node %d", msg.role, msg.rank, node.node_id)
        state.save(self)
        return Welcome(node_id=node.node_id, role=msg.role, rank=msg.rank)

    def _check_schema(self, specs: list[TensorSpec], schema_hash: str) -> None:
        if self.specs is None:
            self.specs = list(specs)  # checked at decode (records.read_tensor_specs)
            self.schema = schema_hash
        elif schema_hash != self.schema:
            raise ProtocolError(Status.BAD_STATE,
                                f"model schema {schema_hash} differs from the cluster's {self.schema}")
