"""The worker daemon (and the evaluator, a worker mode).

    hetps worker --config CONFIG --rank N [--scheduler tcp://HOST:PORT] [key=value ...]
    hetps worker --config CONFIG --evaluator [--scheduler ...]
    python -m hetps.worker ...   (the same)

The scheduler address comes from --scheduler, else $HETPS_SCHEDULER, else
cluster.scheduler. The worker builds the model (seeded, so all workers start
equal), registers its tensor list, waits for the plan, trains on its share of
the data until the scheduler says stop, then says goodbye. Exit 0 on a clean
stop, 1 when a shard or the scheduler cannot be reached in time or the worker
fails at start-up (reported to the scheduler, which then ends the run), 2 when
its dataset is not there or this node's algorithm block differs from the plan's,
3 when the scheduler went silent for cluster.scheduler_grace_s (the message names it).
"""

from __future__ import annotations

from hetps.runtime.daemon import DaemonArgumentParser, common_args, daemon_setup, fast_exit
from hetps.runtime.startup import Phases, process_age_s


def main(argv: list[str] | None = None) -> int:
    phases = Phases(imports_s=process_age_s())  # reported in REGISTER: where the start-up went
    parser = DaemonArgumentParser(prog="hetps worker", description="training worker daemon")
    common_args(parser)
    parser.add_argument("--evaluator", action="store_true", help="run as the evaluator")
    parser.add_argument(
        "--model-out",
        default=None,
        help="evaluator: write the final model to "
        "MODEL_OUT/model.safetensors and model.json ($HETPS_MODEL_OUT; default: not written)",
    )
    args = parser.parse_intermixed_args(argv)
    role = "evaluator" if args.evaluator else "worker"
    cfg, scheduler = daemon_setup(args, role)
    # only now the heavy imports (torch, the model, the trainers): `--check` and flag errors answer at once
    from .lifecycle import run_node

    return run_node(args, cfg, scheduler, phases, role)


if __name__ == "__main__":
    fast_exit(main())  # no interpreter teardown: seconds with torch loaded
