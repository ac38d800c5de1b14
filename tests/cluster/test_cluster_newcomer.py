"""A newcomer's run on real processes (issue 42): `hetps run` with the user's task and model
in a module beside the config, run from another folder with no PYTHONPATH. Every process
imports it (forked daemons and, with HETPS_SPAWN=exec, exec'd ones), the run watches the
task's primary metric (macro_f1, no accuracy target), and the check's log carries no
runpy warning. The config checks themselves: tests/unit/test_newcomer_checks.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from newcomer_module import MYTASK, SINE_YAML

HETPS = Path(sys.executable).with_name("hetps")  # the console script a user runs
# one worker: every role (scheduler, shard, worker, evaluator) still imports the module, one
# process fewer to start (exec'd: a torch import, ~3 s of CPU)
SMALL = [
    "cluster.workers=1",
    "stop.max_steps=40",
    "stop.max_seconds=60",
    "eval.every_s=0.5",
    "data.batch_size=16",
]


@pytest.mark.own_fork_server  # the daemons are forked (or exec'd) as a user's `hetps run` does
@pytest.mark.parametrize("spawn", ["fork", "exec"])
def test_a_run_imports_the_module_beside_its_config_and_watches_the_task_s_metric(
    tmp_path, run_dir, spawn
):
    if not HETPS.exists():
        pytest.skip(f"no console script {HETPS} (not an installed environment)")
    folder = tmp_path / "sine"
    folder.mkdir()
    (folder / "mytask.py").write_text(MYTASK)
    (folder / "sine.yaml").write_text(SINE_YAML)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen(
        [str(HETPS), "run", str(folder / "sine.yaml"), *SMALL, "--out", str(run_dir), "--quiet"],
        cwd=tmp_path,
        env={**env, "HETPS_SPAWN": spawn},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"hetps run ran past 240 s\n{err[-3000:]}") from None
    assert proc.returncode == 0, err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    assert summary["metric"]["name"] == "macro_f1", summary["metric"]
    assert summary["target"] is None and summary["stop_reason"] != "target", summary
    check = (run_dir / "logs" / "check.log").read_text()
    assert "check ok" in check and "Warning" not in check, check
