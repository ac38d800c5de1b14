"""The scheduler watches any metric an evaluator reports (the task contract's
REPORT: `metrics`, `higher_is_better`, `watch`): the stop target in its metric's
direction with its patience, metrics.jsonl rows and summary.json named by
metric, the divergence guard's loss-explosion rule and its chance-level rule
only where the task has classes. One coordinator over the in-memory transport,
on a clock the test moves (test_coordinator_stop's harness)."""

from __future__ import annotations

import dataclasses
import json
import math

from test_coordinator_stop import cluster

from hetps.proto.codec import Envelope
from hetps.proto.messages import Report
from hetps.proto.transport import MemServer
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import TargetConfig
from hetps.runtime.metrics import METRICS, family
from hetps.scheduler import state, status
from hetps.scheduler.coordinator import Coordinator
from hetps.scheduler.nodes import EvalTrack, read_eval
from hetps.scheduler.outcome import DivergenceGuard

LM = {"perplexity": False, "token_accuracy": True, "loss": False}


def report(c, perplexity: float, loss: float | None = None, num_classes=None, final=False):
    """A language model's evaluation as the evaluator sends it (task contract), `dt` s later."""
    c.now[0] += 2.0
    loss = math.log(perplexity) if loss is None else loss
    values = {
        "metrics": {"perplexity": perplexity, "token_accuracy": 0.3, "loss": loss},
        "higher_is_better": LM,
        "watch": "perplexity",
        "loss": loss,
        "num_classes": num_classes,
        "final": final,
        "versions": [1],
        "eval_s": 0.1,
    }
    node = c.ids["evaluator0"]
    c.coord.on_report(
        b"e", Envelope(Report(node_id=node, kind="eval", values=values), req_id=2, src=node)
    )


def targeting(c, metric: str, value: float, patience: int = 1) -> None:
    """The coordinator's stop target set as a loaded `stop.target` would set it (the
    config's own check refuses a metric of another task than the default's)."""
    stop = dataclasses.replace(
        c.coord.cfg.stop, target=TargetConfig(metric, value), target_accuracy=None
    )
    c.coord.cfg = dataclasses.replace(c.coord.cfg, stop=stop)
    c.coord.evals = EvalTrack(value, patience, target_metric=metric)


def rows(tmp_path) -> list[dict]:
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "eval"]


def test_a_perplexity_target_stops_at_the_first_evaluations_at_or_below_it_held_for_patience(
    tmp_path,
):
    with cluster(tmp_path, []) as c:
        targeting(c, "perplexity", 3.0, patience=2)
        report(c, 9.0)
        report(c, 2.9)  # at the target: the streak starts, time to target is now
        reached_at = c.coord.evals.time_to_target_s
        report(c, 3.5)  # above it (lower is better): the streak breaks
        assert c.coord.stop_reason is None and c.coord.evals.streak == 0
        report(c, 3.0)  # <= counts
        assert c.coord.stop_reason is None
        report(c, 2.5)
        assert (
            c.coord.stop_reason == "target perplexity 3.0 reached (2.5000, held for 2 evaluations)"
        )
        assert reached_at == 4.0 and c.coord.evals.time_to_target_s == 4.0
        summary = status.run_summary(c.coord)
    assert summary["metric"] == {"name": "perplexity", "higher_is_better": False}
    assert summary["best"] == 2.5 and summary["target"] == {"metric": "perplexity", "value": 3.0}
    assert summary["final_metrics"] == {
        "perplexity": 2.5,
        "token_accuracy": 0.3,
        "loss": math.log(2.5),
    }
    # no accuracy in this task: the classification fields say so rather than hold another number
    assert (summary["final_accuracy"], summary["best_accuracy"], summary["target_accuracy"]) == (
        None,
        None,
        None,
    )
    written = rows(tmp_path)
    assert [r["perplexity"] for r in written] == [9.0, 2.9, 3.5, 3.0, 2.5]
    assert all(r["watch"] == "perplexity" and r["higher_is_better"] is False for r in written)
    assert written[-1]["token_accuracy"] == 0.3 and "accuracy" not in written[-1]


def test_the_watched_metric_is_exported_to_prometheus_under_its_name(tmp_path):
    with cluster(tmp_path, []) as c:
        report(c, 7.0)
        report(c, 5.0)
        report(c, 6.0)
        numbers = status.operator_metrics(c.coord)
    base = {"role": "scheduler", "rank": "0"}
    latest = family(METRICS["metric"], numbers["metric"], base)
    best = family(METRICS["best_metric"], numbers["best_metric"], base)
    assert [(s.labels["metric"], s.value) for s in latest.samples] == [("perplexity", 6.0)]
    assert [(s.labels["metric"], s.value) for s in best.samples] == [("perplexity", 5.0)]
    assert numbers["accuracy"] is None and numbers["loss"] == math.log(6.0)


def test_the_default_accuracy_target_is_dropped_for_a_task_without_accuracy(tmp_path):
    """stop.target_accuracy's 0.95 default is classification's: a factory task without an
    accuracy metric (its names known only from its reports) trains to its limits."""
    with cluster(tmp_path, []) as c:
        assert (c.coord.evals.target, c.coord.evals.target_metric) == (0.95, "accuracy")
        report(c, 4.0)
        report(c, 1.0)
        assert c.coord.stop_reason is None and c.coord.evals.target is None
        assert status.run_summary(c.coord)["target"] is None


def test_a_stop_target_on_a_metric_the_task_lacks_fails_the_run_naming_its_metrics(tmp_path):
    with cluster(tmp_path, []) as c:
        targeting(c, "r2", 0.9)
        report(c, 4.0)
        summary = status.run_summary(c.coord)
    assert summary["status"] == "failed"
    assert "stop.target.metric: 'r2'" in summary["detail"]
    assert "perplexity, token_accuracy, loss" in summary["detail"]


def test_the_chance_level_rule_needs_a_class_count(tmp_path):
    """A task whose report carries an accuracy but no num_classes (a regression with an
    accuracy-like metric, a factory task) is never judged at chance level."""
    with cluster(tmp_path, ["stop.diverged_after=1", "stop.diverge_warmup_s=0"]) as c:
        for _ in range(4):
            c.now[0] += 2.0
            node = c.ids["evaluator0"]
            values = {
                "metrics": {"accuracy": 0.0, "loss": 1.0},
                "higher_is_better": {"accuracy": True, "loss": False},
                "watch": "accuracy",
                "loss": 1.0,
                "num_classes": None,
            }
            c.coord.on_report(
                b"e",
                Envelope(Report(node_id=node, kind="eval", values=values), req_id=2, src=node),
            )
        assert c.coord.stop_reason is None and c.coord.guard.verdict is None
        c.evaluation(0.0)  # the classification report names 10 classes: chance level
        assert c.coord.stop_reason == "diverged" and "chance level" in c.coord.guard.verdict


def test_a_test_loss_far_above_its_first_value_is_divergence(tmp_path):
    overrides = ["stop.diverged_after=2", "stop.diverge_warmup_s=3", "optimizer.lr=4"]
    with cluster(tmp_path, overrides) as c:
        report(c, 90.0, loss=4.5)  # t 2: the yardstick
        report(c, 1e9, loss=50.0)  # t 4: over 10x, the first of two
        report(c, 40.0, loss=3.7)  # back down: the count starts again
        assert c.coord.guard.exploded == 0
        report(c, 1e9, loss=46.0)
        assert c.coord.stop_reason is None
        report(c, 1e9, loss=60.0)
        verdict = c.coord.guard.verdict
        assert c.coord.stop_reason == "diverged"
        assert (
            "test loss exploded: 60" in verdict and "4.5" in verdict and "optimizer.lr" in verdict
        )
        assert status.run_summary(c.coord)["status"] == "diverged"


def test_the_loss_rule_waits_for_the_warm_up_and_survives_a_restart(tmp_path):
    guard = DivergenceGuard(after=2, warmup_s=10.0, lr=0.1)
    assert guard.test_loss(2.0, 1.0) is None and guard.early_loss == 2.0
    assert guard.test_loss(500.0, 5.0) is None and guard.exploded == 0  # in the warm-up
    assert guard.test_loss(None, 11.0) is None  # a task without a loss: nothing to judge
    assert guard.test_loss(21.0, 12.0) is None and guard.exploded == 1
    again = DivergenceGuard(after=2, warmup_s=10.0, lr=0.1)
    again.restore(json.loads(json.dumps(guard.saved())))
    assert again.test_loss(25.0, 14.0) is not None
    # a first loss <= 0 (a loss that is not a cross-entropy or a square) gives no yardstick
    signed = DivergenceGuard(after=1, warmup_s=0.0, lr=0.1)
    assert signed.test_loss(-3.0, 0.0) is None and signed.test_loss(1e6, 1.0) is None
    assert signed.test_loss(math.inf, 2.0) is not None  # non-finite: at once, as ever


def test_an_evaluator_of_the_older_form_is_watched_on_accuracy(tmp_path):
    with cluster(tmp_path, ["stop.target_accuracy=0.9"]) as c:
        c.evaluation(0.5, loss=1.5)
        c.evaluation(0.92, loss=0.3)
        assert c.coord.stop_reason == "target accuracy 0.9 reached (0.9200)"
        summary = status.run_summary(c.coord)
    assert (summary["final_accuracy"], summary["best_accuracy"], summary["target_accuracy"]) == (
        0.92,
        0.92,
        0.9,
    )
    assert summary["metric"] == {"name": "accuracy", "higher_is_better": True}
    assert summary["target"] == {"metric": "accuracy", "value": 0.9}
    row = rows(tmp_path)[-1]
    assert (row["accuracy"], row["loss"], row["watch"], row["higher_is_better"]) == (
        0.92,
        0.3,
        "accuracy",
        True,
    )


def resumed(tmp_path, saved: dict, overrides: list[str]):
    """A new segment's coordinator (as `hetps scheduler --resume` builds it) over `saved`."""
    cfg = load_config(
        None, ["cluster.workers=2", "cluster.shards=1", "task=language_model", *overrides]
    )
    tmp_path.mkdir()
    server = MemServer(f"mem://resumed-{tmp_path.name}")
    coord = Coordinator(server, cfg, run_dir=tmp_path, clock=lambda: 500.0)
    coord.resume(saved)
    server.close()
    return coord


def test_a_resume_carries_the_time_to_target_only_for_the_same_target_and_the_loss_yardstick(
    tmp_path,
):
    first = tmp_path / "one"
    first.mkdir()
    with cluster(first, ["stop.diverged_after=2"]) as c:
        targeting(c, "perplexity", 20.0)
        report(c, 90.0, loss=4.5)  # the yardstick of the loss rule
        report(c, 15.0)  # the target, at t 4
        assert c.coord.evals.time_to_target_s is not None
        c.coord.save_state()
    saved = state.read(first)
    # the same target: its time to target is the run's, reached in the first segment
    same = resumed(tmp_path / "same", saved, ["stop.target={metric: perplexity, value: 20}"])
    assert same.evals.time_to_target_s == saved["evals"]["time_to_target_s"]
    assert same.evals.best == 15.0
    # another target: not reached yet, whatever the first segment reached
    other = resumed(tmp_path / "other", saved, ["stop.target={metric: perplexity, value: 5}"])
    assert other.evals.time_to_target_s is None and other.evals.samples_to_target is None
    # the loss rule still measures against the first segment's barely trained model
    assert other.guard.early_loss == 4.5


def test_the_best_value_starts_again_when_another_metric_is_watched():
    track = EvalTrack(None)
    track.take(read_eval({"accuracy": 0.9, "loss": 0.3}))
    assert (track.metric, track.best) == ("accuracy", 0.9)
    lm = {
        "metrics": {"perplexity": 5.0, "loss": 1.6},
        "higher_is_better": LM,
        "watch": "perplexity",
    }
    track.take(read_eval(lm))
    # not min(5.0, 0.9): 0.9 was an accuracy
    assert (track.metric, track.best, track.higher_is_better) == ("perplexity", 5.0, False)


def test_the_default_accuracy_target_is_dropped_when_the_tasks_primary_metric_is_another(tmp_path):
    """A scheduler started from the user's YAML never imports a factory task: when its
    reports say the task's primary (first) metric is macro_f1, the 0.95 accuracy default is
    not its target, as the config's own check settles it (runconfig/targets.py); an accuracy
    of 0.97 does not stop the run."""
    with cluster(tmp_path, []) as c:
        assert (c.coord.evals.target, c.coord.evals.target_metric) == (0.95, "accuracy")
        c.now[0] += 2.0
        node = c.ids["evaluator0"]
        values = {
            "metrics": {"macro_f1": 0.5, "accuracy": 0.97, "loss": 0.4},
            "higher_is_better": {"macro_f1": True, "accuracy": True, "loss": False},
            "watch": "macro_f1",
            "loss": 0.4,
            "final": False,
        }
        c.coord.on_report(
            b"e", Envelope(Report(node_id=node, kind="eval", values=values), req_id=2, src=node)
        )
        assert c.coord.stop_reason is None and c.coord.evals.target is None
