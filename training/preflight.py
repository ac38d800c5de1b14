"""The check before training: one dry step of the configured task (its
loss, backward, metrics) with the configured model on one real batch of the
configured dataset, so that a model that does not fit its data, a loss
that is not a finite scalar, or parameters that get no gradient fail at
once, in one line that names the task, model, dataset and the fix, instead
of deep inside a running cluster.

It also checks the settings only the model can check: that
cluster.max_message_bytes lets the model's messages through
(`message_bytes_needed`); and it builds what a shard builds from the config
(the optimizer and its lr schedule, runtime/optim.py `check_optimizer`).

Every worker and the evaluator run it before they register; `hetps run`
runs it once while the shards and workers start (a failure stops them all):

    python -m hetps.training.preflight --config CONFIG [key=value ...]

exits 0 (printing what it checked) or 2 (printing the one line).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from dataclasses import dataclass

import torch
from torch import nn

from hetps.proto.codec import encode
from hetps.proto.layout import aligned
from hetps.proto.messages import Plan, Register
from hetps.proto.plan import ClusterPlan, NodeEntry, TensorSpec, chunk_specs, schema_hash
from hetps.runconfig.algorithms import resolved_params
from hetps.runconfig.schema import RunConfig
from hetps.runtime.daemon import load_or_exit
from hetps.runtime.optim import check_optimizer

from .data import Datasets, DatasetUnavailable, load_datasets, test_batches
from .models import ModelError, build_model
from .sparse import SparseConfigError
from .sparse import install as install_tables
from .sparse import selected as selected_tables
from .state import model_specs
from .step import autocast, task_for
from .task import Classification, Regression, Task, TaskError
from .user_data import DatasetContractError

# CurveZMQ carries each frame in a MESSAGE command (8-byte command name, 8-byte nonce, 16-byte
# MAC, 1 flags byte), and ZMQ_MAXMSGSIZE counts those bytes too
CURVE_FRAME_BYTES = 33


class PreflightError(ValueError):
    """The model does not fit the dataset (or either cannot be built); one line saying why and what to do."""


class ConfigValueError(PreflightError):
    """A config value that cannot work with this model; the message starts with its key."""


def first_conv(model: nn.Module) -> nn.Module | None:
    return next(
        (m for m in model.modules() if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d))), None
    )


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def model_outputs(task: Task, data: Datasets) -> int | None:
    """What a model's `num_classes` is for `task`: the class count
    (classification), the values of one target (regression), else the
    dataset's class count if it has one."""
    if isinstance(task, Classification):
        return task.num_classes
    if isinstance(task, Regression):
        return data.target_size
    return data.num_classes


def dry_step(
    model: nn.Module,
    data: Datasets,
    cfg: RunConfig,
    device: torch.device | str = "cpu",
    task: Task | None = None,
) -> None:
    """One step of the task on the first `data.batch_size` training
    examples, on a copy of `model` (its values and buffers stay as they
    are): the batch collates, the forward pass runs (under
    `model.autocast`), the loss is a finite scalar, a parameter gets a
    gradient, and the task's metrics on that batch are all there and finite.
    Raises PreflightError in one line naming task, model, dataset and the fix."""
    task = task or Classification(data.num_classes)
    names = f"task {task.name!r}, model {cfg.model.name!r}, dataset {cfg.data.dataset!r}"
    iterable = getattr(data.train, "iterable", False)
    size = cfg.data.batch_size if iterable else min(cfg.data.batch_size, len(data.train))
    try:
        batch = next(iter(test_batches(data.train, size, task.collate)))
    except Exception as exc:  # the user's dataset and collate may raise anything
        raise PreflightError(
            f"{names}: reading the first batch fails ({first_line(exc)}); fix: the dataset's items "
            "must be what the task's collate takes (torch's default_collate: tensors, numbers, "
            "and tuples or dicts of them, of one shape)"
        ) from None
    conv = first_conv(model)
    if conv is not None and len(data.in_shape) >= 2 and conv.in_channels != data.in_shape[0]:
        raise PreflightError(
            f"{names}: the model's first convolution takes {conv.in_channels} input channels, the dataset's "
            f"images (shape {data.in_shape}) have {data.in_shape[0]}; fix: build the model for "
            f"input_shape[0] channels (a factory receives input_shape={data.in_shape}) or convert the "
            f"images to {conv.in_channels} channels in the dataset"
        )
    probe = copy.deepcopy(model).to(device).train()
    precision = cfg.model.autocast
    under = f" under model.autocast: {precision}" if precision != "none" else ""
    batch = task.to_device(batch, device)
    shape = tuple(batch[0].shape) if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], torch.Tensor) else None  # fmt: skip
    if isinstance(task, Classification):  # today's checks of logits
        with autocast(precision, torch.device(device)):
            out = forward(probe, batch[0], names, shape, data, under)
        n = len(batch[1])
        want = (n, task.num_classes)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise PreflightError(
                f"{names}: the model gives outputs of shape {got} for inputs of shape {shape}, but the dataset has "
                f"{task.num_classes} classes, so it must give {want}; fix: make its last layer output num_classes "
                f"logits (a factory receives num_classes={task.num_classes}) or check the dataset's num_classes"
            )
    try:
        with autocast(precision, torch.device(device)):
            loss = task.loss(probe, batch)
    except TaskError as exc:
        raise PreflightError(f"{names}: {exc}") from None
    except Exception as exc:  # the user's forward and loss may raise anything
        raise PreflightError(
            f"{names}: the forward pass and loss fail on the first batch"
            + (f" (inputs of shape {shape})" if shape else "")
            + f"{under} ({first_line(exc)}); fix: build the model for the dataset's inputs "
            f"{data.in_shape or ''}(a factory receives input_shape) and check the task's loss"
            + (" or set model.autocast: none" if under else "")
        ) from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise PreflightError(
            f"{names}: the loss must be a scalar tensor, got {got}; fix: reduce it in the task's "
            "loss (e.g. .mean() over the batch)"
        )
    if not torch.isfinite(loss.detach()).all():
        value = float(loss.detach())
        raise PreflightError(
            f"{names}: the loss is {value} at the first step, before any update; fix: check "
            "the dataset for NaN/Inf values and the model's initialisation and forward (log, "
            "division, sqrt of values <= 0)"
        )
    if not loss.requires_grad:
        raise PreflightError(
            f"{names}: no parameter of the model gets a gradient (the loss does not depend on "
            "any trainable parameter); fix: compute the loss from the model's output, and leave "
            "its parameters trainable (requires_grad)"
        )
    loss.float().backward()
    if not any(p.grad is not None for p in probe.parameters()):
        raise PreflightError(
            f"{names}: no parameter of the model gets a gradient; fix: the model must have "
            "trainable parameters that the output depends on"
        )
    check_metrics(task, probe, batch, names)


def forward(model: nn.Module, x, names: str, shape, data: Datasets, under: str):
    """model(x); a failure as the one line of PreflightError."""
    try:
        return model(x)
    except Exception as exc:  # the user's forward may raise anything
        raise PreflightError(
            f"{names}: the forward pass fails on a batch of shape {shape}{under} ({first_line(exc)}); fix: "
            f"build the model for inputs of shape {data.in_shape} (a factory receives input_shape)"
            + (" or set model.autocast: none" if under else "")
        ) from None


def check_metrics(task: Task, model: nn.Module, batch, names: str) -> None:
    """The task's metrics on one batch: each named metric given, and finite."""
    model.eval()
    try:
        with torch.no_grad():
            values = task.reduce(dict(task.eval_sums(model, batch)))
    except Exception as exc:  # the user's eval_sums and reduce may raise anything
        raise PreflightError(
            f"{names}: evaluating the first batch fails ({first_line(exc)}); fix: the task's "
            "eval_sums(model, batch) must return additive sums that its reduce(sums) turns into "
            "metric values"
        ) from None
    for metric in task.metrics:
        value = values.get(metric.name) if isinstance(values, dict) else None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise PreflightError(
                f"{names}: the task's reduce gives no number for its metric {metric.name!r} (got "
                f"{value!r}); fix: return every metric of task.metrics from reduce"
            )
        if not math.isfinite(value):
            raise PreflightError(
                f"{names}: the metric {metric.name!r} is {value} on the first batch, before any "
                "update; fix: check the dataset's values and the task's eval_sums and reduce"
            )


@dataclass(frozen=True)
class MessageBytes:
    """What a model's messages ask of cluster.max_message_bytes."""

    need: int  # the smallest value that can work
    why: str  # what needs it, for the user
    whole: int  # the frame of one shard holding every tensor: the most uneven speeds can ask


def one_frame_bytes(sizes: list[int]) -> int:
    """The frame of a shard's pull reply that carries tensors of `sizes` bytes:
    the shard's arena (ps/arena.py), each tensor padded to the pack alignment;
    a lone tensor travels as it is."""
    return sizes[0] if len(sizes) == 1 else sum(aligned(n) for n in sizes)


def least_largest_part(sizes: list[int], shards: int) -> int:
    """The smallest possible largest `one_frame_bytes` over every way to cut
    the tensor list (forward order) into at most `shards` contiguous ranges,
    as placement does (scheduler/placement.py): whatever speeds the shards
    measure, some shard's pull reply is at least this large."""

    def ranges_within(limit: int) -> int:
        count, run, n = 0, 0, 0  # ranges closed; padded bytes and tensors of the open one
        for size in sizes:
            if n and run + aligned(size) > limit:
                count, run, n = count + 1, 0, 0
            run, n = run + aligned(size), n + 1
        return count + (1 if n else 0)

    lo, hi = max(sizes), one_frame_bytes(sizes)  # a range's frame only grows with the range
    while lo < hi:
        mid = (lo + hi) // 2
        if ranges_within(mid) <= shards:
            hi = mid
        else:
            lo = mid + 1
    return lo


def message_bytes_needed(specs: list[TensorSpec], cfg: RunConfig) -> MessageBytes:
    """A sound lower bound on cluster.max_message_bytes for a model of `specs`
    under `cfg` (a run below it cannot work, whatever the shards' speeds):
    the largest tensor part (a shard refuses a larger tensor in a push), the
    largest frame of a pull reply however the parts are placed (skipped with
    comm.shm_bytes: such frames go through shared memory), and the headers
    that list every tensor (REGISTER, PLAN); plus CurveZMQ's bytes per frame.
    The sockets bound each frame, not the message (ZMQ_MAXMSGSIZE)."""
    parts, chunks = chunk_specs(specs, cfg.cluster.chunk_bytes, len(cfg.cluster.shards))
    sizes = [p.nbytes for p in parts]
    shards, workers = len(cfg.cluster.shards), len(cfg.cluster.workers)
    curve = CURVE_FRAME_BYTES if cfg.security.curve else 0
    largest = max(parts, key=lambda p: p.nbytes)
    needs = [
        (
            largest.nbytes,
            f"its largest tensor{' part' if chunks else ''}, {largest.name}, has "
            f"{largest.nbytes} bytes, and a shard refuses a larger one",
        )
    ]
    whole = 0  # with shared memory, large frames do not go through the sockets
    if not cfg.comm.shm_bytes:
        whole = one_frame_bytes(sizes) + curve
        frame = least_largest_part(sizes, shards)
        where = (
            f"however the {len(parts)} tensors are placed on the {shards} shards, one holds at "
            f"least {frame} bytes"
            if shards > 1
            else f"the one shard holds all {len(parts)} tensors, {frame} bytes"
        )
        needs.append(
            (
                frame + curve,
                f"a pull reply carries all of a shard's tensors in one frame, and {where}",
            )
        )
    # the headers at their smallest: no addresses, host, speeds, groups or run id
    plan = ClusterPlan(
        plan_id=1,
        algorithm=cfg.algorithm.name,
        workers=[NodeEntry(shards + 1 + i, i) for i in range(workers)],
        shards=[NodeEntry(1 + i, i) for i in range(shards)],
        tensors=parts,
        placement={p.name: 0 for p in parts},
        schema_hash=schema_hash(specs),
        chunks=chunks,
        algorithm_params=resolved_params(cfg.algorithm),
    )
    register = Register(
        role="worker",
        rank=0,
        tensor_specs=list(specs),
        schema_hash=schema_hash(specs),
    )
    header = max(len(encode(Plan(plan_id=1, plan=plan))[0]), len(encode(register)[0]))
    needs.append((header + curve, f"the plan lists every tensor in a header of {header} bytes"))
    need, why = max(needs, key=lambda n: n[0])  # on a tie, the first: the most specific
    if curve and need > largest.nbytes:
        why += f", plus {curve} bytes of CurveZMQ per frame"
    return MessageBytes(need, why, max(whole, need))


def check_message_bytes(model: nn.Module, cfg: RunConfig, tables: frozenset = frozenset()) -> None:
    """Raises ConfigValueError naming cluster.max_message_bytes and the smallest
    value that can work when the model's messages cannot pass the sockets.
    Sparse tables travel row by row: installed ones, and the weights named in `tables`."""
    limit = cfg.cluster.max_message_bytes
    dense = [s for s in model_specs(model) if s.kind != "table" and s.name not in tables]
    needed = message_bytes_needed(dense, cfg)
    if limit >= needed.need:
        return
    shards = len(cfg.cluster.shards)
    uneven = (
        f"; shards of unequal speed are given unequal parts, up to {needed.whole} bytes (the whole "
        "model in one frame)"
        if needed.whole > needed.need
        else ""
    )
    raise ConfigValueError(
        f"cluster.max_message_bytes: must be at least {needed.need} for model {cfg.model.name!r} on "
        f"{shards} shard{'s' if shards > 1 else ''}, got {limit}: {needed.why}{uneven}"
    )


def materialize(tables: list[tuple[str, nn.Module]]) -> None:
    """Give a table the factory built on the meta device (too large to build whole) zeros
    of its shape, for a whole model that loads its values afterwards (`hetps export`,
    `hetps.load_model`)."""
    for _, module in tables:
        if module.weight.is_meta:
            weight = torch.zeros(module.weight.shape, dtype=module.weight.dtype)
            module.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)


def build_unchecked(cfg: RunConfig) -> tuple[Datasets, Task, nn.Module]:
    """The datasets, the task and the seeded model as the configuration names them, on the
    CPU, before any check of them. Raises PreflightError (the dataset, the task or the model
    cannot be built)."""
    try:
        data = load_datasets(cfg.data, cfg.seed)
        task = task_for(cfg, data.num_classes)
        if isinstance(task, Classification) and task.num_classes is None:
            raise PreflightError(
                f"task 'classification', dataset {cfg.data.dataset!r}: the class count is unknown; "
                "fix: set data.num_classes, or give the train dataset an int attribute num_classes "
                "(or a list classes)"
            )
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, data.in_shape, model_outputs(task, data))
    except (DatasetUnavailable, DatasetContractError, ModelError, TaskError) as exc:
        raise PreflightError(str(exc)) from None
    except TypeError as exc:  # a factory called with keywords it does not take
        raise PreflightError(str(exc)) from None
    return data, task, model


def check_named_tables(cfg: RunConfig) -> None:
    """The modules a `sparse.tables` list names, checked against the model as the check before
    training checks them (each an embedding of the model, no tied weight, no option the shards'
    row-wise update cannot apply), without its step: `hetps config` runs it when the list names
    any. Raises PreflightError (ConfigValueError naming sparse.tables)."""
    if not isinstance(cfg.sparse.tables, list) or not cfg.sparse.tables:
        return
    _, _, model = build_unchecked(cfg)
    try:
        selected_tables(model, cfg)
    except SparseConfigError as exc:
        raise ConfigValueError(str(exc)) from None


def build_checked(
    cfg: RunConfig, device: torch.device | str = "cpu", sparse: bool = False
) -> tuple[Datasets, nn.Module]:
    """The datasets and the seeded model, checked by `dry_step` and
    `check_message_bytes`. `sparse`: the tables `sparse.tables` selects are
    replaced by row-served ones first (worker/sparse.py; the dry step then
    computes on stand-in rows). Raises PreflightError (ConfigValueError for a
    setting the model cannot work with, or an optimizer or lr schedule that cannot be
    built)."""
    try:
        check_optimizer(cfg.optimizer)  # what each shard builds from the config at its start
    except ValueError as exc:
        raise ConfigValueError(str(exc)) from None
    data, task, model = build_unchecked(cfg)
    try:
        # the whole model (`hetps export`, load_model) still sends its tables row by row
        chosen = selected_tables(model, cfg)
        tables = frozenset(f"{n}.weight" for n, _ in chosen)
        if sparse:
            install_tables(model, cfg)  # before moving: a table may be on the meta device
        else:
            materialize(chosen)
    except SparseConfigError as exc:
        raise ConfigValueError(str(exc)) from None
    model = model.to(device)
    dry_step(model, data, cfg, device, task)
    check_message_bytes(model, cfg, tables)
    return data, model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetps.training.preflight",
        description="check that the model fits the dataset (one dry step)",
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    cfg = load_or_exit(args.config, args.overrides, import_targets=True)
    torch.set_num_threads(1)
    try:
        data, _ = build_checked(cfg, sparse=True)  # as a worker builds it: tables row by row
    except PreflightError as exc:
        # a setting reads like the config's own errors (runtime/daemon.py load_or_exit)
        kind = "config error" if isinstance(exc, ConfigValueError) else "check failed"
        print(f"hetps: {kind}: {exc}", file=sys.stderr)
        return 2
    classes = f", {data.num_classes} classes" if data.num_classes else ""
    print(
        f"hetps: check ok: task {cfg.task.name!r}, model {cfg.model.name!r} on dataset "
        f"{cfg.data.dataset!r}, input shape {data.in_shape}{classes}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
