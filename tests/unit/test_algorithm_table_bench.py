"""bench/algorithm_table.py without running anything: its --entry parsing, the
compare command lines it builds, and its table from synthetic compare folders."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "algorithm_table.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("algorithm_table", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


at = load_bench()


def fake_piece(piece: Path, label: str, ttt: float | None, status: str = "completed") -> Path:
    """A compare folder as `hetps compare --repeats 1` leaves it: compare.json naming the
    run, whose summary.json has the status."""
    run_dir = piece / f"{label}-0"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"status": status, "time_to_target_s": ttt}))
    row = {
        "time_to_target_s": ttt,
        "metric": "accuracy",
        "best_metric": 0.9,
        "runs": [str(run_dir)],
    }
    (piece / "compare.json").write_text(json.dumps([row]))
    return piece


def test_an_entry_is_label_algorithm_and_overrides():
    assert at.parse_entry("grouping-pg:grouping:algorithm.optimizer_state=per_group") == at.Entry(
        "grouping-pg", "grouping", ("algorithm.optimizer_state=per_group",)
    )
    both = at.parse_entry("g:grouping:algorithm.groups=2; cluster.workers={count: 8}")
    assert both.overrides == ("algorithm.groups=2", "cluster.workers={count: 8}")
    assert at.parse_entry("s:sync") == at.Entry("s", "sync")


@pytest.mark.parametrize("text", ["grouping", "g:", "a,b:sync", "g:grouping:nokey"])
def test_a_malformed_entry_is_refused(text):
    with pytest.raises(ValueError, match="--entry"):
        at.parse_entry(text)


def test_entries_and_tasks_are_selected_by_name_in_the_order_given():
    assert [e.label for e in at.select(at.ENTRIES, "diloco,sync", "--only-entries")] == [
        "diloco",
        "sync",
    ]
    assert len({t.name for t in at.TASKS}) == len(at.TASKS)
    with pytest.raises(ValueError, match="'nope' is not one of"):
        at.select(at.TASKS, "nope", "--tasks")


def test_the_compare_line_carries_the_entry_the_task_and_the_seed(tmp_path):
    task = at.select(at.TASKS, "mnist-64-sim-free", "--tasks")[0]
    entry = at.select(at.ENTRIES, "grouping-mc", "--only-entries")[0]
    argv = at.compare_argv(task, entry, 2, tmp_path, ["comm.aggregate=off"])
    assert argv[1:5] == ["compare", "configs/default.yaml", "--algorithms", "grouping-mc:grouping"]
    assert "--simulate" in argv and "sim.shard_message_s=0" in argv
    i = argv.index("--with")
    assert argv[i : i + 3] == ["--with", "grouping-mc", "algorithm.momentum_correction=true"]
    assert argv[-2:] == ["comm.aggregate=off", "seed=2"]


def test_a_cell_counts_a_never_reached_seed_as_infinitely_late(tmp_path):
    runs = [
        at.read_piece(fake_piece(tmp_path / "a", "g", 2.0), 0, ""),
        at.read_piece(fake_piece(tmp_path / "b", "g", None, "diverged"), 0, ""),
        at.read_piece(fake_piece(tmp_path / "c", "g", 1.0), 0, ""),
    ]
    c = at.cell(runs)
    assert (c["median_s"], c["reached"], c["diverged"], c["never_reached"]) == (2.0, 2, 1, 0)
    assert at._time(c) == "2.00 (2/3)"
    nan = at.read_piece(tmp_path / "d", 1, "RuntimeError: tensor 'w' holds NaN or Inf")
    never = at.read_piece(fake_piece(tmp_path / "e", "g", None), 0, "")
    c = at.cell([nan, never, runs[2]])
    assert (c["median_s"], c["diverged"], c["never_reached"]) == (None, 1, 1)
    assert at._time(c) == "- (1/3)"


def test_the_table_gives_each_entry_its_ratio_to_sync_and_the_criterion(tmp_path):
    tasks = at.select(at.TASKS, "mnist-64-sim-free,regression-4-sim", "--tasks")
    entries = at.select(at.ENTRIES, "sync,grouping", "--only-entries")
    times = {("mnist-64-sim-free", "sync"): 3.0, ("mnist-64-sim-free", "grouping"): 1.5}
    times |= {("regression-4-sim", "sync"): 0.06, ("regression-4-sim", "grouping"): 0.08}
    results = {
        key: [
            {**at.read_piece(fake_piece(tmp_path / "-".join(key), key[1], t), 0, ""), "real_s": 4}
        ]
        for key, t in times.items()
    }
    rows = at.build_rows(tasks, entries, results)
    assert rows[0]["cells"]["grouping"]["ratio_to_reference"] == 0.5
    header = {"date": "2026-12-02", "machine": "m", "commit": "c", "command": "x", "seeds": [0]}
    text = at.markdown(rows, entries, header)
    assert "| mnist-5k, 64 sim, free shard (virtual s) | 3.00 | 1.50 |" in text
    assert "| regression, 4 sim | 1.00 | 1.33 |" in text
    assert "free shard: grouping at least 1.5x sooner than sync? yes: 2.00x sooner" in text
    assert "regression, 4 sim: grouping at least 1x sooner than sync? no: 0.75x sooner" in text


def test_a_config_error_is_the_cells_n_a():
    results = [{"status": at.CONFIG_ERROR, "error": "algorithm.nope: unknown key"}]
    c = at.cell(results)
    assert at._time(c) == "n/a" and at._outcomes(c) == "n/a"
    log = "hetps.sim.engine.SimulationError: sparse.tables: algorithm 'diloco' takes local steps"
    refused = at.read_piece(Path("/nonexistent"), 1, log)
    assert refused["status"] == at.UNSUPPORTED
    assert at._time(at.cell([refused])) == "n/a"
