"""REGISTER's rules, as functions of the scheduler's node table and plan:
the rank a `--rank auto` node claims (`claim_rank`), the node a registration
comes back as (`returning`: a restarted shard, a node registering again after
a scheduler restart), and whether it may come back (`check_return`). A
refusal is a ProtocolError; the coordinator applies what they decide
(Coordinator.on_register)."""

from __future__ import annotations

from hetps.proto.codec import ProtocolError
from hetps.proto.messages import Register, Status
from hetps.proto.plan import ClusterPlan

from . import failover
from .nodes import Node, free_rank


def claim_rank(nodes: dict[int, Node], role: str, configured: int) -> int:
    """The rank a `--rank auto` node of `role` takes (nodes.free_rank), given
    the `configured` count of that role. Raises ProtocolError when every
    configured rank is held by a live node (shards only)."""
    rank = free_rank(list(nodes.values()), role, configured)
    if rank is None:
        raise ProtocolError(
            Status.BAD_STATE,
            f"--rank auto: every {role} rank 0..{configured - 1} is held by a live node",
        )
    return rank


def returning(nodes: dict[int, Node], plan: ClusterPlan | None, msg: Register) -> Node | None:
    """The node a registration comes back as: the one whose id it names
    (a node re-registering, e.g. after a scheduler restart), or, for a
    shard, the plan's shard of that rank (a restarted shard process); None
    for a new node."""
    node = nodes.get(msg.node_id) if msg.node_id else None
    if node is not None and (node.role, node.rank) == (msg.role, msg.rank):
        return node
    if msg.role == "ps" and plan is not None:
        return next((nodes[s.node_id] for s in plan.shards if s.rank == msg.rank), None)
    return None


def check_return(plan: ClusterPlan | None, node: Node, msg: Register) -> None:
    """Whether `node` may come back as `msg` registers it: never a shard whose
    tensors its promoted backup serves (failover.check_readmit), and a shard
    of the plan only at the plan's address. Raises ProtocolError."""
    failover.check_readmit(plan, node)
    planned = {s.node_id: s.address for s in plan.shards} if plan else {}
    if node.node_id in planned and msg.address != planned[node.node_id]:
        raise ProtocolError(
            Status.BAD_STATE,
            f"shard {msg.rank} must come back at "
            f"{planned[node.node_id]} (the plan's address), "
            f"not {msg.address}",
        )
