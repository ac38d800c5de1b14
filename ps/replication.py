"""Replicated shards (`cluster.replicas: 1`): primary-backup by replaying
the accepted pushes.

Every shard process is the primary of its own tensors and holds the backup of
its predecessor in the plan's speed ranking (a ring: the backup of shard k is
shard k+1, the last one's is the first). A backup is a second `Shard` of the
primary's tensors, with its own policy and optimizer, served on a second
socket of the backup's process (`replica_address`).

What travels is the *applied update*, not the state: the primary forwards,
in the order it handled them, every INIT that initialized it, every PUSH it
ran through its policy (with the worker's node id and request id), and every
plan switch that changed the worker set or the groups (as a PLAN message).
The backup runs the same code on the same inputs in the same order and holds
the same tensors, optimizer moments, rounds, clocks and per-worker last ACK
(so a push re-sent after a failover is answered, not applied again). Replay
costs one push's bytes per push, where shipping the post-update state would
cost the tensors plus the optimizer state on every update.

A reply of the primary (an ACK, or values) leaves only once the backup has
confirmed every forwarded message before it: a worker never sees an update
that the backup lacks, so what was acknowledged survives the primary.
Replies wait in `Replicator.held`; the shard's loop never blocks on its backup
(two shards backing each other cannot deadlock).

When the scheduler declares a primary dead it publishes a plan that names the
backup's address for those tensors (`plan.served_by`); the backup's process
promotes it, and workers re-send what was unanswered to the new address.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from dataclasses import dataclass

import zmq

from hetps.proto.codec import Envelope, ProtocolError, decode, encode
from hetps.proto.layout import PACK_BELOW
from hetps.proto.messages import Ack, Error, Message, Plan, Snapshot, Status
from hetps.proto.plan import ClusterPlan
from hetps.proto.transport import ServerTransport, TransportOptions, make_client
from hetps.runtime import checkpoint

from .shard import Shard
from .state_copy import load_snapshot, snapshot_of

log = logging.getLogger(__name__)
# while the backup's confirmation is due, the longest block on the workers' socket
PENDING_POLL_S = 0.001


def same_members(a: ClusterPlan, b: ClusterPlan) -> bool:
    """True when plan `b` differs from `a` only in where shards are (a
    failover): the policies keep their rounds and plan id."""
    return (
        a.worker_ids() == b.worker_ids()
        and a.groups == b.groups
        and a.shares == b.shares
        and a.algorithm_params == b.algorithm_params
    )


def backup_of(plan: ClusterPlan, node_id: int) -> str | None:
    """The address of the backup of shard `node_id` in `plan`, or None."""
    entry = plan.backups.get(str(node_id))
    return entry["address"] if entry else None


def backed_by(plan: ClusterPlan, node_id: int) -> int | None:
    """The shard whose backup process `node_id` holds in `plan`, or None."""
    return next((int(k) for k, b in plan.backups.items() if b["node"] == node_id), None)


@dataclass
class Held:
    peer: bytes
    req_id: int
    msg: Message
    upto: int  # leaves once the backup confirmed this many forwarded messages


class Replicator:
    """The primary's link to its backup: forwards messages in order and holds
    replies until the backup confirmed what they depend on. Never blocks
    (but for a capped link's sleeps). `options`: how its socket is made (the
    shard's own, `server.options`: the process's link and shared memory)."""

    def __init__(self, address: str, options: TransportOptions | None, send):
        self.address = address
        self.client = make_client(address, options)
        self.send = send  # (peer, req_id, msg) -> sends a reply for real
        self.sent = 0  # messages forwarded
        self.confirmed = 0  # of which the backup answered (in order: one connection)
        self.errors = 0  # answered with ERROR (the backup refused what the primary took)
        self.held: deque[Held] = deque()

    @property
    def pending(self) -> bool:
        return self.confirmed < self.sent

    @property
    def bytes_sent(self) -> int:
        return self.client.bytes_sent

    def forward(self, msg: Message, req_id: int, src: int) -> None:
        # a SNAPSHOT unpacked: each of its frames within cluster.max_message_bytes (state_copy.py)
        self.client.send(
            encode(msg, req_id, src, pack_below=0 if isinstance(msg, Snapshot) else PACK_BELOW)
        )
        self.sent += 1

    def hold(self, peer: bytes, req_id: int, msg: Message) -> bool:
        """Keep a reply back while anything forwarded is unconfirmed; False: send it now."""
        if not self.pending and not self.held:
            return False
        self.held.append(Held(peer, req_id, msg, self.sent))
        return True

    def pump(self) -> None:
        """Take the backup's confirmations that arrived; send the replies they free."""
        while self.pending:
            frames = self.client.recv(0.0)
            if frames is None:
                break
            self.confirmed += 1
            reply = decode(frames).msg
            if isinstance(reply, Error):
                self.errors += 1
                log.error(
                    "the backup at %s refused a replicated message: %s", self.address, reply.message
                )
        while self.held and self.held[0].upto <= self.confirmed:
            h = self.held.popleft()
            self.send(h.peer, h.req_id, h.msg)

    def drop(self) -> None:
        """The backup is gone (a new plan says so): release every held reply."""
        self.confirmed = self.sent
        self.pump()
        self.client.close()


class ReplicatedShard(Shard):
    """A shard with `cluster.replicas: 1`, in one of two roles: `primary`
    (serves workers, forwards to its backup, holds replies until confirmed)
    or `backup` (applies what its primary forwards; promoted by a plan)."""

    def __init__(self, *args, role: str = "primary", **kwargs):
        super().__init__(*args, **kwargs)
        self.role = role
        self.replicator: Replicator | None = None
        self._deferring = False
        self._released_by: int | None = None  # the push that freed parked pulls while deferring
        self.primary_peer: bytes | None = None  # a backup: the connection its primary forwards on
        # a backup: workers' requests before its promotion
        self.early: list[tuple[bytes, Envelope]] = []
        self.counts.update(replicated=0)
        if role == "primary":
            self._follow_backup(self.plan)

    # ------------------------------------------------------------ serving
    def serve_once(self, timeout_s: float) -> bool:
        if self.replicator is not None and self.replicator.pending:
            self.replicator.pump()
            timeout_s = min(timeout_s, PENDING_POLL_S)
        handled = super().serve_once(timeout_s)
        if self.replicator is not None:
            self.replicator.pump()
        return handled

    def sockets(self) -> list:
        """The ZeroMQ sockets this shard reads (empty for in-process transports)."""
        socks = [getattr(self.server, "sock", None)]
        if self.replicator is not None:
            socks.append(getattr(self.replicator.client, "sock", None))
        return [s for s in socks if s is not None]

    def stats(self) -> dict:
        out = super().stats()
        if self.replicator is not None:
            out.update(
                replica_bytes=self.replicator.bytes_sent,
                replica_held=len(self.replicator.held),
                replica_errors=self.replicator.errors,
            )
        return out

    def reply(self, peer: bytes, req_id: int, msg):
        if self.replicator is not None and self.replicator.hold(peer, req_id, msg):
            return None
        return super().reply(peer, req_id, msg)

    # ------------------------------------------------------------ forwarding
    @contextlib.contextmanager
    def _forwarding(self):
        """Parked pulls freed inside are answered after the forward, so their
        replies are held behind it."""
        outer, self._deferring = self._deferring, True
        try:
            yield
        finally:
            self._deferring = outer
            if not outer:
                self._serve_parked()
                self._serve_parked_rows()

    def _serve_parked(self, released_by: int | None = None) -> None:
        # answered after the forward; the worker that released them is credited then
        if self._deferring:
            self._released_by = released_by if released_by is not None else self._released_by
            return
        released_by, self._released_by = (
            (released_by if released_by is not None else self._released_by),
            None,
        )
        super()._serve_parked(released_by=released_by)

    def _serve_parked_rows(self) -> None:
        # as parked pulls: answered after the forward, so their replies are held behind it
        if not self._deferring:
            super()._serve_parked_rows()

    def _forward(self, env: Envelope) -> None:
        if self.replicator is not None:
            self.replicator.forward(env.msg, env.req_id, env.src)
            self.counts["replicated"] += 1

    def _early(self, peer: bytes, env: Envelope) -> bool:
        """A backup keeps a worker's request (one that learned of the failover
        before this process did) until its promotion, then answers it as a primary."""
        if self.role == "backup" and self.primary_peer is None:
            self.primary_peer = peer  # workers learn a backup's address only from a failover plan
        if self.role == "backup" and peer != self.primary_peer:
            self.early.append((peer, env))
            return True
        return False

    def on_pull(self, peer: bytes, env: Envelope):
        return None if self._early(peer, env) else super().on_pull(peer, env)

    def on_init(self, peer: bytes, env: Envelope):
        if self._early(peer, env):
            return None
        with self._forwarding():
            ack = super().on_init(peer, env)
            if ack.info.get("first") and self.role == "primary":
                self._forward(env)
        return ack

    def on_push(self, peer: bytes, env: Envelope):
        if self.role == "primary":
            return super().on_push(peer, env)
        if self._early(peer, env):
            return None
        if self.policy is None:  # the primary forwards only what it applied, after its INIT
            raise ProtocolError(Status.NOT_READY, "this backup has no INIT yet")
        return self._apply_push(env)  # no parking, no values: the primary answers the worker

    def on_pull_rows(self, peer: bytes, env: Envelope):
        return None if self._early(peer, env) else super().on_pull_rows(peer, env)

    def on_push_rows(self, peer: bytes, env: Envelope):
        if self.role == "primary":
            return super().on_push_rows(peer, env)
        if self._early(peer, env):
            return None
        return self._apply_row_push(env)  # a backup's ACK goes to its primary only

    def _apply_row_push(self, env: Envelope) -> Ack:
        if self.role != "primary":
            return super()._apply_row_push(env)
        retried = self.counts["retried"]
        with self._forwarding():
            ack = super()._apply_row_push(env)  # raises, with nothing applied, for a refused push
            if self.counts["retried"] == retried:
                self._forward(env)
        return ack

    def on_plan(self, peer: bytes, env: Envelope):
        """A backup follows its primary's plan switches where they happened in the push order."""
        self._from_primary(peer, "PLAN is only forwarded to a backup, by its primary")
        self.adopt(env.msg.plan)
        return Ack(plan_id=self.plan.plan_id)

    def on_snapshot(self, peer: bytes, env: Envelope):
        """A backup made after training began becomes a copy of its primary (state_copy.py)."""
        self._from_primary(peer, "SNAPSHOT is only sent to a backup, by its primary")
        return load_snapshot(self, env.msg)

    def _from_primary(self, peer: bytes, refusal: str) -> None:
        """ProtocolError (BAD_STATE, `refusal`) unless this is a backup and `peer` its
        primary's connection (the first peer that sends a backup anything is)."""
        if self.role == "backup" and self.primary_peer is None:
            self.primary_peer = peer
        if self.role != "backup" or peer != self.primary_peer:
            raise ProtocolError(Status.BAD_STATE, refusal)

    def _apply_push(self, env: Envelope) -> Ack:
        if self.role != "primary":
            return super()._apply_push(env)
        with self._forwarding():
            return super()._apply_push(env)  # raises, with nothing applied, for a refused push

    def _take_push(self, env: Envelope) -> Ack:
        ack = super()._take_push(env)
        if self.role == "primary":  # a new push, applied: forwarded as applied (NaN/Inf mended)
            self._forward(env)
        return ack

    # ------------------------------------------------------------ plans
    def adopt(self, plan: ClusterPlan) -> None:
        """Switch plans. A plan that only moves shards (a failover) keeps the
        rounds open; one that changes workers or groups closes them (Shard.adopt),
        and a primary forwards it to its backup at this point of the push order."""
        if plan.placement_id != self.plan.placement_id:
            raise ValueError(
                f"plan {plan.plan_id} moves tensors; live re-placement is not supported"
            )
        if same_members(self.plan, plan):
            self.plan = plan
        else:
            with self._forwarding():
                self.store.settle()
                self.plan = plan
                if self.policy is not None:
                    self.policy.adopt(plan)
                self.close_row_rounds()
                if self.role == "primary" and self.replicator is not None:
                    self.replicator.forward(Plan(plan_id=plan.plan_id, plan=plan), 0, self.node_id)
        if self.role == "primary":
            self._follow_backup(plan)
        self._serve_parked()
        self.take_future_pushes(plan.plan_id)

    def promote(self, plan: ClusterPlan) -> None:
        """This backup serves its tensors from now on (a failover plan names it)."""
        log.warning(
            "backup of shard node %d promoted to primary by plan %d (version %d)",
            self.node_id,
            plan.plan_id,
            self.store.version,
        )
        self.role = "primary"
        self.adopt(plan)
        early, self.early = self.early, []
        for peer, env in early:  # as Service.serve_once would have handled them
            try:
                answer = self.handlers[env.msg.OP](peer, env)
            except ProtocolError as err:
                answer = Error(status=int(err.status), message=err.message)
            if answer is not None:
                self.reply(peer, env.req_id, answer)

    def _follow_backup(self, plan: ClusterPlan) -> None:
        address = backup_of(plan, self.node_id)
        if self.replicator is not None and self.replicator.address != address:
            log.warning(
                "shard node %d: backup at %s is gone from plan %d",
                self.node_id,
                self.replicator.address,
                plan.plan_id,
            )
            self.replicator.drop()
            self.replicator = None
        if address and self.replicator is None:
            self.replicator = Replicator(
                address,
                self.server.options,
                lambda peer, req, msg: Shard.reply(self, peer, req, msg),
            )
            # training began: the new backup starts from a copy of this state
            if self.policy is not None:
                log.warning(
                    "shard node %d: copying state (version %d) to the new backup at %s (plan %d)",
                    self.node_id,
                    self.store.version,
                    address,
                    plan.plan_id,
                )
                self.replicator.forward(snapshot_of(self), 0, self.node_id)


class ReplicaHost:
    """The backup one shard process holds (for its predecessor in the ring),
    on its own socket; made when the plan names this process as a backup."""

    def __init__(
        self,
        server: ServerTransport,
        cfg,
        node_id: int = 0,
        checkpoint_root: str | None = None,
        advertise: str | None = None,
    ):
        self.server = server
        # what the shard registers (--replica-advertise, or reachable()); else bound
        self.advertise = advertise
        self.checkpoint_root = checkpoint_root
        self.cfg = cfg
        self.node_id = node_id
        self.shadow: ReplicatedShard | None = None

    @property
    def address(self) -> str:
        """Where primaries forward to: the advertised address, else the bound one."""
        return self.advertise or self.server.address

    def follow(self, plan: ClusterPlan) -> None:
        """Take a plan: make the backup it names, promote it when the plan
        says this process serves its tensors now, or pass the plan on to a
        promoted one."""
        if self.shadow is None:
            primary = self.primary_in(plan)
            if primary is None:
                return
            self.shadow = ReplicatedShard(self.server, primary, plan, self.cfg, role="backup")
            log.info("holding the backup of shard node %d at %s", primary, self.address)
            return
        shadow = self.shadow
        if shadow.role == "backup" and plan.served_by.get(str(shadow.node_id)) == self.node_id:
            shadow.promote(plan)
            self._start_checkpoints()
        elif shadow.role == "primary" and plan.plan_id > shadow.plan.plan_id:
            shadow.adopt(plan)

    def primary_in(self, plan: ClusterPlan) -> int | None:
        """The shard whose backup `plan` puts here, or None."""
        return backed_by(plan, self.node_id)

    def _start_checkpoints(self) -> None:
        """A promoted backup checkpoints into the dead shard's folder (under
        this process's checkpoint directory), from its current version on."""
        if not self.checkpoint_root or self.shadow.policy is None:
            return
        shadow = self.shadow
        folder = checkpoint.shard_dir(self.checkpoint_root, shadow.plan.run_id, shadow.node_rank())
        shadow.checkpoint_to(checkpoint.Checkpointer(self.cfg.checkpoint, folder))
        shadow.maybe_checkpoint(force=True)

    def final_checkpoint(self) -> None:
        """At the stop: a promoted backup writes a point to resume from, as a shard does."""
        if self.shadow is not None and self.shadow.role == "primary":
            self.shadow.maybe_checkpoint(force=True)

    def serve_once(self, timeout_s: float) -> bool:
        return self.shadow.serve_once(timeout_s) if self.shadow is not None else False

    def stats(self) -> dict:
        """The backup's numbers, for the process's heartbeats: `backup` is
        {of: shard node id, role, version, accepted, pushes, retried, row_pushes,
        sparse_updates} once one is held."""
        if self.shadow is None:
            return {}
        s = self.shadow
        return {
            "backup": {
                "of": s.node_id,
                "role": s.role,
                "version": s.store.version,
                "accepted": s.policy.counts["accepted"] if s.policy else 0,
                "pushes": s.counts["pushes"],
                "retried": s.counts["retried"],
                # sparse tables: row pushes taken and updates applied (one per push under the
                # asynchronous families, one per round under the synchronous ones)
                "row_pushes": s.counts["row_pushes"],
                "sparse_updates": s.sparse.updates if s.sparse is not None else 0,
            }
        }

    def close(self) -> None:
        self.server.close()


def serve_round(shard: ReplicatedShard, host: ReplicaHost, timeout_s: float) -> None:
    """One turn of a replicated shard process's loop: wait (at most
    `timeout_s`) for any of its sockets, then serve the shard and the backup it
    holds. With ZeroMQ the wait is one poll over every socket; in-process
    transports are served in turn."""
    parts = [shard] + ([host.shadow] if host.shadow is not None else [])
    socks = [s for p in parts for s in p.sockets()]
    if len(socks) == sum(1 + (p.replicator is not None) for p in parts):
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        poller.poll(timeout=int(timeout_s * 1000))  # a confirmation from a backup wakes it too
        for p in parts:
            for _ in range(64):  # bounded: the other part gets its turn
                if not p.serve_once(0.0):
                    break
        return
    for p in parts:
        p.serve_once(timeout_s / len(parts))
