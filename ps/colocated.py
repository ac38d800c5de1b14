"""Several shard ranks in one process (`hetps ps --ranks 0,1`,
cluster.shard_processes under `hetps run`).

Each rank is still a shard of its own: its own ROUTER socket and address,
registration, node id, heartbeats, plan follower, Shard object and
checkpoint folder, so the scheduler, the placement and the workers see the
same ranks as with one process each. Only the process is shared: one thread
serves every rank's socket in turn from one poll over all of them, so a
worker's exchange with two shards costs no context switch between shard
processes. Why one socket per rank rather than one socket with the rank in
the header: the wire, the plan and the workers stay exactly as they are.

Failure semantics: the ranks live and die together. A start-up failure of
one rank ends the process (every rank); killing the process kills every rank
it serves; a shard `slowdown` stretches the whole process's serving; the
link cap (`link_mbps`) and torch threads are per process, taken from the
first rank's node settings; a rank fetching a plan a push named (at most
PLAN_FETCH_S) holds up the others meanwhile; with a fixed --metrics-port P,
rank i of the process serves /metrics on P + i. Backups (cluster.replicas) are refused: a
primary and the backup of its neighbour could share the process that dies.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

import torch

from hetps.proto.rpc import Aborted, RemoteError, RequestTimeout
from hetps.proto.transport import (
    ServerPoll,
    ServerTransport,
    TransportError,
    TransportOptions,
    make_server,
)
from hetps.runconfig.agreement import agreed_values
from hetps.runconfig.algorithms import AlgorithmMismatch
from hetps.runconfig.schema import NodeConfig, RunConfig
from hetps.runtime.daemon import check_and_exit, scheduler_lost_exit, transport_options
from hetps.runtime.emulation import Slowdown
from hetps.runtime.membership import Membership, SchedulerUnreachable, reachable
from hetps.runtime.metrics import serve_metrics
from hetps.runtime.startup import Phases

from .serving import PlanFollower, open_checkpoints, restore_checkpoint
from .shard import Shard, profile_update_speed

log = logging.getLogger("hetps.ps")
POLL_S = 0.05  # longest wait for any rank's socket before the plan timers run again
DRAIN = 64  # requests one rank may take in a row before the next rank's turn


def rank_binds(template: str | None, ranks: list[int], cfg: RunConfig) -> list[str]:
    """Each rank's bind address: `template` with `{rank}` filled in, or
    tcp://<cluster.host>:0 (a random port) for every rank. Raises ValueError
    when one fixed address would be bound by several ranks."""
    template = template or f"tcp://{cfg.cluster.host}:0"
    if len(ranks) > 1 and "{rank}" not in template and not template.endswith(":0"):
        raise ValueError(
            f"--bind {template} names one address for {len(ranks)} ranks: put {{rank}} in it "
            "(e.g. ipc:///run/ps{rank}) or bind port 0"
        )
    return [template.replace("{rank}", str(r)) for r in ranks]


def run_colocated(args: argparse.Namespace, cfg: RunConfig, scheduler: str, phases: Phases) -> int:
    """Serve `args.ranks` until the scheduler says stop; the daemon's exit
    status (0 clean, 1 a peer unreachable, 2 bad flags, 3 scheduler lost)."""
    ranks = args.ranks
    try:
        binds = rank_binds(args.bind, ranks, cfg)
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"--ranks {','.join(map(str, ranks))} names a rank twice")
        if cfg.cluster.replicas:
            raise ValueError("--ranks with cluster.replicas: backups need one process per shard")
        if args.advertise:
            raise ValueError(
                "--ranks takes no --advertise: each rank advertises the address it bound "
                "(0.0.0.0: this host's address on its route to the scheduler)"
            )
        if args.restore_version and len(args.restore_version) != len(ranks):
            raise ValueError(
                f"--restore-version needs one version per rank ({len(ranks)}), "
                f"got {len(args.restore_version)}"
            )
    except ValueError as exc:
        print(f"hetps ps: {exc}", file=sys.stderr)
        return 2
    label_log_lines(ranks)
    if args.check:
        check_and_exit(
            "ps",
            ranks=",".join(map(str, ranks)),
            scheduler=scheduler,
            bind=",".join(binds),
            config=args.config,
        )
    node = cfg.cluster.shards[ranks[0]] if ranks[0] < len(cfg.cluster.shards) else NodeConfig()
    torch.set_num_threads(node.threads)
    ranks_served = ColocatedRanks(ranks, cfg, transport_options(cfg, node))
    try:
        ranks_served.open(binds, scheduler)
        phases.mark("config")
        return ranks_served.run(phases, args)
    except (TransportError, SchedulerUnreachable, RequestTimeout, RemoteError) as exc:
        print(f"hetps ps {','.join(map(str, ranks))}: {exc}", file=sys.stderr)
        return 1
    finally:
        ranks_served.close()


def label_log_lines(ranks: list[int]) -> None:
    """Log lines say `ps0,1` (every rank served), not the single rank daemon_setup assumed."""
    label = "ps" + ",".join(map(str, ranks))
    for handler in logging.getLogger().handlers:
        if type(handler) is logging.StreamHandler:  # the one basicConfig made, not a test runner's
            handler.setFormatter(
                logging.Formatter(f"%(asctime)s {label} %(levelname)s %(name)s: %(message)s")
            )


class ColocatedRanks:
    """The ranks of one process: servers, memberships, then shards. Not thread-safe
    (the heartbeat threads only read `stats`). `transport`: the options of every
    socket of the process (one emulated link for all ranks); None: plain sockets
    bounded by cluster.max_message_bytes."""

    def __init__(self, ranks: list[int], cfg: RunConfig, transport: TransportOptions | None = None):
        self.ranks, self.cfg = ranks, cfg
        self.transport = transport or TransportOptions(
            max_message_bytes=cfg.cluster.max_message_bytes
        )
        self.servers: list[ServerTransport] = []
        self.members: list[Membership] = []
        self.shards: list[Shard | None] = [None] * len(ranks)

    def open(self, binds: list[str], scheduler: str) -> None:
        """Bind every rank's socket and make its membership. Raises TransportError."""
        for rank, bind in zip(self.ranks, binds):
            self.servers.append(make_server(bind, self.transport))
            self.members.append(Membership(scheduler, "ps", rank, self.cfg.cluster, self.transport))

    def run(self, phases: Phases, args: argparse.Namespace) -> int:
        """Register every rank, build its shard, serve, finish; the exit status."""
        cfg, first = self.cfg, self.members[0]
        slowdowns = [
            Slowdown(cfg.cluster.shards[r] if r < len(cfg.cluster.shards) else NodeConfig())
            for r in self.ranks
        ]
        with first.starting():  # one profile: the ranks share this process's CPU
            speed = profile_update_speed(slowdowns[0])
            phases.mark("profile")
        for member, server in zip(self.members, self.servers):
            member.join(
                address=reachable(server.address, member.scheduler),
                speed=speed,
                startup=phases.as_dict(),
                agreed=agreed_values(cfg),
            )
        # the plan needs every rank registered
        plans = [member.wait_plan() for member in self.members]
        for i, member in enumerate(self.members):
            member.start_heartbeats(
                lambda i=i: self.shards[i].stats() if self.shards[i] is not None else {}
            )
        for i, (member, plan) in enumerate(zip(self.members, plans)):
            self.shards[i] = self._make_shard(i, plan, slowdowns[i], args)
        for i, (rank, shard) in enumerate(zip(self.ranks, self.shards)):
            # fixed: one per rank
            port = args.metrics_port + i if args.metrics_port > 0 else args.metrics_port
            serve_metrics(
                port,
                args.metrics_host or cfg.cluster.host,
                "ps",
                rank,
                shard.stats,
                algorithm=cfg.algorithm.name,
                targets=args.metrics_targets,
            )
        serve_ranks(self.shards, self.members, self.servers)
        return self.finish()

    def _make_shard(self, i: int, plan, slowdown: Slowdown, args: argparse.Namespace) -> Shard:
        member, rank = self.members[i], self.ranks[i]
        slowdown.start()
        with member.starting({AlgorithmMismatch: 2}):
            checkpointer = open_checkpoints(
                self.cfg, args.checkpoint_dir or self.cfg.checkpoint.dir, plan.run_id, rank
            )
            # pushes of a plan not adopted yet wait for it: the rank's PlanFollower fetches it
            shard = Shard(
                self.servers[i],
                member.node_id,
                plan,
                self.cfg,
                slowdown,
                checkpointer=checkpointer,
                park_future_pushes=True,
            )
            version = args.restore_version[i] if args.restore_version else None
            restore_checkpoint(shard, rank, version, args.resume)
        log.info(
            "shard %d (node %d) serving %d tensors at %s",
            rank,
            member.node_id,
            len(shard.store.specs),
            self.servers[i].address,
        )
        return shard

    def finish(self) -> int:
        """Last checkpoints and goodbyes once every rank was told to stop."""
        for shard, member in zip(self.shards, self.members):
            log.info("stopping shard %d: %s", member.rank, member.stop_reason)
            shard.maybe_checkpoint(force=True)
        lost = next((m for m in self.members if m.scheduler_lost), None)
        if lost is not None:
            return scheduler_lost_exit("ps", lost.rank, lost.stop_reason)
        for shard, member in zip(self.shards, self.members):
            member.bye(shard.stats())
        return 0

    def close(self) -> None:
        for member in self.members:
            member.close()
        for server in self.servers:
            server.close()


def serve_ranks(
    shards: list[Shard],
    members: list[Membership],
    servers: list[ServerTransport],
    poll_s: float = POLL_S,
) -> None:
    """Serve every rank from this thread until each was told to stop (or the
    scheduler is lost): a rank takes what is queued for it (up to DRAIN
    requests), runs its plan timer, and the thread then waits on all sockets
    at once, at most `poll_s` seconds. A rank told to stop is served no more."""
    followers = [PlanFollower(shard, member) for shard, member in zip(shards, members)]
    poll = ServerPoll(servers)
    with contextlib.suppress(Aborted):  # the scheduler was lost while a newer plan was fetched
        while not all(m.stop_requested.is_set() for m in members):
            for shard, member, plans in zip(shards, members, followers):
                if member.stop_requested.is_set():
                    continue
                for _ in range(DRAIN):
                    if not shard.serve_once(0):
                        break
                plans.tick()
            poll.wait(poll_s)
