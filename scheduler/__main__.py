"""The scheduler daemon.

    hetps scheduler --config CONFIG [--bind tcp://0.0.0.0:7000] [--run-dir DIR]
    python -m hetps.scheduler ...   (the same)

Binds --bind (default: cluster.scheduler; port 0 picks a free port and the
bound address is written to RUN_DIR/scheduler.addr), waits for the shards
and workers the config lists, sends the plan, and stops the cluster on target
accuracy, time or step limit, a STOP request, SIGINT or SIGTERM. Writes
metrics.jsonl, plan.json and summary.json into --run-dir when given.
Exit 0 after a clean stop (also on SIGINT/SIGTERM), 1 when a node failed at
start-up or the cluster never formed, 3 when training diverged (see outcome.py);
2 before binding, for a bad config or a --run-dir that cannot be made or written.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from hetps.proto.transport import TransportError, TransportOptions, make_server
from hetps.runtime.daemon import (
    DaemonArgumentParser,
    address_arg,
    check_and_exit,
    dump_stacks_on_usr1,
    fast_exit,
    load_or_exit,
    log_level_args,
    metrics_args,
    run_dir_problem,
    security_or_exit,
)
from hetps.runtime.metrics import serve_metrics

from . import state, tensorboard, tracking
from .coordinator import Coordinator
from .outcome import EXIT_CODES, INTERRUPTED

log = logging.getLogger("hetps.scheduler")


def main(argv: list[str] | None = None) -> int:
    env = os.environ.get
    parser = DaemonArgumentParser(prog="hetps scheduler", description="cluster scheduler daemon")
    parser.add_argument(
        "--config", default=env("HETPS_CONFIG"), help="YAML experiment ($HETPS_CONFIG)"
    )
    parser.add_argument(
        "--bind", type=address_arg, default=env("HETPS_BIND"), help="address to bind ($HETPS_BIND)"
    )
    parser.add_argument(
        "--run-dir", default=env("HETPS_RUN_DIR"), help="where metrics and summary go"
    )
    parser.add_argument(
        "--run-id",
        default=env("HETPS_RUN_ID"),
        help="the run id (names checkpoints); default: a new one, or the saved one on a restart",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="a resumed run (`hetps run --resume`): new nodes, the stopped run's placement",
    )
    log_level_args(parser)
    parser.add_argument(
        "--check",
        action="store_true",
        help="validate flags, environment and config, print them, exit 0 without binding",
    )
    metrics_args(parser)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s scheduler %(levelname)s %(name)s: %(message)s",
    )
    dump_stacks_on_usr1()
    cfg = load_or_exit(args.config, args.overrides)
    security_or_exit(cfg, "scheduler")
    if args.check:
        check_and_exit(
            "scheduler",
            bind=args.bind or cfg.cluster.scheduler,
            run_dir=args.run_dir,
            config=args.config,
        )
    run_dir = Path(args.run_dir) if args.run_dir else None
    if cfg.log.tensorboard and (problem := tensorboard.missing()):
        print(f"hetps scheduler: {problem}", file=sys.stderr)
        return 2
    if problem := tracking.missing(cfg):
        print(f"hetps scheduler: config error: {problem}", file=sys.stderr)
        return 2
    if run_dir:
        problem = run_dir_problem(run_dir)
        if problem is None:
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # what run_dir_problem cannot foresee: a name too long, ...
                problem = f"cannot be made: {exc.strerror or exc}"
        if problem:
            print(f"hetps scheduler: --run-dir {run_dir} {problem}", file=sys.stderr)
            return 2
    finished = state.read(run_dir) if run_dir and not args.resume else None
    if finished is not None and finished["finished"] and args.run_id in (None, finished["run_id"]):
        # a scheduler restarted after its run ended (an orchestrator's retry): never a new run in the old
        # directory, whose summary, plans and metrics belong to the finished one
        print(
            f"hetps scheduler: run {finished['run_id']} in {run_dir} has finished; nothing to do "
            "(a new run needs a new --run-dir)",
            file=sys.stderr,
        )
        return 0
    try:
        # no shared memory (its peers' messages are small) and no emulated link (no node settings)
        server = make_server(
            args.bind or cfg.cluster.scheduler,
            TransportOptions(max_message_bytes=cfg.cluster.max_message_bytes),
        )
    except TransportError as exc:  # the address is taken, or not one of this host's
        print(f"hetps scheduler: {exc}", file=sys.stderr)
        return 1
    coordinator = Coordinator(server, cfg, run_dir, run_id=args.run_id)
    coordinator.runlog.sink = tracking.Sinks(
        tensorboard.TensorBoardSink(run_dir / "tensorboard")
        if cfg.log.tensorboard and run_dir
        else None,
        tracking.TrackingSink(cfg, coordinator.run_id, run_dir)
        if tracking.missing(cfg) is None and tracking.wanted(cfg)
        else None,
    )
    saved = state.read(run_dir)
    if (
        saved is not None
        and not args.resume
        and not saved["finished"]
        and args.run_id in (None, saved["run_id"])
    ):
        coordinator.restore(saved)  # a restart: carry the unfinished run on
        log.info(
            "carrying on run %s from %s (plan %s, %d nodes)",
            coordinator.run_id,
            state.STATE_FILE,
            coordinator.plan.plan_id if coordinator.plan else None,
            len(coordinator.nodes),
        )
    elif args.resume and saved is not None and saved["run_id"] == args.run_id and saved["plan"]:
        # resuming: a new segment of the run, its placement kept, its clock and counts going on
        coordinator.resume(saved)
    if run_dir:
        tmp = run_dir / "scheduler.addr.tmp"
        tmp.write_text(server.address)
        os.replace(tmp, run_dir / "scheduler.addr")
    log.info("scheduler at %s, expecting %s", server.address, coordinator.expected)
    serve_metrics(
        args.metrics_port,
        args.metrics_host or cfg.cluster.host,
        "scheduler",
        0,
        coordinator.metrics,
        algorithm=cfg.algorithm.name,
        targets=args.metrics_targets,
    )

    def on_signal(signum, frame):
        log.info("%s: stopping the run", signal.Signals(signum).name)
        coordinator.begin_stop(INTERRUPTED)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        while not coordinator.finished():
            coordinator.serve_once(0.05)
            coordinator.tick()
    finally:
        coordinator.close()
        server.close()
    summary = coordinator.summary()
    log.info("stopped: %s (%s)", coordinator.stop_reason, summary["status"])
    # interrupted is a clean stop for the daemon (e.g. SIGTERM from the orchestrator); `hetps run`
    # turns its own Ctrl-C into 130
    return 0 if summary["status"] == INTERRUPTED else EXIT_CODES[summary["status"]]


if __name__ == "__main__":
    fast_exit(main())  # no interpreter teardown: seconds with torch loaded
