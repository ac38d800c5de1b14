"""The callbacks of `hetps.run` beside on_eval: on_step (the step records of every worker's
steps numbered a multiple of step_every, in metrics.jsonl's order with the evaluations),
and on_end (the Result, once). The lr an evaluation row carries is the shards' (PARAMS' `lr`):
tests/inproc/test_schedule_clock.py."""

from __future__ import annotations

import json
import types

from hetps.running import Callbacks, EvalRows, read_result


def write(path, *records):
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def step(worker, n):
    return {"kind": "step", "t": n / 10, "worker": worker, "step": n, "loss": 1.0 / n}


def test_on_step_gets_each_workers_every_nth_step_in_order_with_the_evaluations(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write(path, *(step(w, n) for n in range(1, 7) for w in (0, 1)))
    write(path, {"kind": "eval", "t": 0.65, "accuracy": 0.5}, step(0, 7), step(0, 8))
    seen = []
    callbacks = Callbacks(
        EvalRows(path, step_every=3),
        lambda row: seen.append(("eval", row["t"])),
        None,
        on_step=lambda rec: seen.append((rec["worker"], rec["step"])),
    )
    callbacks(None)
    assert seen == [(0, 3), (1, 3), (0, 6), (1, 6), ("eval", 0.65)]
    write(path, step(0, 9), step(1, 9))
    callbacks(None)
    assert seen[5:] == [(0, 9), (1, 9)]
    # the evaluation rows are kept for the Result; the step records are not
    assert [r["kind"] for r in callbacks.rows.rows] == ["eval"]


def test_without_on_step_no_step_record_is_handed_out(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write(path, step(0, 50), {"kind": "eval", "t": 1.0})
    assert [r["kind"] for r in EvalRows(path).poll_records()] == ["eval"]


def test_an_exception_in_on_step_stops_the_run_and_on_end_still_gets_the_result(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write(path, step(0, 1), step(0, 2), {"kind": "eval", "t": 1.0, "accuracy": 0.4})
    (tmp_path / "summary.json").write_text('{"status": "interrupted", "global_steps": 2}')
    stops, evals, ended = [], [], []

    def on_step(rec):
        raise ValueError(f"at {rec['step']}")

    callbacks = Callbacks(EvalRows(path, 1), evals.append, None, on_step, ended.append)
    callbacks(types.SimpleNamespace(stop=lambda: stops.append(1)))
    # the first step record raised: the run is asked to stop, nothing else is called
    assert stops == [1] and evals == [] and str(callbacks.error) == "at 1"
    result = read_result(tmp_path, 130, callbacks.rows.rows)
    callbacks.end(result)
    assert ended == [result] and result.status == "interrupted"
    assert str(callbacks.error) == "at 1"  # the first error is the one raised


def test_an_exception_in_on_end_is_kept_to_be_raised(tmp_path):
    def on_end(result):
        raise RuntimeError("logger closed")

    callbacks = Callbacks(EvalRows(tmp_path / "metrics.jsonl"), None, None, on_end=on_end)
    callbacks.end(read_result(tmp_path, 0, []))
    assert isinstance(callbacks.error, RuntimeError)


def test_the_lr_of_a_row_is_no_metric_of_the_result(tmp_path):
    (tmp_path / "summary.json").write_text(
        '{"status": "completed", "final_metrics": {"macro_f1": 0.9, "lr": 0.01}}'
    )
    row = {"kind": "eval", "t": 1.0, "macro_f1": 0.9, "lr": 0.01, "watch": "macro_f1"}
    assert read_result(tmp_path, 0, [row]).metrics == {"macro_f1": 0.9}
    (tmp_path / "summary.json").write_text('{"status": "completed"}')
    assert read_result(tmp_path, 0, [row]).metrics == {"macro_f1": 0.9}
