"""Settings that cannot work are refused at the start, by real processes,
naming the setting: `hetps run` exits 2 before training (or before starting
anything), a daemon started by hand exits 2; and when the scheduler exits
before it binds, `hetps run` quotes the scheduler's own error."""

from __future__ import annotations

import os
import subprocess
import sys

from cluster_util import HETPS, REPO, run_hetps

from hetps.frontend.launcher import Child, exited_before_binding

# an MLP with a 784 x 2048 float32 layer: one tensor of 6,422,528 bytes, never cut into parts
# (the default cuts it, which lowers the bound: tests/unit/test_message_bytes.py)
WIDE_MLP = ["model.name=mlp", "model.kwargs={hidden: [2048]}", "cluster.chunk_bytes=0"]
TOO_SMALL = "cluster.max_message_bytes=2000000"  # above the 1 MiB floor, below the tensor
NAMED = (
    "cluster.max_message_bytes: must be at least 6422528 for model 'mlp' on 2 shards, got 2000000"
)


def daemon(args: list[str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`hetps ROLE ARGS` as a user starts it by hand, with no keys from the environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("HETPS_KEYS_DIR", "HETPS_CLIENT_KEY")}
    return subprocess.run(
        [*HETPS, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s, env=env
    )


def test_run_refuses_a_max_message_bytes_below_the_model_before_training(run_dir):
    result = run_hetps(
        ["run", "configs/sync.yaml", *WIDE_MLP, TOO_SMALL, "--out", str(run_dir), "--quiet"],
        timeout_s=180,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hetps: config error: {NAMED}: "), lines
    assert "1.weight" in lines[0]
    assert not (run_dir / "plan.json").exists()  # stopped before any plan: nothing trained


def test_a_worker_refuses_a_max_message_bytes_below_the_model_before_it_registers(tmp_path):
    # no scheduler listens there: the worker checks the model before it registers
    nobody = f"ipc://{tmp_path}/nobody"
    result = daemon(
        [
            "worker",
            "--config",
            "configs/sync.yaml",
            "--scheduler",
            nobody,
            *WIDE_MLP,
            TOO_SMALL,
            "cluster.startup_timeout_s=2",  # how long it tries to report the failure
        ]
    )
    assert result.returncode == 2, result.stderr
    assert NAMED in result.stderr, result.stderr


def test_run_refuses_a_missing_keys_dir_before_starting_anything(run_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("HETPS_KEYS_DIR", raising=False)
    missing = tmp_path / "nowhere" / "keys"
    result = run_hetps(
        [
            "run",
            "configs/sync.yaml",
            "security.curve=true",
            f"security.keys_dir={missing}",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"hetps run: config error: security.keys_dir: {missing} does not exist "
        f"(make it with `hetps keys {missing}`)"
    ], result.stderr
    assert not run_dir.exists()  # no process started, no run directory made


def test_daemons_given_a_missing_keys_dir_exit_2_naming_it(tmp_path):
    missing = tmp_path / "nowhere"
    curve = ["security.curve=true", f"security.keys_dir={missing}"]
    scheduler = ["--scheduler", f"ipc://{tmp_path}/nobody"]
    for role, flags in (("scheduler", []), ("ps", scheduler), ("worker", scheduler)):
        result = daemon([role, "--config", "configs/sync.yaml", *flags, *curve])
        assert result.returncode == 2, f"{role}: {result.returncode}\n{result.stderr}"
        assert result.stderr.strip().splitlines() == [
            f"hetps {role}: config error: security.keys_dir: {missing} does not exist "
            f"(make it with `hetps keys {missing}`)"
        ], result.stderr


def test_a_scheduler_that_cannot_bind_is_quoted_on_the_first_line(run_dir):
    # 192.0.2.1 (TEST-NET-1) is never an address of this host: the bind fails at once
    result = run_hetps(
        [
            "run",
            "configs/sync.yaml",
            "comm.local_transport=tcp",
            "cluster.scheduler=tcp://192.0.2.1:0",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=120,
    )
    assert result.returncode == 1, result.stderr
    first = result.stderr.strip().splitlines()[0]
    assert first.startswith(
        "hetps run: scheduler exited with 1 before binding: hetps scheduler: cannot bind "
        "tcp://192.0.2.1:0"
    ), result.stderr


def test_a_silent_exit_before_binding_says_so(tmp_path):
    log = tmp_path / "scheduler.log"
    log.write_text("\n")
    killed = subprocess.Popen(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    )
    killed.wait(timeout=60)
    assert exited_before_binding(Child("scheduler", killed, log)) == (
        f"scheduler was killed by SIGKILL before binding and wrote nothing to {log}"
    )
    log.write_text("starting\nhetps scheduler: it went wrong\n")
    assert exited_before_binding(Child("scheduler", killed, log)) == (
        f"scheduler was killed by SIGKILL before binding: hetps scheduler: it went wrong\n"
        f"earlier in {log}:\nstarting"
    )
