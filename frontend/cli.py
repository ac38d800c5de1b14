"""The `hetps` command.

    hetps run CONFIG [key=value ...] [--out DIR] [--quiet] [--metrics] [--tensorboard]   a whole local cluster
    hetps run --resume RUN_DIR [key=value ...]                          continue a stopped run
    hetps compare CONFIG --algorithms a,b,c [--repeats N] [--with ALGO key=value] [--out DIR] [--x time|steps|bytes]
                  [--simulate]
    hetps simulate CONFIG [key=value ...] [--out DIR] [--quiet] [--replay RUN_DIR [--workers N]]
                                           the same experiment in virtual time, one process
    hetps plot    RUN_DIR_OR_COMPARE_DIR [--x time|steps|bytes]   draw a run's or a comparison's plots again
    hetps scheduler --config CONFIG [--bind ADDR] [--run-dir DIR]
    hetps ps        --config CONFIG --rank N [--scheduler ADDR]
    hetps worker    --config CONFIG --rank N [--scheduler ADDR] [--evaluator]
    hetps keys      DIR [--clients N]      CurveZMQ key pairs and allow-list (security.curve)
    hetps config    CONFIG [key=value ...]  print the resolved config (every error at once, exit 2)
    hetps export    RUN_DIR_OR_CHECKPOINT_DIR --out FILE.safetensors [--config CONFIG]
                                           the trained model from shard checkpoints

With no command, $HETPS_ROLE names it (containers). `ps` and `worker` hand over to `python -m hetps.ps` / `python -m hetps.worker`
(the roles never import each other). Exit status 2 means a bad config or
command line; `hetps run` also exits 1 when a node failed, 3 when training
diverged and 130 when interrupted (scheduler/outcome.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hetps.runtime.daemon import load_or_exit
from hetps.runtime.import_path import import_beside

ROLE_MODULES = {"ps": "hetps.ps", "worker": "hetps.worker", "export": "hetps.training.export"}


def run_command(argv: list[str]) -> int:
    from hetps.scheduler.tensorboard import missing as tensorboard_missing
    from hetps.scheduler.tracking import missing as tracking_missing

    from .launcher import default_run_dir, run_local

    parser = argparse.ArgumentParser(
        prog="hetps run", description="train one experiment on a local cluster"
    )
    parser.add_argument(
        "config",
        nargs="?",
        help="YAML experiment, e.g. configs/default.yaml "
        "(with --resume: the run's own config.yaml)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    parser.add_argument(
        "--out", default=None, help="run directory (default: out_dir/NAME-ALGO-TIME)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress line or summary")
    parser.add_argument(
        "--metrics",
        action="store_true",
        help="every daemon serves Prometheus /metrics on a free port, listed in "
        "RUN_DIR/prometheus_targets.json (a file_sd file)",
    )
    parser.add_argument(
        "--resume", metavar="RUN_DIR", help="continue a stopped run from its checkpoints"
    )
    parser.add_argument(
        "--tensorboard",
        action="store_true",
        help="TensorBoard event files in RUN_DIR/tensorboard (log.tensorboard=true)",
    )
    args = parser.parse_intermixed_args(argv)
    if args.tensorboard:
        args.overrides.append("log.tensorboard=true")
    if args.resume:
        return resume_command(args)
    if args.config is None or "=" in args.config:
        parser.error("the config file is required (or --resume RUN_DIR)")
    import_beside(args.config)
    cfg = load_or_exit(args.config, args.overrides, import_targets=True)
    if cfg.log.tensorboard and (problem := tensorboard_missing()):
        print(f"hetps run: {problem}", file=sys.stderr)
        return 2
    if problem := tracking_missing(cfg):
        print(f"hetps run: config error: {problem}", file=sys.stderr)
        return 2
    run_dir = Path(args.out) if args.out else default_run_dir(cfg)
    return run_local(cfg, run_dir, quiet=args.quiet, metrics=args.metrics)


def simulate_command(argv: list[str]) -> int:
    from hetps.runconfig.schema import ConfigError
    from hetps.scheduler.runlog import SummaryFile
    from hetps.sim.engine import check_simulable, simulate
    from hetps.training.preflight import ConfigValueError, PreflightError

    from .launcher import default_run_dir
    from .plots import plot_simulated
    from .sample_cost import sample_cost, sample_s_given
    from .sim_progress import SimProgress

    parser = argparse.ArgumentParser(
        prog="hetps simulate",
        description="run one experiment in virtual time: "
        "the real shards, scheduler and gradients, simulated clocks (docs/simulation.md). "
        "A worker's compute is sim.sample_s seconds per sample; unless the config sets it, "
        "it is measured first on this machine with the configured model (one line says "
        "which). Writes the run directory, model.safetensors included (hetps.load_model).",
    )
    parser.add_argument("config", help="YAML experiment, e.g. configs/default.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    parser.add_argument(
        "--out", default=None, help="run directory (default: out_dir/NAME-ALGO-TIME)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    parser.add_argument(
        "--replay",
        metavar="RUN_DIR",
        default=None,
        help="the workers' cost model measured in a real run's directory (sim/costs.py): "
        "each worker's compute per step (step_s) and the link latency. It REPLACES "
        "cluster.workers (the config's and any cluster.workers override): the simulated "
        "cluster is the measured one; --workers N for more workers of the measured speeds",
    )
    parser.add_argument(
        "--workers",
        metavar="N",
        type=int,
        default=None,
        help="with --replay: N workers, worker i at measured worker i mod K's cost (K measured; "
        "N = 2K appends a copy of the measured cluster)",
    )
    args = parser.parse_intermixed_args(argv)
    if args.workers is not None and (not args.replay or args.workers < 1):
        parser.error("--workers N (N >= 1) goes with --replay RUN_DIR")
    if args.replay:
        from hetps.sim.costs import measured_costs, workers_override

        try:
            costs = measured_costs(Path(args.replay))
        except ConfigError as exc:
            print(f"hetps simulate: {exc}", file=sys.stderr)
            return 2
        measured = len(costs)
        if args.workers is not None:
            costs = [costs[i % measured] for i in range(args.workers)]
        args.overrides.append(workers_override(costs))
        repeated = (
            f"; simulating {len(costs)} workers, worker i at measured worker i mod {measured}'s cost"
            if len(costs) != measured
            else ""
        )
        print(
            f"hetps simulate: {measured} workers measured in {args.replay}: "
            + ", ".join(f"{c['step_s'] * 1000:.1f} ms" for c in costs[:measured])
            + f" a step, {costs[0]['latency_ms']:.1f} ms latency each way{repeated} "
            "(they replace cluster.workers)",
            file=sys.stderr,
        )
    import_beside(args.config)
    cfg = load_or_exit(args.config, args.overrides, import_targets=True)
    try:
        check_simulable(cfg)  # before measuring: a refusal comes at once
        cfg, cost, data = sample_cost(cfg, sample_s_given(args.config, args.overrides))
    except ConfigError as exc:
        print(f"hetps simulate: {exc}", file=sys.stderr)
        return 2
    except PreflightError as exc:  # the check before training's line (training/preflight.py)
        kind = "config error" if isinstance(exc, ConfigValueError) else "check failed"
        print(f"hetps: {kind}: {exc}", file=sys.stderr)
        return 2
    print(f"hetps simulate: {cost.line(cfg)}", file=sys.stderr)
    run_dir = Path(args.out) if args.out else default_run_dir(cfg)
    progress = None if args.quiet else SimProgress(cfg, run_dir)
    try:
        summary = simulate(cfg, run_dir, data, progress)
        if progress is not None:
            progress.close()
        summary = SummaryFile(run_dir).update(
            simulation={**summary["simulation"], "sample_s_from": cost.source}
        )
        plot_simulated(cfg, run_dir)
    except ConfigError as exc:
        print(f"hetps simulate: {exc}", file=sys.stderr)
        return 2
    from .watch import summary_metric

    watched = summary_metric(summary)
    final = watched["final"]
    model = run_dir / "model.safetensors"
    print(
        f"hetps simulate: {summary['stop_reason']}; final {watched['name']} "
        f"{'-' if final is None else round(final, 4)}, "
        f"time to target {summary['time_to_target_s']} virtual s, {summary['global_steps']} steps, "
        f"{summary['simulation']['real_wall_s']} s real; {run_dir}"
        + (f" (model: {model.name})" if model.exists() else "")
    )
    return 3 if summary["status"] == "diverged" else 0  # as `hetps run` (scheduler/outcome.py)


def resume_command(args: argparse.Namespace) -> int:
    from hetps.runconfig.schema import ConfigError

    from .launcher import run_local
    from .resume import check_limits, check_same_shards, resume_line, resume_point

    run_dir = Path(args.resume)
    import_beside(None)  # the current directory (the run's config.yaml is not beside the code)
    overrides = ([args.config] if args.config else []) + args.overrides  # all key=value here
    cfg = load_or_exit(str(run_dir / "config.yaml"), overrides)
    try:
        point = resume_point(run_dir, len(cfg.cluster.shards))
        check_same_shards(run_dir, len(cfg.cluster.shards))
        check_limits(point, cfg)
    except ConfigError as exc:
        print(f"hetps run: cannot resume: {exc}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"hetps run: {resume_line(point, run_dir, cfg)}", file=sys.stderr)
    return run_local(cfg, run_dir, quiet=args.quiet, metrics=args.metrics, resume=point)


def config_command(argv: list[str]) -> int:
    import yaml

    from hetps.runconfig.load import config_to_dict

    parser = argparse.ArgumentParser(
        prog="hetps config", description="print the resolved config as YAML"
    )
    parser.add_argument("config", help="YAML experiment")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    args = parser.parse_intermixed_args(argv)
    import_beside(args.config)
    cfg = load_or_exit(args.config, args.overrides, import_targets=True)
    if isinstance(cfg.sparse.tables, list) and cfg.sparse.tables:
        # the tables it names are the model's to check: built as the check before training
        # builds it, without the step (the default `auto` is left to that check)
        from hetps.training.preflight import ConfigValueError, PreflightError, check_named_tables

        try:
            check_named_tables(cfg)
        except PreflightError as exc:
            kind = "config error" if isinstance(exc, ConfigValueError) else "check failed"
            print(f"hetps: {kind}: {exc}", file=sys.stderr)
            return 2
    print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
    return 0


def keys_command(argv: list[str]) -> int:
    from hetps.proto.security import SecurityError, write_keys

    parser = argparse.ArgumentParser(
        prog="hetps keys",
        description="write CurveZMQ keys for security.curve: "
        "a server key pair, N client key pairs and the allow-list",
    )
    parser.add_argument(
        "dir", help="keys directory to create (security.keys_dir / $HETPS_KEYS_DIR)"
    )
    parser.add_argument(
        "--clients", type=int, default=1, help="client key pairs client-0 ... client-N-1"
    )
    args = parser.parse_args(argv)
    if args.clients < 1:
        parser.error("--clients must be at least 1")
    try:
        written = write_keys(Path(args.dir), [f"client-{i}" for i in range(args.clients)])
    except (SecurityError, OSError) as exc:
        print(f"hetps keys: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"{oct(path.stat().st_mode & 0o777)[2:]} {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = (
        "run",
        "simulate",
        "compare",
        "plot",
        "scheduler",
        "ps",
        "worker",
        "keys",
        "config",
        "export",
    )
    if (not argv or argv[0] not in commands) and os.environ.get("HETPS_ROLE") in commands:
        argv = [os.environ["HETPS_ROLE"], *argv]  # containers: the role from the environment
    if not argv or argv[0] not in commands:
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        return run_command(rest)
    if command == "simulate":
        return simulate_command(rest)
    if command == "keys":
        return keys_command(rest)
    if command == "config":
        return config_command(rest)
    if command == "compare":
        from .compare import compare_command

        return compare_command(rest)
    if command == "plot":
        from .plots import plot_command

        return plot_command(rest)
    if command == "scheduler":
        from hetps.scheduler.__main__ import main as scheduler_main

        return scheduler_main(rest)
    os.execv(sys.executable, [sys.executable, "-m", ROLE_MODULES[command], *rest])
    return 1  # not reached: execv replaces this process


if __name__ == "__main__":
    sys.exit(main())
