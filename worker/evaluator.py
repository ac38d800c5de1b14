"""The evaluator: a worker mode that pulls the current parameters every
`eval.every_s` seconds, measures test loss and accuracy, and reports them to
the scheduler, so every algorithm gets the same accuracy-versus-time curve.
When the run stops it evaluates once more, so the final numbers describe the
final model (not when the scheduler was lost: nobody would record them), and
(given `model_out`) writes exactly that model to MODEL_OUT/model.safetensors and
MODEL_OUT/model.json (export.py). With `eval.keep_best` it also keeps a copy of
the parameters its best evaluation measured and writes them as
MODEL_OUT/best.safetensors and best.json: an asynchronous run that stops on a
target accuracy may swing below it in the updates between that evaluation and
the stop. Blocking.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hetps.proto.plan import ClusterPlan
from hetps.proto.rpc import Aborted
from hetps.runconfig.schema import RunConfig
from hetps.runtime.membership import Membership

from .client import PSClient
from .data import ArrayDataset
from .export import describe, state_copy, write_model, write_state
from .state import ModelState

log = logging.getLogger(__name__)


@dataclasses.dataclass
class BestEvaluation:
    """The parameters of the best evaluation so far, copied when it was measured."""

    accuracy: float
    loss: float
    versions: list[int]  # each shard's version the pull returned
    state: dict[str, torch.Tensor]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, data: ArrayDataset, batch_size: int, device: torch.device
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy loss) of `model` on all of `data`."""
    model.eval()
    correct, loss_sum = 0, 0.0
    for start in range(0, len(data), batch_size):
        x, y = data.batch(torch.arange(start, min(start + batch_size, len(data))))
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
    return correct / len(data), loss_sum / len(data)


class Evaluator:
    def __init__(
        self,
        cfg: RunConfig,
        member: Membership,
        plan: ClusterPlan,
        state: ModelState,
        test: ArrayDataset,
        model_out: Path | None = None,
        shape: tuple = ((), 0),
    ):
        self.cfg = cfg
        self.model_out = model_out
        self.shape = shape  # (input shape, num_classes), for model.json
        self.member = member
        self.state = state
        self.test = test
        # sent with each result: the scheduler's divergence guard knows chance
        self.num_classes = shape[1] or None
        plans = member.newer_plan if cfg.cluster.replicas else None  # follow a failover
        self.client = PSClient(
            plan,
            member.node_id,
            cfg.cluster,
            member.stop_requested.is_set,
            plans=plans,
            transport=member.transport,
        )
        # the final evaluation must still reach the shards after stop is requested
        self.final_client = PSClient(
            plan, member.node_id, cfg.cluster, plans=plans, transport=member.transport
        )
        self.evals = 0
        self.accuracy: float | None = None  # of the latest evaluation
        self.loss: float | None = None
        self.best: BestEvaluation | None = None  # with eval.keep_best

    def stats(self) -> dict:
        return {
            "evals": self.evals,
            "accuracy": self.accuracy,
            "loss": self.loss,
            "bytes_sent": self.client.bytes_sent + self.final_client.bytes_sent,
            "bytes_received": self.client.bytes_received + self.final_client.bytes_received,
        }

    def evaluate_once(self, client: PSClient, final: bool = False) -> None:
        started = time.perf_counter()
        self.state.load(client.pull(-1))
        accuracy, loss = evaluate(
            self.state.model, self.test, self.cfg.data.eval_batch_size, self.state.device
        )
        self.evals += 1
        self.accuracy, self.loss = accuracy, loss
        if self.cfg.eval.keep_best and (self.best is None or accuracy > self.best.accuracy):
            self.best = BestEvaluation(
                accuracy, loss, list(client.versions), state_copy(self.state.model.state_dict())
            )
        self.member.report(
            "eval",
            {
                "accuracy": accuracy,
                "loss": loss,
                "final": final,
                "versions": list(client.versions),
                "eval_s": time.perf_counter() - started,
                "num_classes": self.num_classes,
            },
        )

    def run(self) -> None:
        stop = self.member.stop_requested
        with contextlib.suppress(Aborted):  # stop came while a pull was waiting
            while not stop.is_set():
                next_at = time.monotonic() + self.cfg.eval.every_s
                self.evaluate_once(self.client)
                stop.wait(max(0.0, next_at - time.monotonic()))
        if not self.member.scheduler_lost:
            # the scheduler was lost while the final result was reported
            with contextlib.suppress(Aborted):
                self.evaluate_once(self.final_client, final=True)
        if self.model_out is not None:
            self.save_model(self.model_out)

    def save_model(self, folder: Path) -> None:
        """The model of the last evaluation -> folder/model.safetensors and model.json;
        the best evaluation's (`eval.keep_best`) -> folder/best.safetensors and best.json."""
        in_shape, num_classes = self.shape
        path, _ = write_model(
            self.state.model,
            folder / "model.safetensors",
            describe(
                self.cfg,
                in_shape,
                num_classes,
                self.accuracy,
                self.loss,
                "evaluator",
                evaluation="final",
            ),
        )
        log.info("model written to %s (test accuracy %s)", path, self.accuracy)
        if self.best is not None:
            b = self.best
            path, _ = write_state(
                b.state,
                folder / "best.safetensors",
                describe(
                    self.cfg,
                    in_shape,
                    num_classes,
                    b.accuracy,
                    b.loss,
                    "evaluator",
                    evaluation="best",
                    versions=b.versions,
                ),
            )
            log.info("best model written to %s (test accuracy %s)", path, b.accuracy)

    def close(self) -> None:
        self.client.close()
        self.final_client.close()
