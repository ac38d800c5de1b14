"""The model a simulated run trained, as files: RUN_DIR/model.safetensors and
model.json from the final evaluation's values, and with `eval.keep_best`
best.safetensors and best.json from the best-evaluated ones; the format the
real evaluator writes (worker/evaluator.py, training/export.py), so
`hetps.load_model(RUN_DIR)` takes a simulated run's directory as it takes a
real one's. `source` in the description is "simulator"; `versions` are the
shards' versions the evaluation read, in the plan's shard order.

Sparse tables are read whole from the simulated shards when a file is
written (or a best copy kept), as the real evaluator reads them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from hetps.runconfig.schema import RunConfig
from hetps.training.export import describe, state_copy, write_state
from hetps.training.measure import better
from hetps.training.sparse import tables_of
from hetps.training.task import Metric, Task

log = logging.getLogger(__name__)

ROWS_PER_READ = 1 << 16  # ids per read of a whole table


class SimModelFiles:
    """What the simulated evaluator measured, kept for the files. Not thread-safe
    (the simulator's loop is one thread)."""

    NAMES = ("model.safetensors", "model.json", "best.safetensors", "best.json")

    def __init__(
        self,
        cfg: RunConfig,
        task: Task,
        watched: Metric,
        model: nn.Module,
        in_shape: tuple,
        num_classes: int | None,
    ):
        """`model`: the evaluator's, loaded with the values of each evaluation before
        `measured`; `num_classes`: what its factory was given (model_outputs)."""
        self.cfg, self.task, self.watched, self.model = cfg, task, watched, model
        self.in_shape, self.num_classes = tuple(in_shape), num_classes
        self.metrics: dict[str, float] | None = None  # the latest evaluation's
        self.versions: list[int] = []
        self.final = False
        # (metrics, versions, a copy of the state) of the best evaluation
        self.best: tuple[dict[str, float], list[int], dict[str, torch.Tensor]] | None = None

    def measured(self, metrics: dict[str, float], versions: list[int], final: bool) -> None:
        """An evaluation of `model`'s current values gave `metrics`; `versions`: each shard's."""
        self.metrics, self.versions, self.final = metrics, list(versions), final
        value = metrics[self.watched.name]
        if self.cfg.eval.keep_best and better(
            self.watched, value, self.best[0][self.watched.name] if self.best else None
        ):
            self.best = (metrics, list(versions), state_copy(self.full_state()))

    def full_state(self) -> dict[str, torch.Tensor]:
        """The model's state_dict with each sparse table whole, read from the simulated shards."""
        state = self.model.state_dict()
        for name, table in tables_of(self.model).items():
            if table.exchange is None:
                continue
            rows, dim = table.spec.shape
            whole = torch.empty(rows, dim, dtype=table.dtype)
            for start in range(0, rows, ROWS_PER_READ):
                ids = torch.arange(start, min(rows, start + ROWS_PER_READ))
                whole[start : start + ids.numel()] = table.exchange.rows(
                    name, ids, dim, table.dtype
                )
            if table.padding_idx is not None:
                whole[table.padding_idx] = 0.0  # read as zeros in training, never learned
            state[name] = whole
        return state

    def _described(self, metrics: dict[str, float], evaluation: str, versions: list[int]) -> dict:
        return describe(
            self.cfg,
            self.in_shape,
            self.num_classes,
            metrics,
            "simulator",
            task=self.task,
            watched=self.watched,
            evaluation=evaluation,
            versions=versions,
        )

    def write(self, folder: Path) -> Path | None:
        """folder/model.safetensors and model.json (the latest evaluation's model), and
        best.safetensors and best.json; returns the model's path, None when nothing was
        evaluated (eval.enabled: false)."""
        if self.metrics is None:
            log.warning("%s not written: no evaluation was made", folder / "model.safetensors")
            return None
        evaluation = "final" if self.final else "last"
        path, _ = write_state(
            self.full_state(),
            folder / "model.safetensors",
            self._described(self.metrics, evaluation, self.versions),
        )
        if self.best is not None:
            metrics, versions, state = self.best
            write_state(
                state, folder / "best.safetensors", self._described(metrics, "best", versions)
            )
        return path
