"""A shard daemon's life after its flags are checked (`hetps ps`, ps/__main__.py):
bind, profile, register, wait for the plan, serve until the scheduler says
stop, checkpoint, say goodbye. Kept apart from the flag parsing so that
`hetps ps --check` and a flag error never import torch."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

import torch

from hetps.proto.rpc import Aborted, RemoteError, RequestTimeout
from hetps.proto.transport import TransportError, make_server
from hetps.runconfig.agreement import agreed_values
from hetps.runconfig.algorithms import AlgorithmMismatch
from hetps.runconfig.schema import NodeConfig, RunConfig
from hetps.runtime import checkpoint
from hetps.runtime.daemon import scheduler_lost_exit, transport_options
from hetps.runtime.emulation import Slowdown
from hetps.runtime.membership import Membership, SchedulerUnreachable, reachable
from hetps.runtime.metrics import serve_metrics
from hetps.runtime.optim import check_optimizer
from hetps.runtime.startup import Phases

from .replication import ReplicaHost, ReplicatedShard, serve_round
from .shard import Shard, profile_update_speed

log = logging.getLogger("hetps.ps")
# longest wait for a plan a push names; the scheduler answers at once when it has it
PLAN_FETCH_S = 1.0


def run_shard(
    args: argparse.Namespace,
    cfg: RunConfig,
    scheduler: str,
    phases: Phases,
    replica_bind: str | None,
) -> int:
    """Serve shard `args.rank` until the run stops; the daemon's exit status."""
    # `--rank auto` (rank < 0): the default node settings, the rank comes at registration
    node = (
        cfg.cluster.shards[args.rank] if 0 <= args.rank < len(cfg.cluster.shards) else NodeConfig()
    )
    torch.set_num_threads(node.threads)
    # every socket of this process: comm.shm_bytes (co-located worker -> shard frames,
    # docs/big-messages.md) and one emulated link of the node's link_mbps, shared by all
    transport = transport_options(cfg, node)
    slowdown = Slowdown(node)
    try:
        server = make_server(args.bind or f"tcp://{cfg.cluster.host}:0", transport)
        # cluster.replicas: the backup this process will hold is served on a second socket
        host = None
        if cfg.cluster.replicas:
            replica_server = make_server(replica_bind, transport)
            host = ReplicaHost(
                replica_server,
                cfg,
                checkpoint_root=args.checkpoint_dir or cfg.checkpoint.dir,
                advertise=args.replica_advertise or reachable(replica_server.address, scheduler),
            )
        member = Membership(scheduler, "ps", args.rank, cfg.cluster, transport)
        phases.mark("config")
    except TransportError as exc:
        print(f"hetps ps {args.rank}: {exc}", file=sys.stderr)
        return 1
    try:
        with member.starting():  # reported to the scheduler, which ends the run naming this shard
            # the optimizer and lr schedule are built at the first INIT: one that cannot be built
            # fails the shard's start, not every worker's INIT
            check_optimizer(cfg.optimizer)
            speed = profile_update_speed(slowdown)
            phases.mark("profile")
        member.join(
            address=args.advertise or reachable(server.address, scheduler),
            speed=speed,
            startup=phases.as_dict(),
            replica_address=host.address if host else "",
            agreed=agreed_values(cfg),
        )
        args.rank = member.rank  # `--rank auto`: from here on, the rank the scheduler gave
        plan = member.wait_plan()
        # heartbeats from the moment the plan arrives (the scheduler counts silence from then on):
        # restoring a large checkpoint may take a while
        shard = None
        member.start_heartbeats(lambda: process_stats(shard, host) if shard is not None else {})
        slowdown.start()
        # a mismatching algorithm block is a config error
        with member.starting({AlgorithmMismatch: 2}):
            checkpointer = open_checkpoints(
                cfg, args.checkpoint_dir or cfg.checkpoint.dir, plan.run_id, args.rank
            )
            # pushes of a plan not adopted yet wait for it: PlanFollower fetches it
            kind = Shard if host is None else ReplicatedShard
            shard = kind(
                server,
                member.node_id,
                plan,
                cfg,
                slowdown,
                checkpointer=checkpointer,
                park_future_pushes=True,
            )
            if host is not None:
                host.node_id = member.node_id
                host.follow(plan)
            restore_checkpoint(
                shard,
                args.rank,
                args.restore_version[0] if args.restore_version else None,
                args.resume,
            )

        log.info(
            "shard %d (node %d) serving %d tensors at %s",
            args.rank,
            member.node_id,
            len(shard.store.specs),
            server.address,
        )
        serve_metrics(
            args.metrics_port,
            args.metrics_host or cfg.cluster.host,
            "ps",
            args.rank,
            shard.stats,
            algorithm=cfg.algorithm.name,
            targets=args.metrics_targets,
        )
        serve(shard, member, host)
        log.info("stopping: %s", member.stop_reason)
        # workers have stopped (or, the scheduler lost, will): a point to resume from
        shard.maybe_checkpoint(force=True)
        if host is not None:
            host.final_checkpoint()
        if member.scheduler_lost:
            return scheduler_lost_exit("ps", args.rank, member.stop_reason)
        member.bye(process_stats(shard, host))
    except (SchedulerUnreachable, RequestTimeout, RemoteError) as exc:
        print(f"hetps ps {args.rank}: {exc}", file=sys.stderr)
        return 1
    finally:
        member.close()
        server.close()
        if host is not None:
            host.close()
    return 0


def process_stats(shard: Shard, host: ReplicaHost | None) -> dict:
    """What heartbeats report: the shard's numbers, and the backup's it holds."""
    return {**shard.stats(), **(host.stats() if host is not None else {})}


def serve(shard: Shard, member: Membership, host: ReplicaHost | None = None) -> None:
    """Serve until the scheduler says stop (or is lost), adopting newer plans;
    with `host`, the backup it holds too."""
    plans = PlanFollower(shard, member, host)
    with contextlib.suppress(Aborted):  # the scheduler was lost while a newer plan was fetched
        while not member.stop_requested.is_set():
            if host is None:
                shard.serve_once(0.05)
            else:
                serve_round(shard, host, 0.05)
            plans.tick()


class PlanFollower:
    """The serve loop's plan timer: fetch the plan a heartbeat announced, or
    the one a parked push was made under, and adopt it (which answers the
    pushes waiting for it). Guarded like a handler: a plan that cannot be
    fetched or adopted (e.g. one that moves tensors) is logged and counted in
    the shard's `timer_errors`, and the shard keeps serving the plan it has.
    `tick` blocks while it fetches: at once when the scheduler has the plan
    (it gave it to the worker that pushed), at most PLAN_FETCH_S when it does
    not (a bogus id); the pushes of such a plan are then taken under the
    shard's plan, and later ones naming it are taken without waiting."""

    def __init__(self, shard: Shard, member: Membership, host: ReplicaHost | None = None):
        self.shard, self.member, self.host = shard, member, host
        self.refused = 0  # newest plan id that could not be adopted: not fetched again
        self.gave_up = 0  # pushes naming plans up to this id do not wait for them

    def tick(self) -> None:
        shard, member = self.shard, self.member
        wanted = shard.future_pushes.wanted()
        try:
            if wanted > max(shard.plan.plan_id, self.gave_up):
                try:
                    self._adopt(member.wait_plan(shard.plan.plan_id, timeout_s=PLAN_FETCH_S))
                except RequestTimeout:
                    self.gave_up = wanted
                    log.warning(
                        "plan %d, named by a push, did not come within %ss: taking its pushes under "
                        "plan %d",
                        wanted,
                        PLAN_FETCH_S,
                        shard.plan.plan_id,
                    )
            elif member.latest_plan_id > max(shard.plan.plan_id, self.refused):
                newer = member.newer_plan(shard.plan.plan_id)
                if newer is not None:
                    self._adopt(newer)
        except Aborted:
            raise
        except Exception:
            shard.count_timer_error()
            self.gave_up = max(self.gave_up, wanted)
            log.exception("could not adopt a newer plan; serving plan %d on", shard.plan.plan_id)
        if shard.future_pushes.parked and shard.future_pushes.wanted() <= max(
            self.gave_up, shard.plan.plan_id
        ):
            shard.take_future_pushes()

    def _adopt(self, plan) -> None:
        try:
            self.shard.adopt(plan)
            if self.host is not None:  # the backup it holds: promoted, or following as a primary
                self.host.follow(plan)
        except Exception:
            self.refused = max(self.refused, plan.plan_id)
            raise


def open_checkpoints(
    cfg: RunConfig, root: str | None, run_id: str, rank: int
) -> checkpoint.Checkpointer | None:
    """The checkpointer of shard `rank`'s folder under `root` (None when no directory is
    given: checkpoints off), with the temporary files of writes that never finished removed."""
    if not root:
        return None
    folder = checkpoint.shard_dir(root, run_id, rank)
    for tmp in checkpoint.remove_leftovers(folder):
        log.info("removed %s, left behind by a write that never finished", tmp)
    return checkpoint.Checkpointer(cfg.checkpoint, folder)


def restore_checkpoint(shard: Shard, rank: int, version: int | None, resume: bool = False) -> None:
    """Continue from the newest valid checkpoint in the shard's checkpoint folder (or
    `version`'s) if there is one, then start its checkpoints; `resume`: new workers.
    Nothing when the shard has no checkpointer. A damaged checkpoint is passed over for
    the next older valid one: logged naming its file, set aside as *.damaged and named
    in the shard's stats (`checkpoints_damaged`, which the scheduler records as
    `checkpoint_damaged` failures). Raises checkpoint.NoValidCheckpoint (naming the
    folder) when every checkpoint is damaged, CheckpointDamaged when `version`'s is: a
    start-up failure the scheduler ends the run with."""
    if shard.checkpointer is None:
        return
    folder = shard.checkpointer.folder
    point = checkpoint.restore_point(folder, version)
    if version is not None and point.path is None:
        raise SystemExit(f"hetps ps {rank}: no checkpoint of version {version} in {folder}")
    for damaged in point.damaged:
        log.error("%s; set aside as %s.damaged", damaged, damaged.path.name)
    if point.path is not None:
        shard.restore(point.state, new_workers=resume)
        checkpoint.abandon_after(folder, shard.store.version, {d.path for d in point.damaged})
    # (a damaged one implies a restored one: with none valid, restore_point raised)
    shard.checkpointer.start(
        shard.store.version if point.path is not None else -1,
        [{**d.report(), "restored_version": shard.store.version} for d in point.damaged],
    )
    log.info("checkpoints in %s%s", folder, f"; restored {point.path.name}" if point.path else "")


def setup_checkpoints(
    shard: Shard, root: str | None, rank: int, version: int | None, resume: bool = False
) -> None:
    """Turn checkpoints on for a shard made without them (when a directory is given) and
    continue from this run's newest valid checkpoint (or `version`): `restore_checkpoint`,
    which says what is raised."""
    checkpointer = open_checkpoints(shard.cfg, root, shard.plan.run_id, rank)
    if checkpointer is not None:
        shard.checkpoint_to(checkpointer)
        restore_checkpoint(shard, rank, version, resume)
