"""How a run ends, in one process: the divergence guard, the summary's
status, a node's start-up failure reported to the coordinator (in-memory
transport), the launcher's progress line and device assignment."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch

from hetps.frontend.launcher import with_local_devices
from hetps.frontend.report import Progress
from hetps.proto.codec import Envelope
from hetps.proto.messages import GetPlan, Register
from hetps.proto.plan import TensorSpec
from hetps.proto.rpc import RemoteError, RpcClient
from hetps.proto.transport import MemServer
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ConfigError
from hetps.runtime.devices import DeviceUnavailable, assign_devices, pick_device
from hetps.runtime.membership import Membership
from hetps.scheduler.coordinator import Coordinator
from hetps.scheduler.outcome import EXIT_CODES, DivergenceGuard, run_status

SPECS = [TensorSpec("w", "float32", (2, 3))]


# ---------------------------------------------------------------- divergence guard
def test_guard_stops_on_a_non_finite_loss_at_once_naming_the_lr():
    guard = DivergenceGuard(after=5, warmup_s=30.0, lr=10000.0)
    assert guard.loss(2.3, "worker0 at step 1") is None
    assert guard.loss(None, "worker0 at step 2") is None  # absent: not a verdict
    verdict = guard.loss(math.nan, "worker1 at step 3")
    assert verdict is not None and "worker1 at step 3" in verdict and "optimizer.lr" in verdict
    assert "10000" in verdict
    assert guard.loss(math.inf, "worker0") == verdict  # the first verdict stays


def test_guard_counts_chance_level_evaluations_in_a_row_after_the_warm_up():
    guard = DivergenceGuard(after=3, warmup_s=10.0, lr=0.5)
    for t in (1.0, 3.0, 5.0, 9.0):  # warm-up: chance level does not count yet
        assert guard.evaluation(0.10, 10, t) is None
    assert guard.evaluation(0.10, 10, 11.0) is None
    assert guard.evaluation(0.11, 10, 13.0) is None
    assert guard.evaluation(0.40, 10, 15.0) is None  # learning resets the count
    assert guard.at_chance == 0
    assert guard.evaluation(0.09, 10, 17.0) is None
    assert guard.evaluation(0.12, 10, 19.0) is None
    verdict = guard.evaluation(0.10, 10, 21.0)
    assert verdict is not None and "3 evaluations" in verdict and "optimizer.lr" in verdict


def test_guard_off_or_without_a_class_count_never_stops_on_accuracy():
    assert DivergenceGuard(after=0, warmup_s=0.0, lr=1.0).evaluation(0.0, 10, 100.0) is None
    guard = DivergenceGuard(after=1, warmup_s=0.0, lr=1.0)
    assert guard.evaluation(0.0, None, 100.0) is None
    assert guard.evaluation(0.14, 100, 1.0) is None  # 100 classes: chance is 0.01, 0.14 is learning
    assert guard.evaluation(0.012, 100, 2.0) is not None


def test_status_and_exit_codes():
    assert run_status("target accuracy 0.95 reached (0.951)", failed=False) == "completed"
    assert run_status("interrupted", failed=False) == "interrupted"
    assert run_status("diverged", failed=False) == "diverged"
    assert run_status("interrupted", failed=True) == "failed"
    assert EXIT_CODES == {"completed": 0, "failed": 1, "diverged": 3, "interrupted": 130}


def test_divergence_config_keys_are_checked():
    cfg = load_config(None, ["stop.diverged_after=2", "stop.diverge_warmup_s=0"])
    assert (cfg.stop.diverged_after, cfg.stop.diverge_warmup_s) == (2, 0.0)
    with pytest.raises(ConfigError, match="stop.diverged_after"):
        load_config(None, ["stop.diverged_after=-1"])


# ---------------------------------------------------------------- start-up failure
def test_a_failure_report_ends_the_run_at_once_and_answers_nodes_waiting_for_the_plan(tmp_path):
    cfg = load_config(None, ["cluster.workers=2", "cluster.shards=1"])
    server = MemServer("mem://coordinator-failed")
    waiter = RpcClient("mem://coordinator-failed", timeout_s=5.0)
    member = Membership("mem://coordinator-failed", "worker", 1, cfg.cluster)
    try:
        coord = Coordinator(server, cfg, run_dir=tmp_path)
        coord.on_register(
            b"x", Envelope(Register(role="worker", rank=0, tensor_specs=SPECS, host="hostA"), 1, 0)
        )
        parked = waiter.send(GetPlan(after=0))
        assert coord.serve_once(2.0) and coord.plan_waiters  # worker0 waits for a plan
        done = threading.Event()
        loop = threading.Thread(
            target=lambda: [coord.serve_once(0.02) for _ in iter(done.is_set, True)]
        )
        loop.start()  # the scheduler's loop, as in its daemon
        try:
            with pytest.raises(SystemExit) as exit_info:
                with member.starting():
                    raise ValueError("my_dataset(): no such file /data/x.npy")
        finally:
            done.set()
            loop.join(timeout=10)
        assert exit_info.value.code == 1
        assert coord.stop_reason is not None and "worker1" in coord.stop_reason
        assert "no such file /data/x.npy" in coord.stop_reason
        assert coord.finished()  # no plan went out: nobody to wait for
        coord.close()
        # the parked GetPlan is answered, not left to time out
        with pytest.raises(RemoteError, match="worker1"):
            waiter.wait(parked, timeout_s=5.0)
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["status"] == "failed" and summary["failed_node"] == "worker1"
        assert "ValueError: my_dataset(): no such file /data/x.npy" in summary["detail"]
        assert summary["hosts"] == {"worker0": "hostA"}
        assert summary["environment"]["torch"] and summary["environment"]["hetps"]
    finally:
        member.close()
        waiter.close()
        server.close()


# ---------------------------------------------------------------- launcher pieces
def test_auto_devices_go_round_robin_over_the_visible_gpus():
    assert assign_devices(["auto"] * 5, 2) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert assign_devices(["auto", "cpu", "auto", "cuda:3", "auto"], 4) == [
        "cuda:0",
        "cpu",
        "cuda:1",
        "cuda:3",
        "cuda:2",
    ]
    assert assign_devices(["auto", "auto", "cuda"], 0) == ["cpu", "cpu", "cuda"]
    assert assign_devices([], 8) == []


def test_hetps_run_writes_the_resolved_devices_into_the_config():
    cfg = load_config(None, ["cluster.workers=3", "cluster.workers.1.device=cpu"])
    resolved = [n.device for n in with_local_devices(cfg).cluster.workers]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert resolved == assign_devices(["auto", "cpu", "auto"], gpus)


def test_a_device_this_host_lacks_is_a_clear_error_and_a_bad_name_a_config_error():
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(
        DeviceUnavailable, match=rf"cluster.workers.2.device: cuda:{count} .* {count} CUDA"
    ):
        pick_device(f"cuda:{count}", "cluster.workers.2.device")
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto").type == ("cuda" if count else "cpu")
    with pytest.raises(
        ConfigError, match=r"cluster.workers.0.device: unknown value 'gpu'; allowed: auto, cpu"
    ):
        load_config(None, ["cluster.workers.0.device=gpu"])


def test_progress_says_what_start_up_waits_for_then_shows_target_and_limits(tmp_path):
    path = tmp_path / "metrics.jsonl"
    progress = Progress(
        path,
        expected=["ps0", "ps1", "worker0", "worker1", "evaluator"],
        target=0.95,
        max_seconds=300,
        max_steps=6000,
    )
    progress.poll()
    assert "starting 5 processes" in progress.line()
    with open(path, "w") as f:
        for node in ("worker0", "ps0", "evaluator0"):
            f.write(json.dumps({"kind": "register", "t": 12.0, "node": node, "host": "h"}) + "\n")
    progress.poll()
    assert "registered 3/5 — waiting for ps1, worker1" in progress.line()
    with open(path, "a") as f:
        for node in ("ps1", "worker1"):
            f.write(json.dumps({"kind": "register", "t": 13.0, "node": node, "host": "h"}) + "\n")
        f.write(json.dumps({"kind": "plan", "t": 0.01, "plan_id": 1, "groups": [[3, 4]]}) + "\n")
        f.write(json.dumps({"kind": "step", "t": 1.5, "worker": 0, "step": 40, "loss": 1.0}) + "\n")
        f.write(json.dumps({"kind": "eval", "t": 2.0, "accuracy": 0.5, "loss": 1.2}) + "\n")
    progress.poll()
    line = progress.line()
    assert (
        "2.0s/300s" in line and "steps      40/6000" in line and "0.5000 (target 0.95)" in line
    ), line
