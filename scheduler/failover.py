"""Replicated shards at the scheduler (`cluster.replicas: 1`): who holds
whose backup, and the failover plan when a shard process is declared dead.

Backups form a ring over the plan's speed ranking: the backup of shard k is
held by shard k+1 (the next slower one), the slowest shard's by the fastest.
The plan says where each backup is (`backups`) and, after a failover, which
process serves a dead shard's tensors (`served_by`), so a restarted scheduler
knows who is primary from its saved plan.

Functions of the plan and the node table (node id -> nodes.Node): they
return plans, the coordinator decides when and publishes them.
"""

from __future__ import annotations

import dataclasses
import logging

from hetps.proto.errors import ProtocolError
from hetps.proto.messages import Status
from hetps.proto.plan import ClusterPlan

log = logging.getLogger(__name__)


def with_backups(plan: ClusterPlan, nodes: dict, replicas: int) -> ClusterPlan:
    """`plan` with the ring of backups filled in (unchanged when `replicas` is 0)."""
    if not replicas or len(plan.shards) < 2:
        return plan
    ring = plan.shards[1:] + plan.shards[:1]
    backups = {
        str(s.node_id): {"node": b.node_id, "address": nodes[b.node_id].replica_address}
        for s, b in zip(plan.shards, ring)
    }
    return dataclasses.replace(plan, backups=backups)


def host_of(plan: ClusterPlan, shard_id: int) -> int:
    """The node id of the process serving shard `shard_id`'s tensors now."""
    return plan.served_by.get(str(shard_id), shard_id)


def holds_copy(node, shard_id: int) -> bool:
    """Whether backup process `node` can take over shard `shard_id`: a ring
    backup always can (it replayed from the INIT on); a spare only once its last
    heartbeat reported the primary's state copied in (ps/spare.py `ready`)."""
    return node.role != "spare" or any(
        isinstance(b, dict) and b.get("of") == shard_id and b.get("ready")
        for b in node.stats.get("backups") or ()
    )


def failover_plan(
    plan: ClusterPlan, dead: int, nodes: dict
) -> tuple[ClusterPlan | None, list[str]]:
    """The plan after shard process `dead` is lost: every range it served is
    served by its backup (when that one is alive), and the backup it held is
    gone. Returns (the new plan or None when nothing changes, the ranges lost
    for want of a live backup, as words for the log)."""
    shards, backups, served = list(plan.shards), dict(plan.backups), dict(plan.served_by)
    lost: list[str] = []
    for i, s in enumerate(plan.shards):
        if host_of(plan, s.node_id) != dead:
            continue
        backup = backups.pop(str(s.node_id), None)
        if (
            backup is None
            or nodes[backup["node"]].gone
            or not holds_copy(nodes[backup["node"]], s.node_id)
        ):
            lost.append(f"shard {s.rank} (node {s.node_id})")
            continue
        shards[i] = dataclasses.replace(s, address=backup["address"])
        served[str(s.node_id)] = backup["node"]
    for key, backup in list(backups.items()):
        if backup["node"] == dead:  # what it backed up serves on unreplicated
            del backups[key]
    if shards == plan.shards and backups == plan.backups:
        return None, lost
    return dataclasses.replace(
        plan,
        plan_id=plan.plan_id + 1,
        shards=shards,
        backups=backups,
        served_by=served,
        info={"reason": f"shard node {dead} dead: failover"},
    ), lost


def after_shard_dead(plan: ClusterPlan, node, nodes: dict) -> ClusterPlan | None:
    """The plan to publish now that shard process `node` (a shard or a spare)
    is declared dead: the ranges it served are served by their backups
    (`failover_plan`) and ranges left without a backup get one on a spare
    (`with_spares`); None when nothing changes. A range with no live backup
    is logged as lost: workers wait for that shard to be restarted, as
    without replicas. For runs with `cluster.replicas` only."""
    new, lost = failover_plan(plan, node.node_id, nodes)
    for words in lost:
        log.error("%s has no live backup: its tensors wait for a restart", words)
    if new is None:
        return None
    new = with_spares(new, nodes)
    log.warning(
        "shard %d (node %d) dead: plan %d promotes its backup", node.rank, node.node_id, new.plan_id
    )
    return new


def with_spares(plan: ClusterPlan, nodes: dict) -> ClusterPlan:
    """`plan` with a free backup slot of a live spare (`cluster.spare_shards`)
    given to every range that has no backup, never on the process serving that
    range. The primary copies its state there (ps/state_copy.py)."""
    backups = dict(plan.backups)
    used = {b["address"] for b in backups.values()} | {s.address for s in plan.shards}
    free = [
        (n.node_id, a)
        for n in sorted(nodes.values(), key=lambda n: n.node_id)
        if n.role == "spare" and not n.gone
        for a in n.spare_slots
        if a not in used
    ]
    for s in plan.shards:
        slot = next((f for f in free if f[0] != host_of(plan, s.node_id)), None)
        if str(s.node_id) in backups or slot is None:
            continue
        free.remove(slot)
        backups[str(s.node_id)] = {"node": slot[0], "address": slot[1]}
        log.warning(
            "shard %d (node %d): new backup on spare node %d at %s", s.rank, s.node_id, *slot
        )
    return plan if backups == plan.backups else dataclasses.replace(plan, backups=backups)


def after_spare_joined(plan: ClusterPlan, nodes: dict) -> ClusterPlan | None:
    """The plan to publish now that a spare registered while training: ranges
    without a backup get one on it (`with_spares`) under the next plan id;
    None when every range has one. For runs with `cluster.replicas` only."""
    backed = with_spares(plan, nodes)
    if backed is plan:
        return None
    return dataclasses.replace(backed, plan_id=plan.plan_id + 1, info={"reason": "a spare joined"})


def replaced(plan: ClusterPlan | None, node_id: int) -> bool:
    """True when shard `node_id`'s tensors are served by another process now."""
    return plan is not None and host_of(plan, node_id) != node_id


def check_readmit(plan: ClusterPlan | None, node) -> None:
    """A shard whose tensors a backup took over cannot come back as their
    owner (its state is older than the promoted backup's). Raises ProtocolError."""
    if node.role == "ps" and replaced(plan, node.node_id):
        raise ProtocolError(
            Status.BAD_STATE,
            f"shard {node.rank}'s tensors are served by its promoted backup "
            f"(node {host_of(plan, node.node_id)}) since a failover; "
            "it cannot rejoin as their owner",
        )
