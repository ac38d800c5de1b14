"""TensorBoard event files for a run (`log.tensorboard: true`, or
`hetps run --tensorboard`): the scheduler mirrors the records it writes to
metrics.jsonl into RUN_DIR/tensorboard through torch.utils.tensorboard.

    eval/<metric>                        every metric of the task (eval/accuracy and eval/loss
                                         for classification, eval/perplexity, eval/r2, ...) at
                                         the cluster's global step (sum of the workers' steps)
    worker<R>/loss, step_s, staleness    at that worker's own step
    plan/groups, plan/workers            at each plan id, and the groups as text

TensorBoard is an optional extra (`pip install 'hetps[tensorboard]'`);
`missing()` says in one line what to do when it is not installed.

    tensorboard --logdir runs/      # every run directory under runs/ side by side
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from .nodes import EVAL_ROW_FIELDS
from .runlog import fits

FLUSH_S = 5  # a live `tensorboard` view lags the run by at most this many seconds


def missing() -> str | None:
    """None when TensorBoard logging works here, else what to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as exc:
        return (
            f"log.tensorboard needs the tensorboard package, which is not installed ({exc}): "
            "pip install 'hetps[tensorboard]' (or pip install 'tensorboard>=2.14'), or drop "
            "log.tensorboard / --tensorboard"
        )
    return None


class TensorBoardSink:
    """Writes run records (kind + values, as RunLog.record gets them) as
    TensorBoard scalars and text. Not thread-safe: the scheduler's loop only."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=FLUSH_S)
        self.wall0: float | None = None  # wall-clock time at the run's t = 0

    def record(self, kind: str, values: dict) -> None:
        t = values.get("t")
        # timed before t = 0
        if isinstance(t, (int, float)) and self.wall0 is None and kind != "register":
            self.wall0 = time.time() - t
        wall = self.wall0 + t if isinstance(t, (int, float)) and self.wall0 is not None else None
        if kind == "eval":
            step = values.get("global_steps", 0)
            # the row's metrics are its keys beside the row's own fields (Coordinator._record_eval)
            for name, value in values.items():
                if name not in EVAL_ROW_FIELDS:
                    self._scalar(f"eval/{name}", value, step, wall)
        elif kind == "step" and fits(values, worker=int, step=int):
            prefix, step = f"worker{values['worker']}", values["step"]
            for key in ("loss", "step_s", "staleness"):
                self._scalar(f"{prefix}/{key}", values.get(key), step, wall)
        elif kind == "plan":
            plan_id, groups = values.get("plan_id", 0), values.get("groups") or []
            self._scalar("plan/groups", len(groups), plan_id, wall)
            self._scalar("plan/workers", sum(len(g) for g in groups), plan_id, wall)
            self.writer.add_text("plan/groups", f"plan {plan_id}: groups {groups}", plan_id, wall)
        elif kind == "stop":
            self.writer.add_text(
                "run/stop", str(values.get("reason")), values.get("global_steps", 0), wall
            )

    def _scalar(self, tag: str, value, step, wall) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            # records may carry any float
            finite_step = isinstance(step, (int, float)) and math.isfinite(step)
            self.writer.add_scalar(tag, value, int(step) if finite_step else 0, wall)

    def close(self) -> None:
        self.writer.close()
