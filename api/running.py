"""`hetps.run`: a local cluster run from Python, exactly as `hetps run` runs it
(frontend/launcher.py `run_local`: the same processes, files and statuses), with a typed
result and a callback per evaluation.

It works from a plain script or a notebook cell, with or without an
`if __name__ == "__main__":` guard (the daemons are forked without running the caller's
`__main__` again: frontend/zygote.py). A run that could not start or whose process failed
raises RunFailed naming the cause; a run that completed, diverged or was interrupted returns
its Result (`status` says which, `detail` why).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetps.frontend.launcher import LocalCluster, default_run_dir, progress_for, run_local
from hetps.frontend.report import Progress
from hetps.proto.errors import ConfigError, HetpsError
from hetps.runconfig.load import config_to_dict, load_config
from hetps.runconfig.schema import RunConfig
from hetps.runtime.import_path import with_pythonpath
from hetps.scheduler.outcome import EXIT_CODES
from hetps.scheduler.runlog import parse_record, read_summary

from .make_config import config
from .shipping import as_name, import_roots, task_setting

EvalCallback = Callable[[dict], Any]  # an eval row of metrics.jsonl
StepCallback = Callable[[dict], Any]  # a step record of metrics.jsonl
EndCallback = Callable[["Result"], Any]


class RunFailed(HetpsError, RuntimeError):
    """The run could not start (a bad config, the model check, a directory that cannot be
    written) or one of its processes failed. The message names the cause (the launcher's own
    words, with the failed process's last log lines); `result` is the run's Result when the
    run started (its summary.json says `failed`), else None."""

    def __init__(self, message: str, result: Result | None = None):
        super().__init__(message)
        self.result = result


@dataclass(frozen=True)
class Result:
    """What a run left in its directory, read back."""

    run_dir: Path
    status: str  # completed | diverged | interrupted | failed (summary.json `status`)
    exit_code: int  # as `hetps run`'s: 0, 3, 130, 1
    stop_reason: str | None  # e.g. target, max_seconds, max_steps, diverged, interrupted
    detail: str | None  # why it diverged or failed
    metric: str | None  # the watched metric's name (e.g. accuracy, perplexity)
    higher_is_better: bool | None
    metrics: dict[str, float]  # every metric of the final evaluation
    best: float | None  # the watched metric's best value over the evaluations
    target: dict | None  # {"metric", "value"} or None
    time_to_target_s: float | None  # seconds of training until the target was reached
    global_steps: int
    wall_s: float | None
    # RUN_DIR/model.safetensors: the final model (hetps.load_model(run_dir, best=False))
    model_path: Path | None
    # RUN_DIR/best.safetensors: the best-evaluated one (eval.keep_best), what
    # hetps.load_model(run_dir) loads when it exists
    best_model_path: Path | None
    rows: list[dict] = field(repr=False)  # metrics.jsonl's evaluation rows, in order
    summary: dict = field(repr=False)  # summary.json as written

    @property
    def value(self) -> float | None:
        """The watched metric's value at the final evaluation."""
        return self.metrics.get(self.metric) if self.metric else None


def read_result(run_dir: Path, exit_code: int, rows: list[dict] | None = None) -> Result:
    """The Result of the run in `run_dir` (summary.json and metrics.jsonl as written)."""
    summary = read_summary(run_dir) or {}
    if rows is None:
        rows = EvalRows(run_dir / "metrics.jsonl").read()
    last = rows[-1] if rows else {}
    metric = summary.get("metric") or {}
    name = metric.get("name") or last.get("watch") or ("accuracy" if "accuracy" in last else None)
    higher = metric.get("higher_is_better", last.get("higher_is_better", True if name else None))
    metrics = summary.get("final_metrics") or row_metrics(last)
    metrics = {k: v for k, v in metrics.items() if k not in ROW_FIELDS}
    best = summary.get("best", summary.get("best_accuracy"))
    target = summary.get("target")
    if target is None and summary.get("target_accuracy") is not None and name == "accuracy":
        target = {"metric": "accuracy", "value": summary["target_accuracy"]}
    model, best_model = run_dir / "model.safetensors", run_dir / "best.safetensors"
    return Result(
        run_dir=run_dir,
        status=summary.get("status", "failed"),
        exit_code=exit_code,
        stop_reason=summary.get("stop_reason"),
        detail=summary.get("detail"),
        metric=name,
        higher_is_better=higher,
        metrics=metrics,
        best=best,
        target=target,
        time_to_target_s=summary.get("time_to_target_s"),
        global_steps=int(summary.get("global_steps") or 0),
        wall_s=summary.get("wall_s"),
        model_path=model if model.exists() else None,
        best_model_path=best_model if best_model.exists() else None,
        rows=rows,
        summary=summary,
    )


# an eval row's fields that are not metrics
ROW_FIELDS = {"kind", "t", "global_steps", "global_samples", "final", "bytes", "versions", "eval_s"}
ROW_FIELDS |= {"watch", "higher_is_better", "num_classes", "segment", "reached"}
ROW_FIELDS |= {"lr"}  # the shards' lr at the evaluation (worker/evaluator.py), not a task metric


def row_metrics(row: dict) -> dict[str, float]:
    """The metrics of an eval row of metrics.jsonl (flattened into it beside bookkeeping)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k not in ROW_FIELDS and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class EvalRows:
    """Follows metrics.jsonl as it grows: each new evaluation row, once, in order (kept in
    `rows`); with `step_every`, also the step records of every worker's steps numbered a
    multiple of it (handed out once, not kept)."""

    def __init__(self, path: Path, step_every: int | None = None):
        self.path = path
        self.offset = 0
        self.rows: list[dict] = []
        self.step_every = step_every

    def poll(self) -> list[dict]:
        """The evaluation rows written since the last poll (a torn last line waits)."""
        return [r for r in self.poll_records() if r["kind"] == "eval"]

    def poll_records(self) -> list[dict]:
        """The evaluation rows and sampled step records written since the last poll, in the
        file's order."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        new = [
            r
            for r in map(parse_record, complete.splitlines())
            if r is not None and (r["kind"] == "eval" or self.sampled(r))
        ]
        self.rows += [r for r in new if r["kind"] == "eval"]
        return new

    def sampled(self, record: dict) -> bool:
        """A step record of a step numbered a multiple of `step_every` (a worker counts its
        steps from 1)."""
        step = record.get("step")
        return (
            record["kind"] == "step"
            and self.step_every is not None
            and isinstance(step, int)
            and step % self.step_every == 0
        )

    def read(self) -> list[dict]:
        self.poll()
        return self.rows


class Callbacks:
    """Calls `on_eval` once per evaluation row and `on_step` once per sampled step record
    (EvalRows.step_every), in metrics.jsonl's order, from the launcher's watch loop (the
    caller's thread, 4 times a second: after the fact, they cannot change the step); `on_end`
    once with the Result (`end`). An exception in one stops the run cleanly (as Ctrl-C) and
    is raised by `hetps.run` once the run has ended: raise optuna.TrialPruned there to prune a
    trial; no callback is called after it but `on_end`.
    With `progress` (frontend/report.py Progress: `hetps run`'s own line), prints the
    progress line once after each poll that brought evaluations."""

    def __init__(
        self,
        rows: EvalRows,
        on_eval: EvalCallback | None,
        progress: Progress | None,
        on_step: StepCallback | None = None,
        on_end: EndCallback | None = None,
    ):
        self.rows = rows
        self.on_eval = on_eval
        self.on_step = on_step
        self.on_end = on_end
        self.progress = progress
        self.stream = sys.stderr  # the caller's (a notebook's cell output), not the captured one
        self.error: BaseException | None = None

    def __call__(self, cluster: LocalCluster | None) -> None:
        new = self.rows.poll_records()
        if self.progress is not None and any(r["kind"] == "eval" for r in new):
            self.progress.poll()
            print(self.progress.line(), file=self.stream, flush=True)
        for row in new:
            call = self.on_eval if row["kind"] == "eval" else self.on_step
            if call is None or self.error is not None:
                continue
            try:
                call(row)
            except BaseException as exc:  # noqa: BLE001 - the caller's, raised after a clean stop
                self.error = exc
                if cluster is not None:
                    cluster.stop()

    def end(self, result: Result) -> None:
        """`on_end(result)`, once; its exception is kept (raised by `hetps.run`) unless an
        earlier callback's is."""
        if self.on_end is None:
            return
        try:
            self.on_end(result)
        except BaseException as exc:  # noqa: BLE001 - the caller's, raised by hetps.run
            self.error = self.error or exc


def run(
    cfg: RunConfig | str | Path | dict,
    *,
    task: Any = None,
    model: Any = None,
    dataset: Any = None,
    out: str | Path | None = None,
    on_eval: EvalCallback | None = None,
    on_step: StepCallback | None = None,
    step_every: int = 50,
    on_end: EndCallback | None = None,
    progress: bool = False,
    prometheus: bool = False,
) -> Result:
    """Run `cfg` (a RunConfig from `hetps.config`, or what `hetps.config` takes) on a local
    cluster, as `hetps run` does; returns its Result.

    `task`: a built-in task's name, 'package.module:factory', a Task class or factory
    function (imported by the daemons by reference) or a Task object (pickled into the run
    directory); its class must be importable: one defined in `__main__` is refused, naming the
    fix. `model`, `dataset`: a factory (a function or class) or 'package.module:factory',
    set as model.name and data.dataset. `out`: the run directory (default:
    out_dir/NAME-ALGO-TIME). `on_eval(row)`: called once per evaluation with its
    metrics.jsonl row (`row[row["watch"]]` is the watched metric); an exception in it stops
    the run and is raised here; the row's `lr` is the shards' learning rate at the
    evaluation (the algorithms that push gradients). `on_step(record)`: called with the
    step record of every worker's steps numbered a multiple of `step_every` (worker, step,
    loss, t, ...; Lightning's log_every_n_steps is 50 too), an exception as on_eval's.
    `on_end(result)`: called once with the Result when the run has ended, whatever its
    status (before RunFailed is raised; not when the run could not start); an exception
    in it is raised here. The callbacks run in this thread as metrics.jsonl grows (4 times
    a second), after the fact: they watch the run, they cannot change a step.
    `progress`: print `hetps run`'s progress line to stderr after
    each evaluation.
    `prometheus`: every daemon serves Prometheus /metrics (`hetps run --metrics`).

    Raises ConfigError for a bad config, RunFailed when the run could not start or failed."""
    cfg = cfg if isinstance(cfg, RunConfig) else config(cfg)
    run_dir = Path(out) if out is not None else default_run_dir(cfg)
    run_dir = run_dir.expanduser().absolute()
    changes: dict[str, Any] = {}
    if task is not None:
        changes["task"] = task_setting(task, run_dir)
    if model is not None:
        changes["model.name"] = as_name(model, "the model")
    if dataset is not None:
        changes["data.dataset"] = as_name(dataset, "the dataset")
    # what the daemons will import, imported here first: a bad name is a ConfigError now
    cfg = load_config(config_to_dict(config(cfg, **changes)), import_targets=True)
    names = [cfg.task.name, cfg.model.name, cfg.data.dataset, cfg.optimizer.schedule.name]
    if isinstance(step_every, bool) or not isinstance(step_every, int) or step_every < 1:
        raise ValueError(f"hetps.run: step_every must be an int >= 1, got {step_every!r}")
    rows = EvalRows(run_dir / "metrics.jsonl", step_every if on_step is not None else None)
    shown = progress_for(cfg, run_dir) if progress else None
    callbacks = Callbacks(rows, on_eval, shown, on_step, on_end)
    said = io.StringIO()  # the launcher's own words (errors, warnings) for the exception
    with exported_pythonpath(import_roots(names)), contextlib.redirect_stderr(said):
        code = run_local(cfg, run_dir, quiet=True, metrics=prometheus, on_poll=callbacks)
    callbacks(None)  # the rows written after the last poll: the final evaluation
    text = said.getvalue().strip()
    if code == 2:
        raise RunFailed(text or f"hetps.run: the run in {run_dir} could not start")
    result = read_result(run_dir, code, rows.rows)
    callbacks.end(result)
    if result.status == "failed" or code == 1:
        raise RunFailed(text or f"hetps.run: {result.detail or 'the run failed'}", result)
    if text:  # a completed run's warnings (e.g. the model export failed): shown, not kept
        print(text, file=sys.stderr)
    if callbacks.error is not None:
        raise callbacks.error
    return result


@contextlib.contextmanager
def exported_pythonpath(roots: list[str]):
    """PYTHONPATH with `roots` while the run starts processes: those started by exec (the
    scheduler, `HETPS_SPAWN=exec`, the model export) import the user's modules from there as
    this process did (forked daemons take this process's sys.path)."""
    before = os.environ.get("PYTHONPATH")
    os.environ.update(with_pythonpath(dict(os.environ), roots))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def load_result(run_dir: str | Path) -> Result:
    """The Result of a finished run's directory (e.g. one `hetps run` made)."""
    run_dir = Path(run_dir)
    if not (run_dir / "summary.json").exists():
        raise ConfigError(f"{run_dir}: no summary.json (not a run directory, or still running)")
    status = (read_summary(run_dir) or {}).get("status", "failed")
    return read_result(run_dir, EXIT_CODES.get(status, EXIT_CODES["failed"]))
