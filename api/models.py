"""`hetps.load_model`: a trained model back as a torch module, in one call."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from hetps.proto.errors import ConfigError

if TYPE_CHECKING:  # torch is imported when a model is loaded, not with hetps
    from torch import nn


def load_model(path: str | Path, *, best: bool | None = None, device: str = "cpu") -> nn.Module:
    """The model a run trained, with its weights, in eval mode on `device`.

    `path`: a run directory or a .safetensors file a run or `hetps export` wrote. From a run
    directory, `best` picks the file, as Lightning's `trainer.test(ckpt_path="best")` does:
    None (the default) the best-evaluated model, RUN_DIR/best.safetensors (the run's `best`,
    written with `eval.keep_best`, the default), or the final one, RUN_DIR/model.safetensors,
    when the run wrote no best; True best.safetensors only; False model.safetensors (the
    run's final evaluation, `final_metrics`). The model is built from the run's config.yaml
    (in the file's folder or above it) and the description beside the file (input shape,
    class count), as the workers built it; any `package.module:factory` it names must be
    importable here. Raises ConfigError naming what is missing."""
    from safetensors.torch import load_file

    from hetps.runconfig.load import load_config
    from hetps.training.models import build_model

    path = Path(path)
    file = model_file(path, best) if path.is_dir() else path
    if not file.is_file():
        why = "best.safetensors is written with eval.keep_best" if best else "did the run train?"
        raise ConfigError(f"{file}: no such model file ({why})")
    config = next((p / "config.yaml" for p in file.parents if (p / "config.yaml").is_file()), None)
    if config is None:
        raise ConfigError(f"{file}: no config.yaml in its folder or above it (the run's config)")
    cfg = load_config(config, import_targets=True)
    try:
        described = json.loads(file.with_suffix(".json").read_text())
    except (OSError, ValueError):
        described = {}
    if "input_shape" in described:
        model = build_model(
            cfg.model, tuple(described["input_shape"]), described.get("num_classes")
        )
    else:  # no description: the shapes from the dataset, as the workers found them
        from hetps.training.preflight import build_checked

        model = build_checked(cfg)[1]
    model.load_state_dict(load_file(str(file)), strict=True)
    return model.to(device).eval()


def model_file(run_dir: Path, best: bool | None = None) -> Path:
    """The model file `load_model(run_dir, best=best)` loads: best.safetensors for True,
    model.safetensors for False, and for None best.safetensors when the run wrote one."""
    if best is None:
        best = (run_dir / "best.safetensors").is_file()
    return run_dir / ("best.safetensors" if best else "model.safetensors")
