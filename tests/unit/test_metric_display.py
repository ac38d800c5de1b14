"""What a user reads of a run watching a metric other than accuracy: the progress
line, the closing summary (its `best` rounded), the plots (file name, axis labels,
virtual time for a simulated run), `hetps compare` tables (labelled by metric, with
the evaluation interval the times are quantized to) and the config keys that set
the target and the watched metric."""

from __future__ import annotations

import json
import math

import matplotlib.axes
import pytest

from hetps.frontend.compare import aggregate, markdown, milestone_times
from hetps.frontend.plots import eval_curve, first_reach, plot_compare, plot_run, run_title
from hetps.frontend.report import Progress, format_summary
from hetps.runconfig.load import config_from_dict, dump_config, load_config
from hetps.runconfig.schema import ConfigError
from hetps.runconfig.targets import TASK_METRICS

LM = {"perplexity": False, "token_accuracy": True, "loss": False}


def lm_row(t: float, perplexity: float, steps: int) -> dict:
    """A metrics.jsonl eval row as the scheduler writes it for a language model."""
    return {
        "kind": "eval",
        "perplexity": perplexity,
        "token_accuracy": 0.4,
        "loss": math.log(perplexity),
        "watch": "perplexity",
        "higher_is_better": False,
        "t": t,
        "global_steps": steps,
        "global_samples": steps * 8,
        "final": False,
        "bytes": steps * 1000,
    }


def lm_summary(**more) -> dict:
    return {
        "name": "lm",
        "algorithm": "sync",
        "status": "completed",
        "final_accuracy": None,
        "best_accuracy": None,
        "target_accuracy": None,
        "metric": {"name": "perplexity", "higher_is_better": False},
        "final_metrics": {"perplexity": 2.91234, "token_accuracy": 0.4, "loss": 1.07},
        "best": 2.91234,
        "target": {"metric": "perplexity", "value": 3.0},
        "time_to_target_s": 6.0,
        "global_steps": 300,
        "wall_s": 6.5,
        "stop_reason": "target perplexity 3.0 reached (2.9123)",
        "per_node": {"worker0": {}, "worker1": {}},
        **more,
    }


def lm_run(tmp_path, name="lm", **summary) -> object:
    run_dir = tmp_path / name
    run_dir.mkdir()
    rows = [lm_row(2.0, 40.0, 100), lm_row(4.0, 3.5, 200), lm_row(6.0, 2.91234, 300)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "summary.json").write_text(json.dumps(lm_summary(**summary)))
    return run_dir


@pytest.fixture
def axis_labels(monkeypatch):
    """Every xlabel/ylabel the plots set, in order (Axes.set still draws them)."""
    seen: list[dict] = []
    real = matplotlib.axes.Axes.set

    def spy(self, **kwargs):
        seen.append({k: v for k, v in kwargs.items() if k in ("xlabel", "ylabel")})
        return real(self, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "set", spy)
    return seen


def test_the_progress_line_shows_the_watched_metric_by_name(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [
        {"kind": "plan", "t": 0.01, "plan_id": 1, "groups": [[3, 4]]},
        {"kind": "step", "t": 1.5, "worker": 0, "step": 40, "loss": 2.0},
        lm_row(2.0, 7.9, 40),
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    progress = Progress(path, expected=["worker0"], target=3.0, max_seconds=60)
    progress.poll()
    line = progress.line()
    assert "test perplexity 7.9000 (target 3.0)" in line, line
    assert progress.accuracy is None and (progress.metric, progress.value) == ("perplexity", 7.9)


def test_the_closing_summary_rounds_best_and_names_the_metric(tmp_path):
    """issue 28: `best 0.9554317548746518` was printed as the float came."""
    classification = {
        "algorithm": "sync",
        "status": "completed",
        "final_accuracy": 0.9554317548746518,
        "best_accuracy": 0.9554317548746518,
        "time_to_target_s": 3.14,
        "global_steps": 900,
        "wall_s": 3.5,
        "stop_reason": "target accuracy 0.95 reached (0.9554)",
    }
    text = format_summary(classification, tmp_path)
    assert "final accuracy 0.9554, best 0.9554, time to target 3.1s" in text, text
    text = format_summary(lm_summary(), tmp_path)
    assert "final perplexity 2.9123, best 2.9123, time to target 6.0s" in text, text


def test_plots_of_a_perplexity_run_are_named_and_labelled_by_it(tmp_path, axis_labels):
    run_dir = lm_run(tmp_path)
    assert plot_run(run_dir) == run_dir / "perplexity_vs_time.png"
    assert (run_dir / "perplexity_vs_time.png").stat().st_size > 0
    assert not (run_dir / "accuracy_vs_time.png").exists()
    assert {"xlabel": "wall-clock time since the first plan (s)", "ylabel": "test perplexity"} in (
        axis_labels
    )
    assert eval_curve(json_rows(run_dir), "steps") == ([100.0, 200.0, 300.0], [40.0, 3.5, 2.91234])
    # lower is better: the target is reached at the first evaluation at or below it
    assert first_reach([2.0, 4.0, 6.0], [40.0, 3.5, 2.9], 3.0, higher_is_better=False) == (6.0, 2.9)
    assert first_reach([2.0, 4.0], [0.5, 0.96], 0.95) == (4.0, 0.96)
    assert run_title(lm_summary()) == (
        "lm: sync, 2 workers: perplexity 3 reached at 6.0 s, final perplexity 2.9123"
    )


def test_a_simulated_run_is_plotted_against_virtual_time(tmp_path, axis_labels):
    """issue 28: a simulated run's plots said wall-clock time for virtual seconds."""
    run_dir = lm_run(tmp_path, simulation={"real_wall_s": 1.2})
    plot_run(run_dir)
    xlabels = [s["xlabel"] for s in axis_labels if "xlabel" in s]
    assert xlabels and all(x == "virtual time since the first plan (s)" for x in xlabels), xlabels
    axis_labels.clear()
    plot_compare([{"algorithm": "sync", "runs": [str(run_dir)]}], tmp_path, "time")
    assert {"xlabel": "virtual time (s)", "ylabel": "test perplexity"} in axis_labels


def json_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_compare_tables_name_the_metric_and_say_times_are_quantized(tmp_path):
    """issue 28: sync and grouping both "2.1 s" at eval.every_s 1.0, with nothing saying why."""
    summaries = [{**lm_summary(), "bytes_sent": 1, "bytes_received": 1, "shard_versions": {}}]
    row = {**aggregate("sync", [{**summaries[0], "run_dir": "x"}]), "eval_every_s": 1.0}
    assert (row["metric"], row["final_metric"]) == ("perplexity", 2.91234)
    text = markdown([row], "lm.yaml")
    assert "| final perplexity (median, model.safetensors) |" in text and "| 2.9123 |" in text
    assert "quantized to the evaluation interval (eval.every_s: 1 s)" in text
    # the milestones of a lower-is-better metric: the first evaluation at or below each
    assert milestone_times(lm_run(tmp_path), [5.0, 3.0, 2.0]) == {"5": 4.0, "3": 6.0, "2": None}


def test_the_tensorboard_tags_are_the_metrics_names(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hetps.scheduler.tensorboard import TensorBoardSink

    sink = TensorBoardSink(tmp_path)
    values = lm_row(2.0, 7.9, 40)
    del values["kind"]
    sink.record("eval", values)
    sink.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {"eval/perplexity", "eval/token_accuracy", "eval/loss"}
    assert events.Scalars("eval/perplexity")[0].value == pytest.approx(7.9)


# ---------------------------------------------------------------- the config keys


def test_stop_target_replaces_the_accuracy_shorthand_and_both_are_an_error(tmp_path):
    cfg = load_config(None, ["stop.target={metric: loss, value: 0.2}", "stop.target_patience=3"])
    assert (cfg.stop.target.metric, cfg.stop.target.value) == ("loss", 0.2)
    assert cfg.stop.target_accuracy is None  # the shorthand's default gives way
    # the resolved config a run directory keeps loads back to the same targets
    dump_config(cfg, tmp_path / "config.yaml")
    assert load_config(str(tmp_path / "config.yaml")).stop == cfg.stop
    default = load_config(None, [])
    dump_config(default, tmp_path / "default.yaml")
    assert load_config(str(tmp_path / "default.yaml")).stop.target_accuracy == 0.95
    with pytest.raises(ConfigError, match="stop.target_accuracy: set stop.target or its"):
        load_config(None, ["stop.target={metric: loss, value: 0.2}", "stop.target_accuracy=0.9"])


@pytest.mark.parametrize(
    "raw, named",
    [
        (
            {"stop": {"target": {"metric": "acuracy", "value": 0.9}}},
            "stop.target.metric: 'acuracy'",
        ),
        ({"stop": {"target": {"metric": "loss"}}}, "stop.target.value: required"),
        ({"stop": {"target": {"metric": "loss", "value": math.nan}}}, "stop.target.value: must be"),
        ({"eval": {"metric": "perplexity"}}, "eval.metric: 'perplexity' is not a metric"),
        (
            {"task": "language_model", "stop": {"target_accuracy": 0.9}},
            "stop.target_accuracy: task language_model has no accuracy metric",
        ),
        (
            {
                "task": {"name": "regression"},
                "stop": {"target": {"metric": "perplexity", "value": 1}},
            },
            "allowed: r2, mse, mae, loss",
        ),
    ],
)
def test_a_bad_target_or_watched_metric_names_the_key(raw, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        config_from_dict(raw)


def test_the_accuracy_default_is_classifications_only():
    assert config_from_dict({"task": "language_model"}).stop.target_accuracy is None
    lm = config_from_dict(
        {"task": "language_model", "stop": {"target": {"metric": "perplexity", "value": 3.0}}}
    )
    assert (lm.stop.target.metric, lm.stop.target_accuracy) == ("perplexity", None)
    assert config_from_dict({"task": "classification"}).stop.target_accuracy == 0.95


def test_the_config_knows_the_built_in_tasks_metrics_as_the_tasks_name_them():
    """runconfig cannot import worker/ (a lower layer): its copy of the built-in tasks'
    metric names and directions must be theirs."""
    tasks = pytest.importorskip("hetps.training.task")
    built = {name: make() for name, make in tasks.BUILTIN.items()}
    assert {
        name: {m.name: m.higher_is_better for m in task.metrics} for name, task in built.items()
    } == {name: dict(metrics) for name, metrics in TASK_METRICS.items()}
    assert [list(m)[0] for m in TASK_METRICS.values()] == [
        built[name].metrics[0].name for name in TASK_METRICS
    ]


def test_the_progress_line_and_the_run_plot_show_the_shards_lr(tmp_path, monkeypatch):
    """An evaluation row's `lr` (the shards' lr when they sent the values measured) is on
    the progress line and drawn on a second axis of the loss plot; a row without one (model
    averaging) draws none."""
    path = tmp_path / "metrics.jsonl"
    rows = [
        {"kind": "plan", "t": 0.01, "plan_id": 1, "groups": [[3, 4]]},
        {**lm_row(2.0, 7.9, 40), "lr": 0.0125},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    progress = Progress(path, expected=["worker0"], target=3.0, max_seconds=60)
    progress.poll()
    assert "(target 3.0)  lr 0.0125" in progress.line(), progress.line()
    drawn: list[list[float]] = []
    real = matplotlib.axes.Axes.step

    def spy(self, x, y, *args, **kwargs):
        drawn.append(list(y))
        return real(self, x, y, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "step", spy)
    for lr in (None, 0.05):
        run_dir = tmp_path / f"run-{lr}"
        run_dir.mkdir()
        evals = [lm_row(2.0, 40.0, 100), lm_row(4.0, 3.5, 200)]
        evals = [{**r, "lr": lr} if lr else r for r in evals]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
        (run_dir / "summary.json").write_text(json.dumps(lm_summary()))
        plot_run(run_dir)
    assert drawn == [[0.05, 0.05]]
