"""The check before training: one dry forward+backward of the configured
model on one real batch of the configured dataset, so that a model that
does not fit its data fails at once, in one line that names the model, the
dataset, the shapes and the fix, instead of deep inside a running cluster.

Every worker and the evaluator run it before they register; `hetps run`
runs it once while the shards and workers start (a failure stops them all):

    python -m hetps.worker.preflight --config CONFIG [key=value ...]

exits 0 (printing what it checked) or 2 (printing the one line).
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.nn.functional as F
from torch import nn

from hetps.runconfig.schema import RunConfig
from hetps.runtime.daemon import load_or_exit

from .data import Datasets, DatasetUnavailable, load_datasets
from .models import ModelError, build_model
from .step import autocast
from .user_data import DatasetContractError


class PreflightError(ValueError):
    """The model does not fit the dataset (or either cannot be built); one line saying why and what to do."""


def first_conv(model: nn.Module) -> nn.Module | None:
    return next(
        (m for m in model.modules() if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d))), None
    )


def dry_step(
    model: nn.Module, data: Datasets, cfg: RunConfig, device: torch.device | str = "cpu"
) -> None:
    """Forward and backward on the first `data.batch_size` training examples,
    on a copy of `model` (its values and buffers stay as they are).
    Raises PreflightError: the channel count differs, the forward fails, the
    output is not (B, num_classes), or no parameter gets a gradient."""
    names = f"model {cfg.model.name!r} and dataset {cfg.data.dataset!r}"
    batch = min(cfg.data.batch_size, len(data.train))
    x, y = data.train.batch(torch.arange(batch))
    shape = tuple(x.shape)
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
    try:
        with autocast(precision, torch.device(device)):  # as training runs it
            out = probe(x.to(device))
    except Exception as exc:  # the user's forward may raise anything
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        under = f" under model.autocast: {precision}" if precision != "none" else ""
        raise PreflightError(
            f"{names}: the forward pass fails on a batch of shape {shape}{under} ({first}); fix: "
            f"build the model for inputs of shape {data.in_shape} (a factory receives input_shape)"
            + (" or set model.autocast: none" if under else "")
        ) from None
    want = (batch, data.num_classes)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise PreflightError(
            f"{names}: the model gives outputs of shape {got} for inputs of shape {shape}, but the dataset has "
            f"{data.num_classes} classes, so it must give {want}; fix: make its last layer output num_classes "
            f"logits (a factory receives num_classes={data.num_classes}) or check the dataset's num_classes"
        )
    F.cross_entropy(out.float(), y.to(device)).backward()
    if not any(p.grad is not None for p in probe.parameters()):
        raise PreflightError(
            f"{names}: no parameter of the model gets a gradient; fix: the model must have "
            "trainable parameters that the output depends on"
        )


def build_checked(cfg: RunConfig, device: torch.device | str = "cpu") -> tuple[Datasets, nn.Module]:
    """The datasets and the seeded model, checked by `dry_step`. Raises PreflightError."""
    try:
        data = load_datasets(cfg.data, cfg.seed)
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, data.in_shape, data.num_classes).to(device)
    except (DatasetUnavailable, DatasetContractError, ModelError) as exc:
        raise PreflightError(str(exc)) from None
    except TypeError as exc:  # a factory called with keywords it does not take
        raise PreflightError(str(exc)) from None
    dry_step(model, data, cfg, device)
    return data, model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetps.worker.preflight",
        description="check that the model fits the dataset (one dry step)",
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    cfg = load_or_exit(args.config, args.overrides, import_targets=True)
    torch.set_num_threads(1)
    try:
        data, _ = build_checked(cfg)
    except PreflightError as exc:
        print(f"hetps: check failed: {exc}", file=sys.stderr)
        return 2
    print(
        f"hetps: check ok: model {cfg.model.name!r} on dataset {cfg.data.dataset!r}, input shape "
        f"{data.in_shape}, {data.num_classes} classes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
