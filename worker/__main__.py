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

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

import torch

from hetps.proto.algorithms import AlgorithmMismatch, algorithm, check_plan_algorithm
from hetps.proto.config import NodeConfig
from hetps.proto.daemon import common_args, daemon_setup, fast_exit, scheduler_lost_exit
from hetps.proto.devices import pick_device, use_device
from hetps.proto.membership import Membership, SchedulerUnreachable
from hetps.proto.metrics import serve_metrics
from hetps.proto.optim import build_optimizer
from hetps.proto.plan import schema_hash
from hetps.proto.emulation import set_link_cap
from hetps.proto.transport import TransportError, set_shared_memory
from hetps.proto.rpc import Aborted, RemoteError, RequestTimeout
from hetps.proto.startup import Phases, process_age_s

from .data import DatasetUnavailable
from .diloco import DilocoTrainer
from .evaluator import Evaluator
from .local import LocalSgdTrainer
from .overlap import OverlapTrainer
from .preflight import PreflightError, build_checked
from .state import ModelState, model_specs
from hetps.proto.emulation import Slowdown

from .trainer import Trainer, profile_speed

log = logging.getLogger("hetps.worker")
# the table's `worker_loop` -> the loop that runs it
WORKER_LOOPS = {"gradients": Trainer, "local_steps": LocalSgdTrainer, "pseudo_gradients": DilocoTrainer}


def trainer_class(cfg) -> type:
    """The worker loop for the configured algorithm; `comm.overlap` applies to
    the gradient-pushing loop only (model averaging has no backward to overlap)."""
    cls = WORKER_LOOPS[algorithm(cfg.algorithm.name).worker_loop]
    return OverlapTrainer if cfg.comm.overlap and cls is Trainer else cls


def main(argv: list[str] | None = None) -> int:
    phases = Phases(imports_s=process_age_s())  # reported in REGISTER: where the start-up went
    parser = argparse.ArgumentParser(prog="hetps worker", description="training worker daemon")
    common_args(parser)
    parser.add_argument("--evaluator", action="store_true", help="run as the evaluator")
    parser.add_argument("--model-out", default=None, help="evaluator: write the final model to "
                        "MODEL_OUT/model.safetensors and model.json ($HETPS_MODEL_OUT; default: not written)")
    args = parser.parse_intermixed_args(argv)
    role = "evaluator" if args.evaluator else "worker"
    cfg, scheduler = daemon_setup(args, role)
    workers = cfg.cluster.workers
    # `--rank auto` (rank < 0): the default node settings, the rank comes at registration
    node = workers[args.rank] if not args.evaluator and 0 <= args.rank < len(workers) else NodeConfig()
    torch.set_num_threads(node.threads)
    set_link_cap(node.link_mbps)
    set_shared_memory(cfg.comm.shm_bytes)  # co-located worker -> shard frames (docs/big-messages.md)
    member = Membership(scheduler, role, args.rank, cfg.cluster)
    phases.mark("config")
    runner = None
    try:
        # a failure from here to the first step is reported to the scheduler, which ends the run
        with member.starting({DatasetUnavailable: 2, PreflightError: 2}):
            where = "evaluator device" if args.evaluator else f"cluster.workers.{args.rank}.device"
            device = pick_device(node.device, where)
            use_device(device)
            # the model and data, and one dry step of them, before registering (preflight.py)
            data, model = build_checked(cfg, device)
            specs = model_specs(model)
            if not args.evaluator and issubclass(trainer_class(cfg), LocalSgdTrainer):
                # its first torch.optim optimizer imports torch._dynamo (~1 s): pay it before joining,
                # not in the run's clock after the plan (the shards pay it while profiling)
                build_optimizer(list(model.parameters()), cfg.optimizer)
            state = ModelState(model, device)
            phases.mark("build")
            speed = 0.0 if args.evaluator else profile_speed(state, data, cfg.data.batch_size,
                                                             cfg.cluster.profile_steps, Slowdown(node))
            phases.mark("profile")
        member.join(tensor_specs=[s.to_wire() for s in specs], schema_hash=schema_hash(specs), speed=speed,
                    startup=phases.as_dict())
        args.rank = member.rank  # `--rank auto`: from here on, the rank the scheduler gave
        plan = member.wait_plan()
        with member.starting({AlgorithmMismatch: 2}):  # reported: the scheduler ends the run naming this node
            check_plan_algorithm(cfg.algorithm, plan)  # this node's YAML must run the scheduler's algorithm
        # heartbeats from the moment the plan arrives: the scheduler counts silence from then on,
        # and building the trainer may take seconds on a loaded machine
        member.start_heartbeats(lambda: runner.stats() if runner is not None else {})
        with member.starting():
            model_out = args.model_out or os.environ.get("HETPS_MODEL_OUT")
            runner = (Evaluator(cfg, member, plan, state, data.test, Path(model_out) if model_out else None,
                                (data.in_shape, data.num_classes)) if args.evaluator
                      else trainer_class(cfg)(cfg, node, member, plan, state, data))
            serve_metrics(args.metrics_port, args.metrics_host or cfg.cluster.host, role, args.rank,
                          runner.stats, histograms=getattr(getattr(runner, "timer", None), "histograms", None),
                          algorithm=cfg.algorithm.name, targets=args.metrics_targets)
        log.info("%s %d (node %d) on %s, plan %d", role, args.rank, member.node_id, device, plan.plan_id)
        with contextlib.suppress(Aborted):  # the run stopped while a request was waiting
            runner.run()
        log.info("stopping: %s", member.stop_reason)
        if member.scheduler_lost:
            return scheduler_lost_exit(role, args.rank, member.stop_reason)
        member.bye(runner.stats())
        return 0
    except (RequestTimeout, RemoteError, SchedulerUnreachable, TransportError) as exc:
        print(f"hetps {role} {args.rank}: {exc}", file=sys.stderr)
        return 1
    finally:
        if runner is not None:
            runner.close()
        member.close()


if __name__ == "__main__":
    fast_exit(main())  # no interpreter teardown: seconds with torch loaded
