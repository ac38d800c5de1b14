"""The `hetps` command.

    hetps run CONFIG [key=value ...] [--out DIR] [--quiet] [--metrics]   a whole local cluster
    hetps compare CONFIG --algorithms a,b,c [--repeats N] [--with ALGO key=value] [--out DIR]
    hetps scheduler --config CONFIG [--bind ADDR] [--run-dir DIR]
    hetps ps        --config CONFIG --rank N [--scheduler ADDR]
    hetps worker    --config CONFIG --rank N [--scheduler ADDR] [--evaluator]

With no command, $HETPS_ROLE names it (containers). `ps` and `worker` hand over to `python -m hetps.ps` / `python -m hetps.worker`
(the roles never import each other). Exit status 2 means a bad config or
command line.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hetps.proto.daemon import load_or_exit

ROLE_MODULES = {"ps": "hetps.ps", "worker": "hetps.worker"}


def run_command(argv: list[str]) -> int:
    from .launcher import default_run_dir, run_local

    parser = argparse.ArgumentParser(prog="hetps run", description="train one experiment on a local cluster")
    parser.add_argument("config", help="YAML experiment, e.g. configs/default.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    parser.add_argument("--out", default=None, help="run directory (default: out_dir/NAME-ALGO-TIME)")
    parser.add_argument("--quiet", action="store_true", help="no progress line or summary")
    parser.add_argument("--metrics", action="store_true",
                        help="every daemon serves Prometheus /metrics on a free port (its log says where)")
    args = parser.parse_intermixed_args(argv)
    cfg = load_or_exit(args.config, args.overrides)
    run_dir = Path(args.out) if args.out else default_run_dir(cfg)
    return run_local(cfg, run_dir, quiet=args.quiet, metrics=args.metrics)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = ("run", "compare", "scheduler", "ps", "worker")
    if (not argv or argv[0] not in commands) and os.environ.get("HETPS_ROLE") in commands:
        argv = [os.environ["HETPS_ROLE"], *argv]  # containers: the role from the environment
    if not argv or argv[0] not in commands:
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        return run_command(rest)
    if command == "compare":
        from .compare import compare_command

        return compare_command(rest)
    if command == "scheduler":
        from .__main__ import main as scheduler_main

        return scheduler_main(rest)
    os.execv(sys.executable, [sys.executable, "-m", ROLE_MODULES[command], *rest])
    return 1  # not reached: execv replaces this process


if __name__ == "__main__":
    sys.exit(main())
