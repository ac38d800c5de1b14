"""A worker's (or the evaluator's) life after its flags are checked (`hetps
worker`, worker/__main__.py): build and dry-run the model and data, profile,
register, wait for the plan, train (or evaluate) until the scheduler says
stop, say goodbye. Kept apart from the flag parsing so that `hetps worker
--check` and a flag error never import torch."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

import torch

from hetps.proto.errors import HetpsError
from hetps.proto.plan import schema_hash
from hetps.proto.rpc import Aborted, RemoteError, RequestTimeout
from hetps.proto.transport import TransportError
from hetps.runconfig.agreement import agreed_values
from hetps.runconfig.algorithms import (
    AlgorithmMismatch,
    aggregation_off_because,
    algorithm,
    check_plan_algorithm,
)
from hetps.runconfig.schema import NodeConfig, RunConfig
from hetps.runtime.daemon import scheduler_lost_exit, transport_options
from hetps.runtime.devices import pick_device, use_device
from hetps.runtime.emulation import Slowdown
from hetps.runtime.membership import Membership, SchedulerUnreachable, describe_failure
from hetps.runtime.metrics import serve_metrics
from hetps.runtime.optim import build_optimizer
from hetps.runtime.startup import Phases
from hetps.training.data import DatasetUnavailable
from hetps.training.preflight import PreflightError, build_checked, model_outputs
from hetps.training.state import ModelState, model_specs
from hetps.training.step import task_for

from .diloco import DilocoTrainer
from .evaluator import Evaluator
from .group_reduce import MemberStore
from .local import LocalSgdTrainer
from .overlap import OverlapTrainer
from .trainer import Trainer, profile_speed

log = logging.getLogger("hetps.worker")
# the table's `worker_loop` -> the loop that runs it
WORKER_LOOPS = {
    "gradients": Trainer,
    "local_steps": LocalSgdTrainer,
    "pseudo_gradients": DilocoTrainer,
}


def trainer_class(cfg) -> type:
    """The worker loop for the configured algorithm; `comm.overlap` applies to
    the gradient-pushing loop only (model averaging has no backward to overlap)."""
    cls = WORKER_LOOPS[algorithm(cfg.algorithm.name).worker_loop]
    return OverlapTrainer if cfg.comm.overlap and cls is Trainer else cls


def leave_on_error(member: Membership, runner, exc: Exception) -> None:
    """Training ended on `exc` before the run stopped: say BYE with the error
    (best effort), so the scheduler re-plans without this node now instead of
    after `dead_after_s` of silence."""
    if member.scheduler_lost or isinstance(exc, SchedulerUnreachable):
        return
    error = str(exc) if isinstance(exc, HetpsError) else describe_failure(exc)
    member.bye(
        runner.stats(),
        timeout_s=2.0,
        error=error,
        refused=exc.status if isinstance(exc, RemoteError) else 0,
    )


def warn_emulated_bfloat16(precision: str, device: torch.device) -> None:
    """model.autocast: bfloat16 on a GPU older than compute capability 8.0 (V100,
    T4) runs, emulated, slower than float32: say so in the worker's log."""
    if (
        precision == "bfloat16"
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) < (8, 0)
    ):
        log.warning(
            "model.autocast: bfloat16 on %s (compute capability %s) is emulated and slower than float32; "
            "set model.autocast: none on such GPUs",
            torch.cuda.get_device_name(device),
            ".".join(map(str, torch.cuda.get_device_capability(device))),
        )


def run_node(
    args: argparse.Namespace, cfg: RunConfig, scheduler: str, phases: Phases, role: str
) -> int:
    """Run worker `args.rank` (or the evaluator) until the run stops; the daemon's exit status."""
    workers = cfg.cluster.workers
    # `--rank auto` (rank < 0): the default node settings, the rank comes at registration
    node = (
        workers[args.rank] if not args.evaluator and 0 <= args.rank < len(workers) else NodeConfig()
    )
    torch.set_num_threads(node.threads)
    # every socket of this process (the scheduler's, the shards'; `member.transport`):
    # comm.shm_bytes (co-located worker -> shard frames, docs/big-messages.md) and one
    # emulated link of the node's link_mbps, shared by all
    member = Membership(scheduler, role, args.rank, cfg.cluster, transport_options(cfg, node))
    phases.mark("config")
    runner = None
    try:
        # a failure from here to the first step is reported to the scheduler, which ends the run
        with member.starting({DatasetUnavailable: 2, PreflightError: 2}):
            where = "evaluator device" if args.evaluator else f"cluster.workers.{args.rank}.device"
            device = pick_device(node.device, where)
            use_device(device)
            if not args.evaluator:
                warn_emulated_bfloat16(cfg.model.autocast, device)
            # the model and data, and one dry step of them, before registering (preflight.py)
            data, model = build_checked(cfg, device, sparse=True)
            specs = model_specs(model)
            if not args.evaluator and issubclass(trainer_class(cfg), LocalSgdTrainer):
                # its first torch.optim optimizer imports torch._dynamo (~1 s): pay it before joining,
                # not in the run's clock after the plan (the shards pay it while profiling)
                build_optimizer(list(model.parameters()), cfg.optimizer)
            state = ModelState(model, device)
            phases.mark("build")
            speed = (
                0.0
                if args.evaluator
                else profile_speed(
                    state,
                    data,
                    cfg.data.batch_size,
                    cfg.cluster.profile_steps,
                    Slowdown(node),
                    cfg.model.autocast,
                    task_for(cfg, data.num_classes),
                    cfg.data.num_workers,
                )
            )
            phases.mark("profile")
            # comm.aggregate: the store where the groups this worker leads rendezvous
            store = (
                MemberStore(
                    cfg.comm.collective_port + max(args.rank, 0) if cfg.comm.collective_port else 0,
                    scheduler,
                    cfg.cluster.startup_timeout_s,
                )
                if not args.evaluator
                and trainer_class(cfg) is Trainer
                and not aggregation_off_because(cfg)
                else None
            )
        member.join(
            address=store.address if store is not None else "",
            tensor_specs=list(specs),
            schema_hash=schema_hash(specs),
            speed=speed,
            startup=phases.as_dict(),
            agreed=agreed_values(cfg),
        )
        args.rank = member.rank  # `--rank auto`: from here on, the rank the scheduler gave
        plan = member.wait_plan()
        # reported: the scheduler ends the run naming this node
        with member.starting({AlgorithmMismatch: 2}):
            # this node's YAML must run the scheduler's algorithm
            check_plan_algorithm(cfg.algorithm, plan)
        # heartbeats from the moment the plan arrives: the scheduler counts silence from then on,
        # and building the trainer may take seconds on a loaded machine
        member.start_heartbeats(lambda: runner.stats() if runner is not None else {})
        with member.starting():
            model_out = args.model_out or os.environ.get("HETPS_MODEL_OUT")
            runner = (
                Evaluator(
                    cfg,
                    member,
                    plan,
                    state,
                    data.test,
                    Path(model_out) if model_out else None,
                    # the model's outputs, as built (model.json: what load_model rebuilds)
                    (data.in_shape, model_outputs(task_for(cfg, data.num_classes), data)),
                )
                if args.evaluator
                else trainer_class(cfg)(cfg, node, member, plan, state, data)
            )
            serve_metrics(
                args.metrics_port,
                args.metrics_host or cfg.cluster.host,
                role,
                args.rank,
                runner.stats,
                histograms=getattr(getattr(runner, "timer", None), "histograms", None),
                algorithm=cfg.algorithm.name,
                targets=args.metrics_targets,
            )
        log.info(
            "%s %d (node %d) on %s, plan %d", role, args.rank, member.node_id, device, plan.plan_id
        )
        try:
            with contextlib.suppress(Aborted):  # the run stopped while a request was waiting
                runner.run()
        except Exception as exc:
            leave_on_error(member, runner, exc)
            raise
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
