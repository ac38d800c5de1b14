"""The evaluator: a worker mode that pulls the current parameters every
`eval.every_s` seconds, measures the task's metrics on the whole test split
(task.py: sums over every batch, then reduced), and reports them to the
scheduler, so every algorithm gets the same metric-versus-time curve, with the
lr the shards' optimizer held when they sent the values measured (`lr`, beside the
metrics: PARAMS' `lr` of the shard with the newest version).
When the run stops it evaluates once more, so the final numbers describe the
final model (not when the scheduler was lost: nobody would record them), and
(given `model_out`) writes exactly that model to MODEL_OUT/model.safetensors and
MODEL_OUT/model.json (export.py; `versions`: each shard's version it holds).
The final evaluation waits at most FINAL_WAIT_S for any one reply: a shard
that died as the run stopped is not waited for (the scheduler stops the
shards STOP_GRACE_S = 20 s after the stop began, whoever is still waiting),
and it is not made when the stop names a shard the scheduler had declared
dead (Membership.dead_shards).
Then the files hold the last evaluation that was measured (its `evaluation`:
"last", the final one's error in `final_error`), or, for a model whose sparse
tables can no longer be read whole, and unless that evaluation was the best
(`eval.keep_best` holds its copy whole), model.safetensors is left to the
launcher (built from the shards' checkpoints). A model never measured is never
written. With `eval.keep_best` it also keeps a copy of
the parameters its best evaluation measured (by the watched metric and its
direction) and writes them as MODEL_OUT/best.safetensors and best.json: an
asynchronous run that stops on a target may swing past it in the updates
between that evaluation and the stop. A resumed run's evaluator replaces an
earlier segment's best.safetensors only with a better one. Blocking.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from pathlib import Path

import torch

from hetps.proto.errors import HetpsError
from hetps.proto.plan import ClusterPlan
from hetps.proto.rpc import Aborted
from hetps.runconfig.algorithms import algorithm
from hetps.runconfig.schema import RunConfig
from hetps.runtime.membership import Membership
from hetps.training.data import ArrayDataset
from hetps.training.export import describe, state_copy, write_state
from hetps.training.measure import better, measure, report_values, test_loader
from hetps.training.sparse import tables_of
from hetps.training.state import ModelState
from hetps.training.step import task_for
from hetps.training.task import Metric, Task, watched_metric
from hetps.worker.row_exchange import RowExchange

from .client import PSClient

log = logging.getLogger(__name__)

# the final evaluation's longest wait for one reply, seconds: a live shard answers a pull in
# milliseconds; within the scheduler's 20 s grace before it stops the shards
FINAL_WAIT_S = 10.0


@dataclasses.dataclass
class BestEvaluation:
    """The parameters of the best evaluation so far, copied when it was measured."""

    metrics: dict[str, float]
    versions: list[int]  # each shard's version the pull returned
    state: dict[str, torch.Tensor]


def earlier_best(folder: Path | None, watched: Metric) -> float | None:
    """The watched metric's value in folder/best.json, written by an earlier
    segment of this run (`hetps run --resume`); None when there is none, or
    it was measured on another metric."""
    if folder is None:
        return None
    try:
        described = json.loads((folder / "best.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(described, dict) or described.get("watch") != watched.name:
        return None
    value = (described.get("metrics") or {}).get(watched.name)
    return float(value) if isinstance(value, (int, float)) else None


class Evaluator:
    """Evaluates the shards' current model every `eval.every_s` (the task's
    metrics over the whole test split) and reports it; keeps the best
    evaluation by the watched metric (task.py watched_metric) with
    `eval.keep_best`."""

    def __init__(
        self,
        cfg: RunConfig,
        member: Membership,
        plan: ClusterPlan,
        state: ModelState,
        test: ArrayDataset,
        model_out: Path | None = None,
        shape: tuple = ((), 0),
        task: Task | None = None,
    ):
        self.cfg = cfg
        self.model_out = model_out
        self.shape = shape  # (input shape, num_classes), for model.json
        self.member = member
        self.state = state
        self.test = test
        self.task = task or task_for(cfg, shape[1] or None)
        self.watched = watched_metric(cfg, self.task)
        # an earlier segment's best (hetps run --resume): best.safetensors is replaced only when beaten
        self.best_before = earlier_best(model_out, self.watched) if cfg.eval.keep_best else None
        plans = member.newer_plan if cfg.cluster.replicas else None  # follow a failover
        self.client = PSClient(
            plan,
            member.node_id,
            cfg.cluster,
            member.stop_requested.is_set,
            plans=plans,
            transport=member.transport,
        )
        # the final evaluation must still reach the shards after stop is requested, but never
        # waits long for one that died meanwhile
        final_cluster = dataclasses.replace(
            cfg.cluster,
            request_timeout_s=min(cfg.cluster.request_timeout_s, FINAL_WAIT_S),
        )
        self.final_client = PSClient(
            plan, member.node_id, final_cluster, plans=plans, transport=member.transport
        )
        # sparse tables: the latest rows, read as each test batch needs them (sparse.py)
        self.rows = self.final_rows = None
        if plan.tables:
            self.rows, self.final_rows = (
                RowExchange(
                    plan,
                    member.node_id,
                    cluster,
                    member.transport,
                    abort,
                    client.address_of if plans else None,
                    read_only=True,
                    max_ids=cfg.sparse.max_ids,
                )
                for client, abort, cluster in (
                    (self.client, member.stop_requested.is_set, cfg.cluster),
                    (self.final_client, None, final_cluster),
                )
            )
        # the shards' lr when they sent the values an evaluation measured, reported as `lr`
        # beside the metrics: under the algorithms whose shards step the configured optimizer
        # (gradient pushes). Model averaging and diloco schedule it on each worker's local
        # steps, which the evaluator does not see: their rows carry no lr
        self.reports_lr = algorithm(cfg.algorithm.name).worker_loop == "gradients"
        self.evals = 0
        self.batches = None  # the test split's loader, made at the first evaluation
        self.metrics: dict[str, float] = {}  # of the latest evaluation
        self.versions: list[int] = []  # each shard's version the latest evaluation measured
        # the model holds values no evaluation measured (a pull came, its measure failed)
        self.unmeasured = False
        self.final_error: str | None = None  # why the final evaluation could not be made
        self.best: BestEvaluation | None = None  # with eval.keep_best

    @property
    def accuracy(self) -> float | None:
        return self.metrics.get("accuracy")

    @property
    def loss(self) -> float | None:
        return self.metrics.get("loss")

    def stats(self) -> dict:
        return {
            "evals": self.evals,
            "accuracy": self.accuracy,
            "loss": self.loss,
            self.watched.name: self.metrics.get(self.watched.name),
            "bytes_sent": self.client.bytes_sent + self.final_client.bytes_sent,
            "bytes_received": self.client.bytes_received + self.final_client.bytes_received,
        }

    def evaluate_once(self, client: PSClient, final: bool = False) -> None:
        started = time.perf_counter()
        values = client.pull(-1)
        self.unmeasured = True
        self.state.load(values)
        rows = self.final_rows if client is self.final_client else self.rows
        if rows is not None:
            rows.bind(self.state.model)
        if self.batches is None:  # one loader for every evaluation: its processes stay
            self.batches = test_loader(self.task, self.test, self.cfg, persistent=True)
        metrics = measure(
            self.task, self.state.model, self.test, self.cfg, self.state.device, self.batches
        )
        self.evals += 1
        self.metrics, self.versions, self.unmeasured = metrics, list(client.versions), False
        value = metrics[self.watched.name]
        if self.cfg.eval.keep_best and better(
            self.watched, value, self.best.metrics[self.watched.name] if self.best else None
        ):
            self.best = BestEvaluation(
                metrics, list(client.versions), state_copy(self.full_state(rows))
            )
        lr = None
        if self.reports_lr and client.versions:
            newest = max(range(len(client.versions)), key=client.versions.__getitem__)
            lr = client.lrs[newest]
        self.member.report(
            "eval",
            report_values(
                self.task,
                self.watched,
                metrics if lr is None or "lr" in metrics else {**metrics, "lr": lr},
                final=final,
                versions=list(client.versions),
                eval_s=time.perf_counter() - started,
            ),
        )

    def run(self) -> None:
        stop = self.member.stop_requested
        with contextlib.suppress(Aborted):  # stop came while a pull was waiting
            while not stop.is_set():
                next_at = time.monotonic() + self.cfg.eval.every_s
                self.evaluate_once(self.client)
                stop.wait(max(0.0, next_at - time.monotonic()))
        dead = ", ".join(f"ps{r}" for r in self.member.dead_shards)
        if dead and not self.member.scheduler_lost:
            # nothing to wait FINAL_WAIT_S for: the scheduler declared them dead before the stop
            self.final_error = f"{dead} declared dead before the stop"
            log.warning(
                "final evaluation not made (%s); the last one measured versions %s",
                self.final_error,
                self.versions,
            )
        elif not self.member.scheduler_lost:
            # the scheduler was lost while the final result was reported
            try:
                self.evaluate_once(self.final_client, final=True)
            except Aborted:
                pass
            except HetpsError as exc:  # a shard that died as the run stopped, ...
                self.final_error = str(exc)
                log.warning(
                    "final evaluation not made (%s); the last one measured versions %s",
                    exc,
                    self.versions,
                )
        if self.model_out is not None:
            self.save_model(self.model_out)

    def save_model(self, folder: Path) -> None:
        """The model of the last evaluation -> folder/model.safetensors and model.json;
        the best evaluation's (`eval.keep_best`) -> folder/best.safetensors and best.json,
        unless an earlier segment of the run wrote a better one there."""
        in_shape, num_classes = self.shape

        def described(metrics: dict, evaluation: str, **more) -> dict:
            return describe(
                self.cfg,
                in_shape,
                num_classes,
                metrics,
                "evaluator",
                task=self.task,
                watched=self.watched,
                evaluation=evaluation,
                **more,
            )

        self._save_final(folder, described)
        b = self.best
        if b is None:
            return
        if not better(self.watched, b.metrics[self.watched.name], self.best_before):
            log.info(
                "best model kept from an earlier segment (%s %s; this one's best: %s)",
                self.watched.name,
                self.best_before,
                b.metrics[self.watched.name],
            )
            return
        path, _ = write_state(
            b.state,
            folder / "best.safetensors",
            described(b.metrics, "best", versions=b.versions),
        )
        log.info("best model written to %s (%s)", path, b.metrics)

    def _save_final(self, folder: Path, described) -> None:
        """model.safetensors: the model the latest evaluation measured, when the evaluator
        holds it whole (see the module's docstring)."""
        if self.evals == 0 or self.unmeasured:
            log.warning(
                "%s not written: the evaluator holds no measured model (%s)",
                folder / "model.safetensors",
                "no evaluation was made" if self.evals == 0 else "the final one failed midway",
            )
            return
        if self.final_error is not None and not any(self.versions):
            log.warning(
                "%s not written: the last evaluation measured the initial model (%s)",
                folder / "model.safetensors",
                self.final_error,
            )
            return
        more = {"versions": self.versions}
        if self.final_error is not None:
            more["final_error"] = self.final_error
        evaluation = "final" if self.final_error is None else "last"
        b = self.best
        if self.final_error is not None and b is not None and b.versions == self.versions:
            # the last evaluation was the best: its copy is whole, sparse tables included
            path, _ = write_state(
                b.state, folder / "model.safetensors", described(b.metrics, evaluation, **more)
            )
            log.info("model written to %s from the best (= last) evaluation's copy", path)
            return
        if self.final_error is not None and self.final_rows is not None:
            log.warning(
                "%s not written: its sparse tables cannot be read whole (%s)",
                folder / "model.safetensors",
                self.final_error,
            )
            return
        try:
            state = self.full_state(self.final_rows)
        except HetpsError as exc:
            log.warning("%s not written: its sparse tables: %s", folder / "model.safetensors", exc)
            return
        path, _ = write_state(
            state, folder / "model.safetensors", described(self.metrics, evaluation, **more)
        )
        log.info("model written to %s (%s, versions %s)", path, self.metrics, self.versions)

    def full_state(self, rows: RowExchange | None) -> dict[str, torch.Tensor]:
        """The model's state_dict with every sparse table whole (read from the shards), so
        the files load into the model as its factory builds it (`hetps.load_model`)."""
        state = self.state.model.state_dict()
        if rows is not None:
            for name, table in tables_of(self.state.model).items():
                state[name] = rows.full_table(table.spec)
                if table.padding_idx is not None:
                    # read as zeros in training (never learned): so in the file, as torch keeps it
                    state[name][table.padding_idx] = 0.0
        return state

    def close(self) -> None:
        self.client.close()
        self.final_client.close()
        for rows in (self.rows, self.final_rows):
            if rows is not None:
                rows.close()
