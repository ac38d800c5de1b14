"""REGISTER's rules, as functions of the scheduler's node table and plan:
whether a node's configuration agrees with the scheduler's (`check_agreement`)
and its rank is one the configuration has (`check_rank`), the rank a
`--rank auto` node claims (`claim_rank`), the node a registration comes back
as (`returning`: a restarted shard, a node registering again after a
scheduler restart), and whether it may come back (`check_return`). A refusal
is a ProtocolError; the coordinator applies what they decide
(Coordinator.on_register) and names the nodes it refused while the cluster
forms."""

from __future__ import annotations

from hetps.proto.codec import ProtocolError
from hetps.proto.messages import Register, Status
from hetps.proto.plan import ClusterPlan
from hetps.runconfig.agreement import describe, differences

from . import failover
from .nodes import Node, free_rank


def check_agreement(mine: dict, msg: Register) -> None:
    """The settings every host must agree on (runconfig/agreement.py): `mine` (the
    scheduler's agreed_values) against the node's. Raises ProtocolError naming each key that
    differs with both values; a node that sends none (an in-process client) is not checked."""
    diffs = differences(mine, msg.agreed)
    if diffs:
        raise ProtocolError(
            Status.CONFIG_MISMATCH,
            f"{msg.role} {rank_name(msg.rank)}'s configuration differs from the scheduler's: "
            + describe(diffs, "scheduler", f"{msg.role} {rank_name(msg.rank)}")
            + " (these settings must be identical on every host: docs/deployment.md)",
        )


def check_rank(msg: Register, configured: int, forming: bool) -> None:
    """A node naming its own rank (not `--rank auto`, not registering again) must name one
    of the `configured` count of its role: a shard always; a worker while the cluster forms
    (`forming`: before the first plan), where a rank beyond the count would stand in for a
    configured one that never started. Once training runs, a worker of any rank may join it.
    Raises ProtocolError."""
    if msg.role not in ("ps", "worker") or msg.rank < 0 or msg.node_id:
        return
    if msg.rank >= configured and (msg.role == "ps" or forming):
        key = "cluster.shards" if msg.role == "ps" else "cluster.workers"
        raise ProtocolError(
            Status.CONFIG_MISMATCH,
            f"{msg.role} rank {msg.rank} is not one of the configured ranks 0..{configured - 1} "
            f"({key} has {configured} at the scheduler)"
            + (
                "; a worker beyond them may join once training runs" if msg.role == "worker" else ""
            ),
        )


def rank_name(rank: int) -> str:
    return "auto" if rank < 0 else str(rank)


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
