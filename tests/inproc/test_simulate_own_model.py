"""`hetps simulate` on the user's own model, through the real command (a
subprocess, for the measured run three tests read; the others call the command's
entry point, `hetps.frontend.cli.main`, in this process with the same argv and
folder): the workers' compute per sample measured on this machine with
that model unless the config sets `sim.sample_s` (one line says which), a
progress line, the trained model written to the run directory, and
`--replay RUN_DIR --workers N` appending workers of the measured speeds.

No wall-clock assertion: a measured sample_s varies from machine to
machine; the tests check where it came from and that the run used it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from inprocess_cli import run_entry_point

import hetps
from hetps.frontend.cli import main as hetps_main
from hetps.frontend.sample_cost import LENET5_SAMPLE_S
from hetps.runconfig.load import load_config
from hetps.scheduler.runlog import read_metrics, records_of
from hetps.sim.engine import simulate

ROOT = Path(__file__).resolve().parents[2]
BATCH = 16
# a linear model: far cheaper per sample than LeNet-5, on any machine
MODULE = """\
import math
from torch import nn


def build(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))
"""
CONFIG = {
    "model": {"name": "tinynet:build"},
    "data": {"dataset": "mnist-5k", "batch_size": BATCH},
    "algorithm": {"name": "async"},
    "optimizer": {"lr": 0.05},
    "cluster": {
        "shards": [{"slowdown": 1}],
        "workers": [{"slowdown": 1}, {"slowdown": 2}],
        "heartbeat_s": 0.05,
    },
    "stop": {"target_accuracy": None, "max_seconds": 0.2},
    "eval": {"every_s": 0.1},
}


def hetps_simulate(folder: Path, *args: str) -> subprocess.CompletedProcess:
    """`hetps simulate ARGS` in `folder` (the user's module beside the config)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-m", "hetps.frontend.cli", "simulate", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def hetps_in_process(folder: Path, *args: str) -> subprocess.CompletedProcess:
    """`hetps ARGS` (`hetps_simulate`'s, with the command named) in this process, from `folder`
    with it first on the import path (support/inprocess_cli.py)."""
    return run_entry_point(hetps_main, list(args), folder, [str(folder), *sys.path])


@pytest.fixture(scope="module")
def own_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("own")
    (folder / "tinynet.py").write_text(MODULE)
    (folder / "tiny.yaml").write_text(yaml.safe_dump(CONFIG))
    return folder


@pytest.fixture(scope="module")
def measured(own_model):
    """A simulation of the user's model whose config does not set sim.sample_s."""
    done = hetps_simulate(own_model, "tiny.yaml", "--out", "measured")
    assert done.returncode == 0, done.stderr
    return done, own_model / "measured"


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_sample_s_is_measured_on_the_users_model_and_used(measured):
    done, run_dir = measured
    line = next(line for line in done.stderr.splitlines() if "sim.sample_s" in line)
    assert "measured on this machine" in line and "'tinynet:build'" in line
    simulation = summary_of(run_dir)["simulation"]
    assert simulation["sample_s_from"] == "measured"
    sample_s = simulation["sample_s"]
    assert sample_s != LENET5_SAMPLE_S
    assert f"{sample_s:.4g}" in line
    # the config the run wrote is the one it ran: its sample_s is the measured one
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["sim"]["sample_s"] == sample_s
    # the workers' virtual compute is that sample_s x the batch x their slowdown
    steps = records_of(read_metrics(run_dir / "metrics.jsonl"), "step")
    for rank, slowdown in ((0, 1), (1, 2)):
        compute = [s["compute_s"] for s in steps if s["worker"] == rank]
        assert compute == [pytest.approx(sample_s * BATCH * slowdown, abs=1e-5)] * len(compute)


def test_a_sample_s_the_config_sets_is_used_and_named(own_model):
    done = hetps_in_process(
        own_model, "simulate", "tiny.yaml", "sim.sample_s=0.0002", "--out", "given"
    )
    assert done.returncode == 0, done.stderr
    assert "sim.sample_s 0.0002 s per sample (LeNet-5's figure), from the config" in done.stderr
    assert "measured" not in done.stderr
    simulation = summary_of(own_model / "given")["simulation"]
    assert (simulation["sample_s"], simulation["sample_s_from"]) == (0.0002, "config")


def test_a_progress_line_shows_virtual_time_steps_and_the_last_evaluation(measured):
    done, run_dir = measured
    lines = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert lines, done.stderr
    last = re.match(r"\[\s*([\d.]+)s/0\.2s\] steps\s+(\d+)\s+test acc (\S+)", lines[-1])
    assert last is not None, lines[-1]
    summary = summary_of(run_dir)
    assert float(last[1]) == pytest.approx(0.2)
    assert int(last[2]) > 0
    assert float(last[3]) == pytest.approx(summary["final_accuracy"], abs=1e-4)


def test_the_simulation_writes_the_model_it_trained(measured):
    done, run_dir = measured
    assert "(model: model.safetensors)" in done.stdout
    described = json.loads((run_dir / "model.json").read_text())
    assert described["source"] == "simulator" and described["evaluation"] == "final"
    summary = summary_of(run_dir)
    assert described["metrics"]["accuracy"] == summary["final_accuracy"]
    assert described["versions"] == [summary["shard_versions"]["ps0"]]
    sys.path.insert(0, str(run_dir.parent))  # the user's module, as the run imported it
    try:
        model = hetps.load_model(run_dir)
        best = hetps.load_model(run_dir, best=True)
    finally:
        sys.path.remove(str(run_dir.parent))
    assert isinstance(model, torch.nn.Sequential)
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert json.loads((run_dir / "best.json").read_text())["evaluation"] == "best"
    assert best(torch.zeros(1, 1, 28, 28)).shape == (1, 10)


def test_replay_workers_appends_workers_of_the_measured_speeds(own_model, tmp_path):
    given = tmp_path / "given"  # a run whose workers' costs are known: 4 ms and 12 ms a step
    simulate(
        load_config(
            None,
            [
                "data.batch_size=16",
                "stop.target_accuracy=null",
                "stop.max_seconds=0.3",
                "eval.every_s=0.1",
                "algorithm.name=async",
                "cluster.workers=[{step_s: 0.004, latency_ms: 1}, {step_s: 0.012, latency_ms: 1}]",
            ],
        ),
        given,
    )
    out = tmp_path / "five"
    done = hetps_in_process(
        own_model,
        "simulate",
        "tiny.yaml",
        "--replay",
        str(given),
        "--workers",
        "5",
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert "simulating 5 workers" in done.stderr and "replace cluster.workers" in done.stderr
    assert "sim.sample_s not used" in done.stderr  # every worker has its step_s: nothing measured
    workers = yaml.safe_load((out / "config.yaml").read_text())["cluster"]["workers"]
    assert [w["step_s"] for w in workers] == pytest.approx([0.004, 0.012] * 2 + [0.004], rel=0.01)
    steps = records_of(read_metrics(out / "metrics.jsonl"), "step")
    assert {s["worker"] for s in steps} == set(range(5))
    for rank in range(5):
        compute = [s["compute_s"] for s in steps if s["worker"] == rank]
        assert compute == [pytest.approx(0.004 if rank % 2 == 0 else 0.012, rel=0.01)] * len(
            compute
        )
    assert summary_of(out)["simulation"]["sample_s_from"] == "unused"


def test_workers_without_replay_is_refused(own_model):
    done = hetps_in_process(own_model, "simulate", "tiny.yaml", "--workers", "3")
    assert done.returncode == 2 and "--workers N (N >= 1) goes with --replay" in done.stderr


def test_help_says_replay_replaces_the_workers_and_how_to_add_more(own_model):
    done = hetps_in_process(own_model, "simulate", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "It REPLACES cluster.workers" in text
    assert "--workers N for more workers of the measured speeds" in text
    assert "unless the config sets it, it is measured first on this machine" in text


def test_compare_simulate_measures_once_and_runs_every_entry_with_that_figure(own_model):
    done = hetps_in_process(
        own_model,
        *["compare", "tiny.yaml", "--simulate"],
        *["--algorithms", "sync,async", "--out", "compared", "stop.max_seconds=0.1"],
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "sim.sample_s" in line]
    assert len(lines) == 1 and "measured on this machine" in lines[0], lines
    figures = {
        yaml.safe_load((own_model / "compared" / f"{a}-0" / "config.yaml").read_text())["sim"][
            "sample_s"
        ]
        for a in ("sync", "async")
    }
    assert len(figures) == 1 and figures != {LENET5_SAMPLE_S}
    assert f"{figures.pop():.4g}" in lines[0]
