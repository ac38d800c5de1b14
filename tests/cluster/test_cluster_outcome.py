"""`hetps run` tells what happened: a node that fails at start-up ends the
run at once, named, with a failed summary; a diverging run stops with exit
3 and a hint; TensorBoard event files (or a clear message without the
package). Real processes on loopback, the real mnist-5k digits."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
from cluster_util import (
    REPO,
    Daemons,
    background_run,
    log_tails,
    records,
    run_hetps,
    summary,
    wait_for,
)

pytestmark = pytest.mark.cluster

SMALL = ["cluster.workers=2", "cluster.shards=1", "cluster.profile_steps=2"]
FAILURE_WAIT_S = 10.0  # from a node's failure report to the end of the run, at most


def assert_failed_fast(s: dict, node: str, quoted: str) -> None:
    """summary.json of a run a node's start-up failure ended: named, quoted, and over
    within FAILURE_WAIT_S of the report (an upper bound; it takes well under a second)."""
    assert s["status"] == "failed" and s["failed_node"] == node, s
    assert quoted in s["detail"] and quoted in s["stop_reason"], s
    (failure,) = [f for f in s["failures"] if f["kind"] == "startup_failed"][:1]
    assert failure["node"] == node and failure["host"], failure
    assert s["wall_s"] - failure["t"] < FAILURE_WAIT_S, s
    assert s["global_steps"] == 0


def test_a_worker_without_its_device_ends_the_run_naming_it(run_dir):
    # cuda:99 exists on no machine: worker1 fails before it registers, the others wait for the plan
    result = run_hetps(
        [
            "run",
            "configs/sync.yaml",
            *SMALL,
            "cluster.workers.1.device=cuda:99",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=180,
    )
    assert result.returncode == 1, result.stderr + log_tails(run_dir)
    assert "worker1 failed" in result.stderr and "cuda:99" in result.stderr, result.stderr
    assert_failed_fast(summary(run_dir), "worker1", "cluster.workers.1.device: cuda:99")


def test_across_hosts_the_scheduler_itself_names_the_failed_worker(tmp_path):
    """The multi-host path: daemons started one by one; the failure travels as a message."""
    run_dir = tmp_path / "byhand"
    config = str(REPO / "configs" / "sync.yaml")
    # the cluster forms once worker1 registers or reports its failure: on a loaded machine ps0 and
    # worker0 alone can take 20 s to register (building, profiling)
    common = [*SMALL, "cluster.startup_timeout_s=90"]
    daemons = Daemons(tmp_path, [])
    try:
        daemons.start(
            [
                "scheduler",
                "--config",
                config,
                "--bind",
                "tcp://127.0.0.1:0",
                "--run-dir",
                str(run_dir),
                *common,
            ]
        )
        addr_file = run_dir / "scheduler.addr"
        addr = wait_for(
            lambda: addr_file.exists() and addr_file.read_text(), 60, "the scheduler address"
        )
        daemons.start(["ps", "--config", config, "--rank", "0", "--scheduler", addr, *common])
        daemons.start(["worker", "--config", config, "--rank", "0", "--scheduler", addr, *common])

        # the failing worker starts once the others registered: they are told at once, not left to
        # find the scheduler gone and wait out startup_timeout_s
        def registered() -> bool:
            return {r["node"] for r in records(run_dir, "register")} >= {"ps0", "worker0"}

        wait_for(
            lambda: (run_dir / "metrics.jsonl").exists() and registered(),
            60,
            "ps0 and worker0 registered",
        )
        daemons.start(
            [
                "worker",
                "--config",
                config,
                "--rank",
                "1",
                "--scheduler",
                addr,
                *common,
                # this host's own setting: a GPU it lacks
                "cluster.workers.1.device=cuda:99",
            ]
        )
        codes = daemons.wait(120)
    finally:
        daemons.close()
    assert codes[0] == 1 and codes[3] == 1, (codes, daemons.tails())
    assert_failed_fast(summary(run_dir), "worker1", "cuda:99")


def test_a_model_factory_that_raises_ends_the_run_quoting_it(run_dir, tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    # the factory fails on worker1's host only (the weights file is missing there), so the check
    # `hetps run` makes before starting the cluster passes and the failure comes at worker1's start-up
    (package / "brokenmodel.py").write_text(
        textwrap.dedent("""
        import sys
        from hetps.training.models import build_model
        from hetps.runconfig.schema import ModelConfig

        def make(**kwargs):
            argv = sys.argv
            if "--rank" in argv and argv[argv.index("--rank") + 1] == "1" and "--evaluator" not in argv:
                raise RuntimeError("cannot read weights from /nonexistent/lenet.pt")
            return build_model(ModelConfig(name="lenet5"), kwargs["input_shape"], kwargs["num_classes"])
    """)
    )
    result = run_hetps(
        [
            "run",
            "configs/sync.yaml",
            *SMALL,
            "model.name=brokenmodel:make",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=180,
        env={"PYTHONPATH": str(package)},
    )
    assert result.returncode == 1, result.stderr + log_tails(run_dir)
    s = summary(run_dir)
    assert_failed_fast(s, "worker1", "RuntimeError: cannot read weights from /nonexistent/lenet.pt")
    assert "brokenmodel.py" in s["detail"]  # where it was raised
    assert "worker1 failed" in result.stderr


def test_a_diverging_run_stops_with_exit_3_and_names_the_learning_rate(run_dir):
    every_s, after, warmup_s = 0.5, 3, 3.0
    stop_by_s = warmup_s + 3 * after * every_s + 5  # the latest stop allowed below
    # workers whose NaN pushes the shards refuse leave at once, saying why (BYE with the error): the
    # run stops as diverged whichever comes first, the evaluator's NaN loss or the last worker leaving
    result = run_hetps(
        [
            "run",
            "configs/async.yaml",
            *SMALL,
            "optimizer.lr=10000",
            "stop.max_seconds=120",
            f"eval.every_s={every_s}",
            f"stop.diverged_after={after}",
            f"stop.diverge_warmup_s={warmup_s}",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=240,
    )
    assert result.returncode == 3, result.stderr + log_tails(run_dir)
    s = summary(run_dir)
    assert s["status"] == "diverged" and s["stop_reason"] == "diverged", s
    assert "optimizer.lr" in s["detail"] and "10000" in s["detail"], s
    assert "optimizer.lr" in result.stderr
    # stopped by the guard within its window (the warm-up and `after` evaluations, which a loaded
    # machine may stretch up to 3x), long before the time limit
    (stop,) = records(run_dir, "stop")
    assert stop["reason"] == "diverged" and stop["t"] <= stop_by_s, stop
    # nobody waited for a silent worker to be declared dead (cluster.dead_after_s)
    assert not [f for f in s["failures"] if f["kind"] == "worker_dead"], s["failures"]
    assert s["wall_s"] <= stop_by_s + 5, s


def tensorboard_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # no purging: two evaluations at one global step (the final one, after the workers stopped) both stay
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_files_hold_the_run(run_dir):
    pytest.importorskip(
        "tensorboard",
        reason="tensorboard not installed (pip install 'hetps[tensorboard]'): "
        "the event files cannot be written or read",
    )
    result = run_hetps(
        [
            "run",
            "configs/sync.yaml",
            *SMALL,
            "stop.target_accuracy=0.9",
            "stop.max_seconds=120",
            "eval.every_s=1.0",
            "--tensorboard",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=240,
    )
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    evals = records(run_dir, "eval")
    # TensorBoard keeps float32: equal to metrics.jsonl's values to that precision
    assert [v for _, v in scalars["eval/accuracy"]] == pytest.approx(
        [e["accuracy"] for e in evals], abs=1e-6
    )
    assert [s for s, _ in scalars["eval/accuracy"]] == [e["global_steps"] for e in evals]
    steps = [r for r in records(run_dir, "step") if r["worker"] == 1]
    assert [v for _, v in scalars["worker1/loss"]] == pytest.approx(
        [r["loss"] for r in steps], abs=1e-5
    )
    assert [s for s, _ in scalars["worker1/loss"]] == [r["step"] for r in steps]
    assert {"worker0/step_s", "worker0/staleness", "eval/loss", "plan/groups"} <= set(scalars)


def test_tensorboard_without_the_package_is_one_clear_line(tmp_path):
    # the tensorboard package made unimportable in this process only: as on a machine without it
    code = (
        "import sys; sys.modules['tensorboard'] = None; from hetps.frontend.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    out = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "run",
            "configs/sync.yaml",
            "--tensorboard",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'hetps[tensorboard]'" in lines[0], result.stderr
    assert "Traceback" not in result.stderr and not out.exists()


def test_ctrl_c_while_the_cluster_forms_exits_130_with_an_interrupted_summary(run_dir):
    with background_run(["configs/sync.yaml", *SMALL, "--out", str(run_dir), "--quiet"]) as proc:
        metrics = run_dir / "metrics.jsonl"
        wait_for(
            lambda: metrics.exists() and '"register"' in metrics.read_text(),
            120,
            "a first registration",
        )
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err + log_tails(run_dir)
    s = summary(run_dir)
    # nodes told that the run stopped exit with an error: that is not a failure of the run
    assert (
        s["status"] == "interrupted"
        and s["stop_reason"] == "interrupted"
        and s["failed_node"] is None
    ), s
    assert s["global_steps"] == 0
