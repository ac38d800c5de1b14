"""The Python API's pure parts: `hetps.config` (a file, a dict or a RunConfig with changes),
the names `hetps.run` gives objects for the daemons (by reference, pickled, or refused),
and the evaluation rows it follows."""

from __future__ import annotations

import pickle
import sys
import types
from pathlib import Path

import pytest

import hetps
from hetps.make_config import assignments
from hetps.proto.errors import ConfigError
from hetps.running import Callbacks, EvalRows, read_result, row_metrics
from hetps.shipping import main_references, reference, task_setting, unpickled
from hetps.training.task import Classification

REPO = Path(__file__).resolve().parents[2]


def test_config_from_a_file_with_changes_in_order():
    cfg = hetps.config(
        REPO / "configs" / "default.yaml",
        "seed=3",
        algorithm="sync",
        stop__max_steps=200,
        stop={"target_patience": 2},
        **{"eval.every_s": 0.5},
    )
    assert (cfg.seed, cfg.algorithm.name, cfg.eval.every_s) == (3, "sync", 0.5)
    # a dict sets its keys and keeps the file's others
    assert (cfg.stop.max_steps, cfg.stop.target_patience, cfg.stop.max_seconds) == (200, 2, 240)


def test_config_from_a_dict_leaves_it_unchanged_and_from_a_config():
    raw = {"model": {"name": "mlp"}, "algorithm": {"name": "ssp", "staleness": 3}}
    cfg = hetps.config(raw, optimizer__lr=0.01)
    assert raw == {"model": {"name": "mlp"}, "algorithm": {"name": "ssp", "staleness": 3}}
    assert cfg.model.name == "mlp" and cfg.algorithm.params.staleness == 3
    # naming another algorithm drops ssp's own keys, as algorithm.name= on the command line
    again = hetps.config(cfg, algorithm="grouping", model={"kwargs": {"hidden": 64}})
    assert again.algorithm.name == "grouping" and again.optimizer.lr == 0.01
    assert again.model.kwargs == {"hidden": 64}


def test_config_reports_every_problem_naming_its_key():
    with pytest.raises(ConfigError) as caught:
        hetps.config({"stop": {"max_stepz": 1}}, optimizer__lr=-1)
    text = str(caught.value)
    assert "stop.max_stepz: unknown key" in text and "optimizer.lr: must be > 0" in text
    with pytest.raises(TypeError, match="path, a dict or a RunConfig"):
        hetps.config(42)


def test_assignments_are_command_line_overrides():
    assert assignments("stop", {"target": {"metric": "r2", "value": 0.9}}) == [
        'stop.target.metric="r2"',
        "stop.target.value=0.9",
    ]
    assert assignments("task", "regression") == ['task.name="regression"']
    assert assignments("task.kwargs", {"a": [1, 2]}) == ['task.kwargs={"a": [1, 2]}']


def factory():  # a module-level function: named by reference
    return Classification(10)


def test_classes_and_functions_are_named_by_reference():
    assert reference(factory, "the task") == f"{__name__}:factory"
    assert task_setting(Classification, Path("unused"))["name"] == (
        "hetps.training.task:Classification"
    )
    assert task_setting("language_model", Path("unused")) == {
        "name": "language_model",
        "kwargs": {},
    }


def test_what_another_process_cannot_import_is_refused_naming_the_fix(tmp_path, monkeypatch):
    in_main = type("InMain", (Classification,), {"__module__": "__main__"})
    with pytest.raises(ConfigError, match="defined in __main__.*module of its own"):
        task_setting(in_main(10), tmp_path)
    with pytest.raises(ConfigError, match="defined in __main__"):
        reference(in_main, "the model")

    def local():
        pass

    with pytest.raises(ConfigError, match="not at the top level"):
        reference(local, "the dataset")
    # an object holding a function of __main__ (it pickles here, and fails to load there)
    holder = Classification(10)
    holder.hook = types.FunctionType(factory.__code__, {}, "hook")
    holder.hook.__module__, holder.hook.__qualname__ = "__main__", "hook"
    monkeypatch.setattr(sys.modules["__main__"], "hook", holder.hook, raising=False)
    for protocol in (2, pickle.HIGHEST_PROTOCOL):  # GLOBAL, STACK_GLOBAL
        assert main_references(pickle.dumps(holder, protocol)) == ["hook"]
    with pytest.raises(ConfigError, match="what the task object holds: hook"):
        task_setting(holder, tmp_path)
    assert not (tmp_path / "task.pkl").exists()


def test_a_task_object_travels_pickled_with_its_state(tmp_path):
    task = Classification(7)
    task.extra = "state"
    setting = task_setting(task, tmp_path)
    assert setting["name"] == "hetps.shipping:unpickled"
    loaded = unpickled(**setting["kwargs"])
    assert type(loaded) is Classification and (loaded.num_classes, loaded.extra) == (7, "state")
    assert main_references(pickle.dumps(loaded)) == []


def test_eval_rows_are_taken_once_each_and_a_torn_line_waits(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = EvalRows(path)
    assert rows.poll() == []  # no file yet
    path.write_text('{"kind": "step", "t": 1}\n{"kind": "eval", "t": 1, "accuracy": 0.5}\n{"kin')
    assert [r["t"] for r in rows.poll()] == [1]
    with open(path, "a") as f:
        f.write('d": "eval", "t": 2, "accuracy": 0.7, "watch": "accuracy"}\n')
    assert [r["t"] for r in rows.poll()] == [2] and rows.poll() == []
    assert [r["t"] for r in rows.rows] == [1, 2]
    assert row_metrics(rows.rows[-1]) == {"accuracy": 0.7}


def test_an_exception_in_the_callback_stops_the_run_and_is_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "eval", "t": 1}\n{"kind": "eval", "t": 2}\n')
    seen, stops = [], []

    def on_eval(row):
        seen.append(row["t"])
        raise KeyboardInterrupt("pruned")

    cluster = types.SimpleNamespace(stop=lambda: stops.append(1))
    callbacks = Callbacks(EvalRows(path), on_eval, progress=None)
    callbacks(cluster)
    assert seen == [1] and stops == [1] and isinstance(callbacks.error, KeyboardInterrupt)


def test_a_result_reads_the_summary_and_falls_back_to_the_rows(tmp_path):
    (tmp_path / "summary.json").write_text(
        '{"status": "completed", "global_steps": 9, "target_accuracy": 0.9, "best_accuracy": 0.8}'
    )
    row = {"kind": "eval", "t": 1.0, "accuracy": 0.8, "loss": 0.5, "final": True}
    result = read_result(tmp_path, 0, [row])
    assert (result.metric, result.higher_is_better, result.value) == ("accuracy", True, 0.8)
    assert result.target == {"metric": "accuracy", "value": 0.9} and result.best == 0.8
    assert result.model_path is None and result.global_steps == 9
