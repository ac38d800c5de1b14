"""The shard daemon.

    hetps ps --config CONFIG --rank N [--scheduler tcp://HOST:PORT] [--bind tcp://0.0.0.0:0]
             [--advertise tcp://HOST:PORT] [--replica-bind ADDR] [--replica-advertise ADDR]
    hetps ps --spare --config CONFIG --rank N ...   (a spare: cluster.spare_shards, ps/spare.py)
    hetps ps --config CONFIG --ranks 0,1 [--bind 'ipc:///run/ps{rank}'] ...   (several ranks, ps/colocated.py)
    python -m hetps.ps ...   (the same)

The scheduler address comes from --scheduler, else $HETPS_SCHEDULER, else
cluster.scheduler in the config. The shard binds --bind (default: a random
port on cluster.host) and tells the scheduler --advertise (default: the bound
address; one bound on every interface, 0.0.0.0, as this host's address on its
route to the scheduler). It registers, waits for the plan, serves until the scheduler says
stop, then says goodbye. A scheduler silent for cluster.scheduler_grace_s is
given up on: the shard writes a last checkpoint (when checkpoints are on) and
exits with status 3, naming the scheduler's address.

With cluster.replicas > 0 the shard also serves the backup it holds on a
second socket: it binds --replica-bind (default: a random port on
cluster.host) and registers --replica-advertise (default: the bound address,
0.0.0.0 as above) as the address its primary forwards to.
"""

from __future__ import annotations

import argparse
import os
import sys

from hetps.runtime.daemon import (
    DaemonArgumentParser,
    address_arg,
    check_and_exit,
    common_args,
    daemon_setup,
    fast_exit,
    rank_label,
)
from hetps.runtime.startup import Phases, process_age_s


def main(argv: list[str] | None = None) -> int:
    phases = Phases(imports_s=process_age_s())  # reported in REGISTER: where the start-up went
    parser = DaemonArgumentParser(prog="hetps ps", description="parameter-server shard daemon")
    common_args(parser)
    parser.add_argument(
        "--bind",
        type=address_arg,
        default=os.environ.get("HETPS_BIND"),
        help="address to bind ($HETPS_BIND; default tcp://<cluster.host>:0)",
    )
    parser.add_argument(
        "--advertise",
        type=address_arg,
        default=os.environ.get("HETPS_ADVERTISE"),
        help="address workers should connect to ($HETPS_ADVERTISE; default: the bound one, "
        "0.0.0.0 replaced by this host's address on its route to the scheduler)",
    )
    parser.add_argument(
        "--replica-bind",
        type=address_arg,
        default=os.environ.get("HETPS_REPLICA_BIND"),
        help="with cluster.replicas: address the backup this shard holds binds "
        "($HETPS_REPLICA_BIND; default tcp://<cluster.host>:0)",
    )
    parser.add_argument(
        "--replica-advertise",
        type=address_arg,
        default=os.environ.get("HETPS_REPLICA_ADVERTISE"),
        help="with cluster.replicas: address other shards forward to it at "
        "($HETPS_REPLICA_ADVERTISE; default: the bound one, 0.0.0.0 replaced as for --advertise)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=os.environ.get("HETPS_CHECKPOINT_DIR"),
        help="write checkpoints here and restore the newest of this run at start "
        "($HETPS_CHECKPOINT_DIR; default checkpoint.dir)",
    )
    parser.add_argument(
        "--restore-version",
        type=int_list,
        default=None,
        help="restore the checkpoint of exactly this version (default: the newest); "
        "with --ranks, one version per rank, comma-separated",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="a resumed run (`hetps run --resume`): restore values, optimizer and versions, "
        "but not the old workers' clocks",
    )
    parser.add_argument(
        "--ranks",
        type=int_list,
        default=None,
        help="serve these shard ranks (comma-separated) from this one process, each on its own "
        "socket: --bind may name one address with {rank} in it (cluster.shard_processes)",
    )
    parser.add_argument(
        "--spare",
        action="store_true",
        help="a spare (cluster.spare_shards): own no tensors, hold new backups after failovers",
    )
    args = parser.parse_intermixed_args(argv)
    cfg, scheduler = daemon_setup(args, "ps")
    replica_bind = replica_bind_or_exit(args, cfg)
    if args.spare:
        from .spare import run_spare

        return run_spare(args, cfg, scheduler, phases, replica_bind)
    if args.ranks is not None:
        from .colocated import run_colocated

        return run_colocated(args, cfg, scheduler, phases)
    if args.check:
        check_and_exit(
            "ps",
            rank=rank_label(args.rank),
            scheduler=scheduler,
            bind=args.bind,
            advertise=args.advertise,
            replicas=cfg.cluster.replicas,
            replica_bind=replica_bind,
            replica_advertise=args.replica_advertise,
            config=args.config,
        )
    # only now the heavy imports (torch, the shard): `--check` and flag errors answer in a fraction of a second
    from .serving import run_shard

    return run_shard(args, cfg, scheduler, phases, replica_bind)


def int_list(value: str) -> list[int]:
    """A flag's comma-separated non-negative integers ("3" or "0,1"). Raises ArgumentTypeError."""
    try:
        numbers = [int(v) for v in value.split(",")]
    except ValueError:
        numbers = [-1]
    if min(numbers) < 0:
        raise argparse.ArgumentTypeError(f"want integers >= 0, comma-separated, got {value!r}")
    return numbers


def replica_bind_or_exit(args: argparse.Namespace, cfg) -> str | None:
    """The address the backup's socket binds (None without cluster.replicas;
    the flags are then ignored, so one manifest serves both). An advertised
    address needs a bound port it can name: --replica-advertise with a
    random replica port prints why and exits with status 2."""
    if not cfg.cluster.replicas:
        return None
    bind = args.replica_bind or f"tcp://{cfg.cluster.host}:0"
    if args.replica_advertise and bind.endswith(":0"):
        print(
            f"hetps ps: --replica-advertise {args.replica_advertise} needs --replica-bind with a fixed port "
            f"(the backup would bind {bind}, a random port other shards cannot know)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if args.replica_advertise and args.replica_advertise.endswith(":0"):
        print(
            f"hetps ps: --replica-advertise {args.replica_advertise}: port 0 cannot be reached; "
            "name the port --replica-bind binds",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return bind


if __name__ == "__main__":
    fast_exit(main())  # no interpreter teardown: seconds with torch loaded
