"""The trained model as a file: `model.safetensors` (the model's own
`state_dict`: every parameter and buffer, under its own names) and, beside
it, a JSON description (model spec, dataset, num_classes, input shape,
final accuracy, hetps and torch versions).

The evaluator writes RUN_DIR/model.safetensors and RUN_DIR/model.json at the
end of every `hetps run`, from the very values its final evaluation measured.
For a run that died, build the same from the shards' checkpoints:

    hetps export RUN_DIR_OR_CHECKPOINT_DIR --out FILE.safetensors [--config CONFIG]

(`python -m hetps.training.export ...`, the same). It takes each shard's newest
valid checkpoint (their versions may differ: each writes on its own clock),
puts the model together, evaluates it on the test split and writes FILE and
FILE's .json (`checkpoint_versions`: each shard's). Exit 0, or 2 with one
line saying what is missing; 2 as well when the checkpoints hold only the
initial model (version 0 everywhere), unless --allow-initial.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata
from pathlib import Path

import torch
from torch import nn

from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ConfigError, RunConfig
from hetps.runtime import checkpoint

from .preflight import PreflightError, build_checked, model_outputs
from .sparse import selected as selected_tables
from .state import model_tensors
from .step import task_for
from .task import Metric, Task, TaskError, watched_metric


class ExportError(ValueError):
    """The checkpoints or the config needed for an export are missing or do not fit."""


class InitialModelOnly(ExportError):
    """Every shard's newest valid checkpoint holds its initial values: exported, the
    result would be the untrained model."""


def describe(
    cfg: RunConfig,
    in_shape,
    num_classes: int | None,
    metrics: dict[str, float] | None,
    source: str,
    task: Task | None = None,
    watched: Metric | None = None,
    **more,
) -> dict:
    """model.json's content: the model, dataset and task (its name and
    kwargs), the test `metrics` measured on these values, the watched
    metric (`watch`, `higher_is_better`), and `final_accuracy`/`final_loss`
    as before (null when the task has no such metric); `more`: further keys,
    e.g. which evaluation measured it."""
    try:
        version = metadata.version("hetps")
    except metadata.PackageNotFoundError:
        version = None
    metrics = metrics or {}
    return {
        "model": {"name": cfg.model.name, "kwargs": cfg.model.kwargs},
        "dataset": {"name": cfg.data.dataset, "kwargs": cfg.data.kwargs},
        "task": {"name": cfg.task.name, "kwargs": cfg.task.kwargs},
        # the model factory's num_classes argument: the class count, a regression's target size
        "num_classes": num_classes,
        "input_shape": list(in_shape),
        "metrics": metrics,
        "watch": watched.name if watched else None,
        "higher_is_better": watched.higher_is_better if watched else None,
        "final_accuracy": metrics.get("accuracy"),
        "final_loss": metrics.get("loss"),
        "source": source,
        "hetps_version": version,
        "torch_version": torch.__version__,
        "algorithm": cfg.algorithm.name,
        "seed": cfg.seed,
        **more,
    }


def write_model(model: nn.Module, out: Path, description: dict) -> tuple[Path, Path]:
    """Write `model`'s state_dict to `out` (safetensors) and `description` to
    `out` with suffix .json; returns both paths."""
    return write_state(model.state_dict(), out, description)


def state_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CPU copy of a state_dict, each tensor on its own storage: tied weights
    are stored once under each of their names (a strict `load_state_dict`
    finds every key), and later updates of the model do not reach it."""
    return {name: t.detach().to("cpu").clone().contiguous() for name, t in state.items()}


def write_state(state: dict[str, torch.Tensor], out: Path, description: dict) -> tuple[Path, Path]:
    """`state` (a state_dict) -> `out` (safetensors), `description` -> `out`
    with suffix .json; returns both paths."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = state_copy(state)
    tmp = out.with_name(f".{out.name}.tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out)
    meta = out.with_suffix(".json")
    meta.write_text(json.dumps(description, indent=2) + "\n")
    return out, meta


# ------------------------------------------------------------ from checkpoints


def find_run(path: Path) -> tuple[Path, list[Path]]:
    """(the run's config.yaml, one folder per shard psN) for a run directory
    or any folder inside its checkpoints. Raises ExportError."""
    shard_dirs = sorted({p.parent for p in path.rglob("v*.pt")}, key=lambda p: p.name)
    if path.is_dir() and path.name.startswith("ps") and checkpoint.checkpoints(path):
        shard_dirs = sorted(p for p in path.parent.iterdir() if checkpoint.checkpoints(p))
    if not shard_dirs:
        raise ExportError(f"{path}: no shard checkpoints (v*.pt) found in or under it")
    runs = {d.parent for d in shard_dirs}
    if len(runs) > 1:  # checkpoints of several runs: the newest one
        newest = max(
            runs,
            key=lambda r: max(
                p.stat().st_mtime
                for d in shard_dirs
                if d.parent == r
                for _, p in checkpoint.checkpoints(d)
            ),
        )
        shard_dirs = [d for d in shard_dirs if d.parent == newest]
    config = next(
        (p / "config.yaml" for p in (path, *path.parents) if (p / "config.yaml").is_file()), None
    )
    return config, shard_dirs


def newest_tensors(shard_dirs: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Every tensor of each shard's newest valid checkpoint (damaged files
    passed over as `hetps run --resume` does), parts of chunked tensors still
    apart, and the version each shard's came from. The shards' versions may
    differ (each writes on its own clock, and one that died stopped writing):
    the newest model they can give together is each one's newest, as an
    evaluator's pull is. Raises checkpoint.CheckpointError (a ValueError)
    when a shard has no valid checkpoint."""
    versions, damaged = checkpoint.newest_valid_versions({d.name: d for d in shard_dirs})
    for d in damaged:
        print(f"hetps export: passed over {d}", file=sys.stderr)
    tensors: dict[str, torch.Tensor] = {}
    slices: dict[str, list] = {}  # sparse table -> [(shard, shards, slice)]
    for d in shard_dirs:
        state = checkpoint.load(checkpoint.latest(d, versions[d.name]))
        tensors.update(state["tensors"])
        sparse = state.get("sparse")
        for name, table in (sparse or {}).get("tables", {}).items():
            slices.setdefault(name, []).append((sparse["shard"], sparse["shards"], table["weight"]))
    tensors.update(whole_tables(slices))
    return tensors, versions


def whole_tables(slices: dict[str, list]) -> dict[str, torch.Tensor]:
    """Each sparse table from its shards' slices (row i on shard i % shards at i // shards,
    proto/sparse.py). Raises ExportError when a shard's slice is missing."""
    out = {}
    for name, parts in slices.items():
        shards = parts[0][1]
        if sorted(s for s, _, _ in parts) != list(range(shards)):
            raise ExportError(
                f"sparse table {name!r}: the checkpoints hold the slices of shards "
                f"{sorted(s for s, _, _ in parts)} of {shards}: is a shard's folder missing?"
            )
        rows = sum(w.shape[0] for _, _, w in parts)
        full = torch.empty(rows, parts[0][2].shape[1], dtype=parts[0][2].dtype)
        for shard, _, weight in parts:
            full[shard::shards] = weight
        out[name] = full
    return out


def assemble(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load the shards' tensors into `model`, joining `NAME#k` parts. Raises ExportError."""
    for name, (target, _) in model_tensors(model).items():
        parts = sorted(
            (k for k in tensors if k.startswith(name + "#") and k[len(name) + 1 :].isdigit()),
            key=lambda k: int(k.rsplit("#", 1)[1]),
        )
        value = tensors.get(name)
        if value is None and parts:
            value = torch.cat([tensors[p].reshape(-1) for p in parts])
        if value is None:
            raise ExportError(
                f"the checkpoints lack tensor {name!r}: is a shard's checkpoint folder missing?"
            )
        if value.numel() != target.numel():
            raise ExportError(
                f"tensor {name!r} has {value.numel()} values in the checkpoints, the model "
                f"{target.numel()}: not this model's checkpoints (check --config)"
            )
        with torch.no_grad():
            target.copy_(value.reshape(target.shape))


def export(path: Path, out: Path, config: Path | None = None, allow_initial: bool = False) -> dict:
    """Build `out` (+ .json) from the checkpoints at `path`; returns the
    description. Raises InitialModelOnly when every shard's newest valid
    checkpoint is version 0 (the initial model), unless `allow_initial`."""
    run_config, shard_dirs = find_run(path)
    config = config or run_config
    if config is None:
        raise ExportError(
            f"{path}: no config.yaml in it or above it; pass --config (the run's config)"
        )
    cfg = load_config(config, import_targets=True)
    data, model = build_checked(cfg)
    tensors, versions = newest_tensors(shard_dirs)
    if not allow_initial and not any(versions.values()):
        raise InitialModelOnly(
            f"{path}: the checkpoints hold only the initial model (version 0 of "
            f"{', '.join(sorted(versions))}): nothing trained reached them; "
            "--allow-initial writes it all the same"
        )
    assemble(model, tensors)
    with torch.no_grad():
        for _, table in selected_tables(model, cfg):
            if table.padding_idx is not None:  # read as zeros in training, never learned
                table.weight[table.padding_idx] = 0.0
    from .measure import measure

    task = task_for(cfg, data.num_classes)
    metrics = measure(task, model, data.test, cfg, torch.device("cpu"))
    description = describe(
        cfg,
        data.in_shape,
        model_outputs(task, data),
        metrics,
        "checkpoints",
        task=task,
        watched=watched_metric(cfg, task),
    )
    description["checkpoint_versions"] = versions
    write_model(model, out, description)
    return description


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hetps export", description="the trained model from shard checkpoints"
    )
    parser.add_argument("path", help="a run directory, or a checkpoint folder inside one")
    parser.add_argument(
        "--out", required=True, help="the .safetensors file to write (its .json goes beside it)"
    )
    parser.add_argument(
        "--config", default=None, help="the run's config (default: config.yaml in PATH or above)"
    )
    parser.add_argument(
        "--allow-initial",
        action="store_true",
        help="write the model even when the checkpoints hold only its initial values",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        d = export(
            Path(args.path),
            Path(args.out),
            Path(args.config) if args.config else None,
            allow_initial=args.allow_initial,
        )
    except (ExportError, ConfigError, PreflightError, TaskError, ValueError, OSError) as exc:
        print(f"hetps export: {exc}", file=sys.stderr)
        return 2
    watch = d["watch"]
    print(
        f"hetps export: wrote {args.out} and {Path(args.out).with_suffix('.json')} (checkpoint versions "
        f"{d['checkpoint_versions']}, test {watch} {d['metrics'][watch]:.4f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
