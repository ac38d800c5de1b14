"""Spare shard processes (`cluster.spare_shards`): they register with the
scheduler as role `spare`, own no tensors and wait. Each binds one backup
socket per slot (`slots`, by default one per configured shard: after a
failover one process may serve several ranges, and all of them need a
backup). When a failover plan names a slot as the new backup of a range, the
range's primary copies its state there (ps/state_copy.py) and then forwards
its pushes as to any backup; when that primary dies too, the next failover
plan promotes the slot and the spare serves the range.

    hetps ps --spare --config CONFIG --rank N [--scheduler tcp://HOST:PORT] [--replica-bind ADDR ...]
"""

from __future__ import annotations

import contextlib
import logging
import sys

import zmq

from hetps.proto.plan import ClusterPlan
from hetps.proto.rpc import Aborted, RemoteError, RequestTimeout
from hetps.proto.transport import ServerTransport, TransportError, make_server
from hetps.runconfig.agreement import agreed_values
from hetps.runtime.daemon import check_and_exit, scheduler_lost_exit, transport_options
from hetps.runtime.membership import Membership, SchedulerUnreachable, reachable

from .replication import ReplicaHost

log = logging.getLogger(__name__)


class SlotHost(ReplicaHost):
    """One backup socket of a spare: it holds the backup the plan puts at its address."""

    def primary_in(self, plan: ClusterPlan) -> int | None:
        return next((int(k) for k, b in plan.backups.items() if b["address"] == self.address), None)

    def follow(self, plan: ClusterPlan) -> None:
        shadow = self.shadow
        if (
            shadow is not None
            and shadow.role == "backup"
            and self.primary_in(plan) != shadow.node_id
            and plan.served_by.get(str(shadow.node_id)) != self.node_id
        ):
            # neither backed up here nor promoted: its range was lost, the slot is free for another one
            log.warning(
                "slot %s: no longer the backup of shard node %d", self.address, shadow.node_id
            )
            self.shadow = None
        super().follow(plan)


class Spare:
    """A spare's backup slots. Not thread-safe; serve it from one loop."""

    def __init__(
        self,
        servers: list[ServerTransport],
        cfg,
        node_id: int = 0,
        checkpoint_root: str | None = None,
    ):
        self.slots = [SlotHost(s, cfg, node_id, checkpoint_root) for s in servers]
        self.plan_id = 0

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.slots]

    def set_node_id(self, node_id: int) -> None:
        for s in self.slots:
            s.node_id = node_id

    def follow(self, plan: ClusterPlan) -> None:
        """Take a newer plan in every slot: a new backup, a promotion, or a plan switch."""
        if plan.plan_id <= self.plan_id:
            return
        self.plan_id = plan.plan_id
        for s in self.slots:
            s.follow(plan)

    def serve_once(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` for the held backups' sockets, then serve
        each (bounded). A slot holding nothing is not read: what reaches it
        before its plan waits in its socket. In-process transports are served
        in turn."""
        parts = [s.shadow for s in self.slots if s.shadow is not None]
        if getattr(self.slots[0].server, "sock", None) is not None:
            poller = zmq.Poller()
            for k in (k for p in parts for k in p.sockets()):
                poller.register(k, zmq.POLLIN)
            poller.poll(timeout=int(timeout_s * 1000))  # with no socket: a sleep of timeout_s
            timeout_s = 0.0
        handled = False
        for p in parts:
            for _ in range(64):  # bounded: the other slots get their turn
                if not p.serve_once(timeout_s / len(parts)):
                    break
                handled = True
        return handled

    def stats(self) -> dict:
        """For heartbeats: `backups`, one entry per held backup (of, role, version, ...); `ready`:
        it holds the primary's state (the copy arrived), so the scheduler may promote it."""
        return {
            "backups": [
                {**s.stats()["backup"], "ready": s.shadow.policy is not None}
                for s in self.slots
                if s.shadow is not None
            ]
        }

    def final_checkpoint(self) -> None:
        for s in self.slots:
            s.final_checkpoint()

    def close(self) -> None:
        for s in self.slots:
            s.close()


def serve_spare(spare: Spare, member: Membership, poll_s: float = 0.05) -> None:
    """Serve until the scheduler says stop, following every newer plan."""
    with contextlib.suppress(Aborted):
        while not member.stop_requested.is_set():
            spare.serve_once(poll_s)
            if member.latest_plan_id > spare.plan_id:
                try:
                    newer = member.newer_plan(spare.plan_id)
                    if newer is not None:
                        spare.follow(newer)
                except Aborted:
                    raise
                except Exception:  # as the shard's PlanFollower: keep serving what it has
                    log.exception("spare: could not follow plan %d", member.latest_plan_id)


def slot_addresses(base: str, count: int) -> list[str]:
    """`count` addresses from `base`: port 0 stays random for each; a fixed
    port P gives P, P+1, ... (one per slot)."""
    host, _, port = base.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return [base] * count
    return [f"{host}:{int(port) + k}" for k in range(count)]


def run_spare(args, cfg, scheduler: str, phases, replica_bind: str | None) -> int:
    """`hetps ps --spare`: bind one backup socket per configured shard
    (`replica_bind` / --replica-advertise as the first, the next ports for the
    others), register as a spare, follow plans until the scheduler says stop.
    Returns the exit status (2: the config has no replicas to back up)."""
    if replica_bind is None:
        print(
            "hetps ps --spare: a spare needs cluster.replicas: 1 (it becomes a backup after a failover)",
            file=sys.stderr,
        )
        return 2
    slots = max(1, len(cfg.cluster.shards))
    binds = slot_addresses(replica_bind, slots)
    adverts = (
        slot_addresses(args.replica_advertise, slots) if args.replica_advertise else [None] * slots
    )
    root = args.checkpoint_dir or cfg.checkpoint.dir
    if args.check:
        check_and_exit(
            "ps --spare",
            rank=args.rank,
            scheduler=scheduler,
            slots=",".join(binds),
            config=args.config,
        )
    transport = transport_options(cfg)  # comm.shm_bytes; no node settings, so no link cap
    try:
        spare = Spare([make_server(b, transport) for b in binds], cfg, checkpoint_root=root)
        for slot, advertise in zip(spare.slots, adverts):
            slot.advertise = advertise or reachable(slot.server.address, scheduler)
        member = Membership(scheduler, "spare", args.rank, cfg.cluster, transport)
    except TransportError as exc:
        print(f"hetps ps --spare {args.rank}: {exc}", file=sys.stderr)
        return 1
    try:
        member.join(
            startup=phases.as_dict(), spare_slots=spare.addresses, agreed=agreed_values(cfg)
        )
        spare.set_node_id(member.node_id)
        plan = member.wait_plan()
        member.start_heartbeats(spare.stats)
        spare.follow(plan)
        log.info(
            "spare %d (node %d) waiting with %d backup slots at %s",
            member.rank,
            member.node_id,
            slots,
            ", ".join(spare.addresses),
        )
        serve_spare(spare, member)
        spare.final_checkpoint()
        if member.scheduler_lost:
            return scheduler_lost_exit("spare", member.rank, member.stop_reason)
        member.bye(spare.stats())
    except (SchedulerUnreachable, RequestTimeout, RemoteError) as exc:
        print(f"hetps ps --spare {args.rank}: {exc}", file=sys.stderr)
        return 1
    finally:
        member.close()
        spare.close()
    return 0
