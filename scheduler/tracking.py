"""Experiment tracking: the scheduler mirrors the run to MLflow (`tracking.mlflow`) and Weights &
Biases (`tracking.wandb`), the way tensorboard.py mirrors it to TensorBoard: the run's
configuration as parameters (flattened: `optimizer.lr`, `cluster.workers`, ...), every
evaluation's metrics at the cluster's global step (every number of the row: `eval/accuracy`,
`eval/loss`, `eval/perplexity`, ..., and the row's `t`, `global_samples`), and at the end the
numbers of summary.json under `summary/` (MLflow also keeps summary.json as an artifact).

Both are optional extras (`pip install 'hetps[mlflow]'`, `'hetps[wandb]'`), off by default;
`missing(cfg)` says in one line what to install. The calls run on a thread of their own, so a
slow or unreachable tracking server never holds up the scheduler's loop; a failing call is
logged once per backend and the run goes on.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from pathlib import Path
from typing import Any

from hetps.runconfig.load import config_to_dict
from hetps.runconfig.schema import RunConfig

from .nodes import EVAL_ROW_FIELDS
from .runlog import read_summary

log = logging.getLogger(__name__)
CLOSE_WAIT_S = 60.0  # longest wait at the end for the queued calls to reach the tracking servers
MAX_PARAM_CHARS = 500  # a long value (a list of 256 workers) is cut: a parameter is a label


def wanted(cfg: RunConfig) -> dict[str, str]:
    """{backend: its import name} for the backends the config turns on."""
    out = {}
    if cfg.tracking.mlflow.tracking_uri:
        out["mlflow"] = "mlflow"
    if cfg.tracking.wandb.project and cfg.tracking.wandb.mode != "disabled":
        out["wandb"] = "wandb"
    return out


def missing(cfg: RunConfig) -> str | None:
    """None when every tracking backend the config turns on can be imported here, else a
    config error naming the setting and the extra to install."""
    for backend, module in wanted(cfg).items():
        try:
            __import__(module)
        except ImportError as exc:
            return (
                f"tracking.{backend} needs the {module} package, which is not installed ({exc}): "
                f"pip install 'hetps[{backend}]', or drop tracking.{backend}"
            )
    return None


def flat_params(cfg: RunConfig) -> dict[str, str]:
    """The configuration as {dotted key: text}: mappings nested into keys, every other value
    (a list of node settings as well) as its JSON text, cut to MAX_PARAM_CHARS."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
        else:
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
            out[prefix] = text[:MAX_PARAM_CHARS]

    walk("", config_to_dict(cfg))
    return out


def eval_metrics(values: dict) -> dict[str, float]:
    """The numbers of an eval row: its metrics as `eval/NAME`, its own fields (t,
    global_samples, ...) by their name; the global step is the step, not a metric."""
    out = {}
    for name, value in values.items():
        if name == "global_steps" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[name if name in EVAL_ROW_FIELDS else f"eval/{name}"] = float(value)
    return out


def summary_metrics(summary: dict) -> dict[str, float]:
    """summary.json's top-level numbers as `summary/KEY` (its sections are left to the file)."""
    return {
        f"summary/{k}": float(v)
        for k, v in summary.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


class _Mlflow:
    def __init__(self, cfg: RunConfig, run_name: str):
        from mlflow.tracking import MlflowClient

        conf = cfg.tracking.mlflow
        self.client = MlflowClient(tracking_uri=conf.tracking_uri)
        exp = self.client.get_experiment_by_name(conf.experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(conf.experiment)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id

    def params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def metrics(self, metrics: dict[str, float], step: int, wall: float) -> None:
        from mlflow.entities import Metric

        ms = int(wall * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, v, ms, step) for k, v in metrics.items()]
        )

    def finish(self, summary: dict | None, summary_path: Path | None) -> None:
        if summary is not None:
            self.metrics(summary_metrics(summary), summary.get("global_steps", 0), time.time())
            if summary_path is not None and summary_path.exists():
                self.client.log_artifact(self.run_id, str(summary_path))
        self.client.set_terminated(self.run_id, "FINISHED")


class _Wandb:
    def __init__(self, cfg: RunConfig, run_name: str, run_dir: Path | None):
        import wandb

        conf = cfg.tracking.wandb
        self.run = wandb.init(
            project=conf.project,
            entity=conf.entity or None,
            mode=conf.mode,
            dir=conf.dir or (str(run_dir) if run_dir else None),
            name=run_name,
            config=config_to_dict(cfg),
            reinit="create_new",
        )
        self.run.define_metric("global_steps")
        self.run.define_metric("*", step_metric="global_steps")

    def params(self, params: dict[str, str]) -> None:
        pass  # wandb.init took the configuration

    def metrics(self, metrics: dict[str, float], step: int, wall: float) -> None:
        self.run.log({**metrics, "global_steps": step})

    def finish(self, summary: dict | None, summary_path: Path | None) -> None:
        if summary is not None:
            self.run.summary.update(summary_metrics(summary))
        self.run.finish()


class TrackingSink:
    """A RunLog sink (like tensorboard.TensorBoardSink): `record` takes every record the
    scheduler writes to metrics.jsonl, `close` logs summary.json (written just before) and
    ends the tracked runs. The backends' calls run in order on one thread."""

    def __init__(self, cfg: RunConfig, run_id: str, run_dir: Path | None):
        self.run_dir = run_dir
        self.run_name = cfg.tracking.mlflow.run_name or f"{cfg.name}-{run_id}"
        self.cfg = cfg
        self.backends: list = []
        self.failed: set[str] = set()
        self.wall0: float | None = None  # wall-clock time at the run's t = 0
        self.calls: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="tracking", daemon=True)
        self.thread.start()
        self.calls.put(self._open)

    def _open(self) -> None:
        backends = wanted(self.cfg)
        if "mlflow" in backends:
            self._guard("mlflow", lambda: self.backends.append(_Mlflow(self.cfg, self.run_name)))
        if "wandb" in backends:
            self._guard(
                "wandb",
                lambda: self.backends.append(_Wandb(self.cfg, self.run_name, self.run_dir)),
            )
        self._each("params", flat_params(self.cfg))

    def _guard(self, name: str, call) -> None:
        try:
            call()
        except Exception:  # a tracking server down must not end the run
            if name not in self.failed:
                self.failed.add(name)
                log.exception("experiment tracking (%s) failed; the run goes on", name)

    def _run(self) -> None:
        while True:
            call = self.calls.get()
            if call is None:
                return
            call()

    def record(self, kind: str, values: dict) -> None:
        t = values.get("t")
        if isinstance(t, (int, float)) and self.wall0 is None and kind != "register":
            self.wall0 = time.time() - t
        if kind != "eval":
            return
        metrics = eval_metrics(values)
        step = values.get("global_steps", 0)
        step = int(step) if isinstance(step, (int, float)) and math.isfinite(step) else 0
        wall = self.wall0 + t if isinstance(t, (int, float)) and self.wall0 else time.time()
        self.calls.put(lambda: self._each("metrics", metrics, step, wall))

    def _each(self, method: str, *args) -> None:
        """Call `method` of every open backend (on the tracking thread, after `_open`)."""
        for b in self.backends:
            self._guard(type(b).__name__.strip("_").lower(), lambda b=b: getattr(b, method)(*args))

    def close(self) -> None:
        summary = read_summary(self.run_dir) if self.run_dir else None
        path = self.run_dir / "summary.json" if self.run_dir else None
        self.calls.put(lambda: self._each("finish", summary, path))
        self.calls.put(None)
        self.thread.join(timeout=CLOSE_WAIT_S)
        if self.thread.is_alive():
            log.warning("experiment tracking: calls still pending after %.0fs; left", CLOSE_WAIT_S)


class Sinks:
    """Several RunLog sinks as one (TensorBoard and tracking together)."""

    def __init__(self, *sinks):
        self.sinks = [s for s in sinks if s is not None]

    def record(self, kind: str, values: dict) -> None:
        for s in self.sinks:
            s.record(kind, values)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
