"""Real clusters: scheduler, shards, workers and evaluator as separate
processes over ZeroMQ on loopback (random ports), training LeNet-5 on the
real mnist-5k digits."""

from __future__ import annotations

import json
import signal
import sys

import pytest
from cluster_util import (
    HELD,
    REPO,
    Daemons,
    assert_reached_target,
    background_run,
    log_tails,
    processes_mentioning,
    run_hetps,
    summary,
    wait_for,
)
from inprocess_cli import run_entry_point

from hetps.frontend.cli import main as hetps_main
from hetps.ps.__main__ import main as ps_main
from hetps.worker.__main__ import main as worker_main

pytestmark = pytest.mark.cluster


def in_process(main, argv: list[str]) -> tuple[int, str, str]:
    """`main(argv)` in this process, as `hetps` (frontend/cli.py) or `python -m
    hetps.ps|worker` (what `hetps ps|worker` execs) runs it, where what is checked is
    the exit status and the output, not a process: (exit status, stdout, stderr)."""
    done = run_entry_point(main, argv, REPO, list(sys.path))
    return done.returncode, done.stdout, done.stderr


ALGORITHMS = {
    "sync": ["configs/sync.yaml"],
    "async": ["configs/async.yaml"],
    "ssp": ["configs/ssp.yaml", "algorithm.staleness=2"],
}


# sync's run starts its daemons as a user's `hetps run` does (its own fork server); the others
# fork from the suite's shared one, sparing a torch import each
@pytest.mark.parametrize(
    "algorithm",
    [pytest.param(a, marks=pytest.mark.own_fork_server) if a == "sync" else a for a in ALGORITHMS],
)
def test_cluster_trains_to_93_percent(algorithm, run_dir):
    config, *extra = ALGORITHMS[algorithm]
    result = run_hetps(
        [
            "run",
            config,
            *extra,
            "stop.target_accuracy=0.93",
            HELD,
            "stop.max_steps=6000",
            "stop.max_seconds=150",
            "eval.every_s=1.0",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=240,
    )
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    s = summary(run_dir)
    assert s["algorithm"] == algorithm
    # the target (0.93, the test's name) was reached within the step bound
    if algorithm == "sync":
        assert_reached_target(s, 0.93, slack=0.06)
    else:
        # async/ssp may reach the target on the steep part of their curve, where it still swings by
        # 10-20 points within a few dozen updates (seen: 0.945, then a final 0.732 twenty
        # updates later, at lr 0.02): the final model is a trained one, and the model that
        # reached the target is kept as best.safetensors
        assert s["best_accuracy"] >= 0.93 and s["final_accuracy"] >= 0.6, s
    best = json.loads((run_dir / "best.json").read_text())
    assert best["evaluation"] == "best" and best["final_accuracy"] == s["best_accuracy"], best
    assert len(best["versions"]) == 2 and min(best["versions"]) > 0
    assert s["global_steps"] <= 6000 + 200, s
    assert s["failures"] == [] and s["not_left"] == []
    assert s["bytes_sent"] > 0 and s["bytes_received"] > 0
    # every shard applied updates, and the versions agree with the algorithm
    versions = list(s["shard_versions"].values())
    assert len(versions) == 2 and min(versions) > 0
    if algorithm == "sync":
        assert s["global_steps"] >= 4 * min(versions) - 4  # one update per round of 4 pushes
    for name in (
        "config.yaml",
        "plan.json",
        "metrics.jsonl",
        "summary.json",
        "accuracy_vs_time.png",
    ):
        assert (run_dir / name).exists(), name
    plan = json.loads((run_dir / "plan.json").read_text())
    assert len(plan["workers"]) == 4 and len(plan["shards"]) == 2
    assert plan["placement"][plan["tensors"][0][0]] == 0  # bottom layer on the first shard
    # by default (cluster.chunk_bytes: auto) LeNet-5's large tensor (78% of its bytes) is cut into
    # parts of 1/16 of the model's bytes (2 shards x 8), and each shard's share of the bytes follows
    # its share of the measured speed to within about one part
    assert "classifier.0.weight" in plan["chunks"]
    assert s["placement"] == plan["info"]["placement"]
    for share in s["placement"].values():
        assert abs(share["bytes"] - share["speed"]) <= 0.07, s["placement"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert {r["worker"] for r in steps} == {0, 1, 2, 3}
    assert all({"t", "step", "loss", "staleness"} <= set(r) for r in steps)
    assert any(r["kind"] == "eval" and r["final"] for r in records)


def test_bad_config_exits_2_with_one_line(tmp_path, no_stack_dump_handler_left):
    # `hetps run`'s main() in this process: the config is refused before any process starts
    for args, key in (
        (["stop.bogus=1"], "stop.bogus"),
        (["algorithm.name=nope"], "algorithm.name"),
        (["data.batch_size=abc"], "data.batch_size"),
        (["data.dataset=imagenet"], "data.dataset"),
    ):
        code, _, err = in_process(
            hetps_main,
            ["run", str(REPO / "configs/sync.yaml"), *args, "--out", str(tmp_path / "x")],
        )
        assert code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and key in lines[0], err
    assert not (tmp_path / "x").exists()


def test_failed_process_is_named_and_nothing_left(run_dir):
    # mnist (not bundled) without download: the check before the cluster starts fails, in one line
    result = run_hetps(
        [
            "run",
            "configs/sync.yaml",
            "data.dataset=mnist",
            f"data.root={run_dir}-nodata",
            "cluster.startup_timeout_s=30",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "check failed" in lines[0] and "data.download" in lines[0], (
        result.stderr
    )
    # the daemons start while the model is checked (their imports overlap it); the failed check
    # stopped them before any plan: nothing trained
    assert not (run_dir / "plan.json").exists()


def test_sigint_stops_cleanly(run_dir):
    with background_run(
        [
            "configs/sync.yaml",
            "stop.target_accuracy=null",
            "stop.max_seconds=120",
            "cluster.workers=2",
            "cluster.shards=1",
            "--out",
            str(run_dir),
            "--quiet",
        ]
    ) as proc:
        metrics = run_dir / "metrics.jsonl"
        wait_for(
            lambda: metrics.exists() and '"eval"' in metrics.read_text(), 90, "a first evaluation"
        )
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err + log_tails(run_dir)
    s = summary(run_dir)
    assert s["stop_reason"] == "interrupted" and s["status"] == "interrupted", s
    assert s["global_steps"] > 0 and s["not_left"] == [] and s["evals"] >= 1


def test_daemons_by_hand_across_hosts_style(tmp_path):
    """The multi-host path: each daemon started on its own, the scheduler
    address passed by flag or HETPS_SCHEDULER."""
    run_dir = tmp_path / "byhand"
    overrides = [
        "cluster.workers=2",
        "cluster.shards=1",
        "stop.target_accuracy=0.9",
        HELD,
        "stop.max_seconds=120",
        "eval.every_s=1.0",
    ]
    config = str(REPO / "configs" / "sync.yaml")
    # the shard (address by flag) and worker 0 (address from HETPS_SCHEDULER) exec'd by `hetps`,
    # as on hosts of their own; the rest fork from the shared server (each exec imports torch)
    daemons = Daemons(tmp_path, overrides)
    try:
        addr = daemons.scheduler(config, run_dir)
        daemons.start(["ps", "--config", config, "--rank", "0", "--scheduler", addr], fork=False)
        for rank in range(2):
            daemons.start(
                ["worker", "--config", config],
                env={"HETPS_SCHEDULER": addr, "HETPS_RANK": str(rank)},
                fork=rank != 0,
            )
        daemons.start(["worker", "--config", config, "--evaluator"], env={"HETPS_SCHEDULER": addr})
        codes = daemons.wait(180)
    finally:
        daemons.close()
    assert codes == [0] * len(codes), daemons.tails()
    s = summary(run_dir)
    assert_reached_target(s, 0.9)
    assert s["stop_reason"].endswith("held for 2 evaluations)") and s["target_patience"] == 2, s[
        "stop_reason"
    ]
    assert not processes_mentioning(str(tmp_path))


@pytest.mark.parametrize("role", ["scheduler", "ps"])
def test_usr1_prints_every_threads_stack_and_the_daemon_goes_on(role, tmp_path):
    """`kill -USR1` on a daemon (here waiting for its cluster to form) dumps its
    threads' stacks to its log; the daemon keeps running."""
    daemons = Daemons(
        tmp_path, ["cluster.workers=1", "cluster.shards=1", "cluster.startup_timeout_s=120"]
    )
    try:
        addr = daemons.scheduler(str(REPO / "configs" / "sync.yaml"), tmp_path / "run")
        if role == "ps":
            daemons.start(
                [
                    "ps",
                    "--config",
                    str(REPO / "configs" / "sync.yaml"),
                    "--rank",
                    "0",
                    "--scheduler",
                    addr,
                ]
            )
            state = tmp_path / "run" / "scheduler-state.json"
            wait_for(
                lambda: state.exists() and '"role": "ps"' in state.read_text(),
                60,
                "the shard to register",
            )
        proc = daemons.procs[-1]
        log = tmp_path / f"{len(daemons.procs) - 1}.log"
        proc.send_signal(signal.SIGUSR1)
        # the dump lists every thread, the main one (in the daemon's `main`) among them; which is
        # marked "Current thread" depends on the thread the kernel gave the signal to (a ZeroMQ
        # I/O thread is no Python thread: then none is)
        wait_for(
            lambda: "most recent call first" in log.read_text() and " in main\n" in log.read_text(),
            30,
            "a stack dump of the main thread in the log",
        )
        assert proc.poll() is None, daemons.tails()
    finally:
        daemons.close()


def test_daemon_without_scheduler_address_exits_2(monkeypatch, no_stack_dump_handler_left):
    # `python -m hetps.ps`'s main() in this process: it exits before it opens a socket
    monkeypatch.setenv("HETPS_SCHEDULER", "")
    code, _, err = in_process(ps_main, ["--config", str(REPO / "configs/sync.yaml")])
    assert code == 2 and "HETPS_SCHEDULER" in err, err


def test_chunked_tensors_train_across_shards(run_dir):
    # 4 KiB parts: a tensor is cut across the shards at almost any ratio of their measured speeds
    # (tests/cluster/test_cluster_overlap.py::test_cluster_with_overlap_and_chunks_trains)
    result = run_hetps(
        [
            "run",
            "configs/sync.yaml",
            "cluster.chunk_bytes=4096",
            "cluster.workers=2",
            "stop.target_accuracy=0.9",
            HELD,
            "stop.max_seconds=120",
            "eval.every_s=1.0",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=200,
    )
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    plan = json.loads((run_dir / "plan.json").read_text())
    spread = [
        name
        for name, c in plan["chunks"].items()
        if len({plan["placement"][p] for p in c["parts"]}) == 2
    ]
    assert len(spread) == 1, (spread, plan["shards"])  # one tensor spread over both shards
    # the chunks trained the model (0.9: the mechanism, not an accuracy, is what is checked);
    # 2 workers: the curve swings by points after it
    assert_reached_target(summary(run_dir), 0.9, slack=0.06)


@pytest.mark.exclusive  # compares the two workers' step counts
def test_capped_link_paces_only_its_worker_with_shm_frames_on(run_dir):
    """Each daemon makes its sockets with its own options (runtime/daemon.py
    `transport_options`): worker 0's link_mbps caps what it sends at 2 Mbit/s
    (250 kB/s) and leaves worker 1 at full speed, while comm.shm_bytes passes
    every process's large frames through shared memory."""
    result = run_hetps(
        [
            "run",
            "configs/async.yaml",
            "cluster.workers=2",
            "cluster.shards=1",
            "cluster.workers.0.link_mbps=2",
            "comm.shm_bytes=65536",
            "stop.target_accuracy=null",
            "stop.max_seconds=12",
            "eval.every_s=2.0",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=180,
    )
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    s = summary(run_dir)
    capped, free = s["per_node"]["worker0"], s["per_node"]["worker1"]
    assert s["failures"] == [] and s["not_left"] == [], s
    assert capped["steps"] > 0 and free["steps"] > 2 * capped["steps"], s["per_node"]
    # the token bucket never lets more through than its rate over the run (plus one message)
    assert capped["sent"] <= 250_000 * (s["wall_s"] + 5), (capped, s["wall_s"])


@pytest.mark.parametrize("role", ["ps", "worker"])
def test_daemon_with_unreachable_scheduler_fails_fast_naming_it(role, tmp_path):
    import socket
    import time

    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    # a real daemon process on real sockets, forked from the suite's shared server as `hetps run`
    # forks its own (Daemons: spared torch's import); the exec'd `hetps ps|worker`:
    # test_daemons_by_hand_across_hosts_style
    daemons = Daemons(tmp_path, ["cluster.startup_timeout_s=1", "cluster.profile_steps=1"])
    started = time.monotonic()
    try:
        daemons.start([role, "--config", str(REPO / "configs/sync.yaml"), "--scheduler", address])
        codes = daemons.wait(90)
    finally:
        daemons.close()
    log = (tmp_path / "0.log").read_text()  # the daemon's stdout and stderr
    assert codes == [1], log[-2000:]
    assert address in log and "1.0s" in log, log[-2000:]
    assert time.monotonic() - started < 1 + 30  # the timeout plus interpreter and torch start-up


@pytest.mark.parametrize(
    "args",
    [
        ["scheduler", "--bind", "tcp://0.0.0.0:7000"],
        ["ps", "--rank", "1", "--bind", "tcp://0.0.0.0:7100", "--advertise", "tcp://ps1:7100"],
        ["worker", "--evaluator"],
        ["worker"],
    ],
)
def test_check_flag_validates_without_connecting(args, monkeypatch, no_stack_dump_handler_left):
    # the daemon's main() in this process: `hetps scheduler` runs the scheduler's there too, and
    # `hetps ps|worker` execs `python -m hetps.ps|worker`, whose main() this is (frontend/cli.py);
    # the exec'd `hetps ps|worker`: test_daemons_by_hand_across_hosts_style
    monkeypatch.setenv("HETPS_SCHEDULER", "tcp://scheduler:7000")
    monkeypatch.setenv("HETPS_CONFIG", str(REPO / "configs/default.yaml"))
    role, *flags = args
    main = {"scheduler": hetps_main, "ps": ps_main, "worker": worker_main}[role]
    argv = args if role == "scheduler" else flags
    code, out, err = in_process(main, [*argv, "--check"])
    assert code == 0 and ": ok" in out, err
    code, _, err = in_process(main, [*argv, "--check", "stop.nope=1"])
    assert code == 2 and "stop.nope" in err, err
