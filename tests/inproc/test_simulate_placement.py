"""`hetps simulate` runs what placement does: large tensors cut into parts
(`cluster.chunk_bytes`, default auto) spread a push's bytes over the shards,
so where the shards bound the run the busiest shard's service falls and the
workers step more often in the same virtual time. The shard's cost is a
fixed time per message plus a time per byte, and a time per optimizer step
it applies plus a time per byte of its parameters (sim/events.py
ServiceQueue): a sync round of N pushes costs N receives and one step."""

from __future__ import annotations

import json
import math

import pytest

from hetps.runconfig.load import load_config
from hetps.sim.engine import simulate
from hetps.sim.events import ServiceQueue
from hetps.training.data import load_datasets

# 8 equal LeNet-5 workers, 4 equal shards, sync; shards slow enough to bound the run: a whole
# push (246,824 bytes) takes 1.2 ms of shard service, 8 of them per 6.4 ms round of compute
SLOW_SHARDS = [
    "algorithm.name=sync",
    "comm.aggregate=off",  # every worker's push reaches the shards: what placement spreads
    "cluster.workers={count: 8}",
    "cluster.shards={count: 4}",
    "sim.sample_s=0.0002",
    "sim.shard_bytes_per_s=2e8",
    "sim.shard_message_s=0",
    "sim.shard_apply_s=0",  # the bytes received only: what placement spreads
    "sim.shard_apply_bytes_per_s=1e15",
    "stop.target_accuracy=null",
    "stop.max_seconds=0.5",
    "eval.every_s=0.25",
]


@pytest.fixture(scope="module")
def digits():
    return load_datasets(load_config(None).data, 0)


def run(tmp_path, digits, name, *overrides):
    cfg = load_config(None, SLOW_SHARDS + list(overrides))
    summary = simulate(cfg, tmp_path / name, data=digits)
    busy = [summary["shard_stats"][f"ps{k}"]["busy_s"] for k in range(4)]
    return summary, busy, json.loads((tmp_path / name / "plan.json").read_text())


def test_parts_spread_the_busiest_shards_service_and_the_run_steps_faster(tmp_path, digits):
    whole, whole_busy, whole_plan = run(tmp_path, digits, "whole", "cluster.chunk_bytes=0")
    cut, cut_busy, cut_plan = run(tmp_path, digits, "cut")  # the default: chunk_bytes=auto
    assert not whole_plan["chunks"] and "classifier.0.weight" in cut_plan["chunks"]
    # the plan and the summary report each shard's byte share beside its speed share
    assert cut["placement"] == cut_plan["info"]["placement"]
    assert max(s["bytes"] for s in whole["placement"].values()) > 0.75  # classifier.0.weight
    assert max(s["bytes"] for s in cut["placement"].values()) <= 1.15 * 0.25
    assert all(s["speed"] == 0.25 for s in cut["placement"].values())
    # service time follows the bytes: uncut, one shard does most of the work
    assert max(whole_busy) / sum(whole_busy) > 0.75
    assert max(cut_busy) / sum(cut_busy) <= 1.15 * 0.25
    # a round is 6.4 ms of compute then the pushes' service on the busiest shard: uncut 8 x 0.96 ms
    # (14.1 ms a round), cut 8 x ~0.31 ms (8.9 ms): the same virtual time holds ~1.58x the rounds
    ratio = cut["global_steps"] / whole["global_steps"]
    assert ratio >= 1.45, (cut["global_steps"], whole["global_steps"])
    # the parts are reassembled: the model the evaluator reads learns
    assert cut["final_accuracy"] > 0.5


def test_a_messages_service_is_its_fixed_cost_plus_its_bytes():
    service = ServiceQueue(bytes_per_s=1e6, message_s=0.001)
    assert service.finish(0.0, 1000, 1.0) == pytest.approx(0.002)
    # queued behind the first, at slowdown 2
    assert service.finish(0.0, 0, 2.0) == pytest.approx(0.004)
    assert service.busy_s == pytest.approx(0.004)


def test_an_optimizer_step_holds_the_shard_for_its_fixed_cost_plus_its_parameter_bytes():
    service = ServiceQueue(1e6, 0.001, apply_bytes_per_s=1e5, apply_s=0.002, apply_bytes=300)
    assert service.finish(0.0, 1000, 1.0) == pytest.approx(0.002)
    assert service.apply(0.002, 0, 1.0) == pytest.approx(0.002)  # no step: nothing held
    # one step: 2 ms + 300 bytes at 1e5 bytes/s = 5 ms, at slowdown 2: 10 ms
    assert service.apply(0.002, 1, 2.0) == pytest.approx(0.012)
    assert service.finish(0.003, 0, 1.0) == pytest.approx(0.013)  # waits for the step
    assert service.busy_s == pytest.approx(0.002 + 0.010 + 0.001)


# a tiny model (one linear layer), one shard, costs in round numbers; bytes received cost nothing
TINY = [
    "comm.aggregate=off",  # one push per worker (aggregated rounds: test_simulate_aggregation.py)
    "model.name=mlp",
    "model.kwargs={hidden: []}",
    "cluster.workers={count: 3}",
    "cluster.shards={count: 1}",
    "data.batch_size=8",
    "sim.sample_s=0.001",
    "sim.shard_message_s=0.001",
    "sim.shard_bytes_per_s=1e15",
    "sim.shard_apply_s=0.004",
    "sim.shard_apply_bytes_per_s=1e7",
    "stop.target_accuracy=null",
    "stop.max_seconds=0.5",
    "eval.every_s=0.25",
]


def tiny_busy(tmp_path, digits, algorithm):
    """(the shard's busy seconds, pushes, optimizer steps, the expected busy
    seconds of one message and of one step) of a TINY run under `algorithm`."""
    cfg = load_config(None, TINY + [f"algorithm.name={algorithm}"])
    summary = simulate(cfg, tmp_path / algorithm, data=digits)
    stats = summary["shard_stats"]["ps0"]
    plan = json.loads((tmp_path / algorithm / "plan.json").read_text())
    param_bytes = sum(4 * math.prod(shape) for _, _, shape, _ in plan["tensors"])
    assert param_bytes == 4 * (784 * 10 + 10)  # 28x28 digits -> 10 logits
    return stats["busy_s"], stats["pushes"], stats["version"], 0.001, 0.004 + param_bytes / 1e7


def assert_busy(busy, messages, steps, message_s, step_s):
    """busy == messages x message_s + steps x step_s, give or take the one
    message a shard may have been receiving (charged, not yet handled) at the stop."""
    expected = messages * message_s + steps * step_s
    assert min(abs(busy - expected), abs(busy - expected - message_s)) < 1e-6, (busy, expected)


def test_a_sync_round_of_n_pushes_costs_n_messages_and_one_optimizer_step(tmp_path, digits):
    busy, pushes, steps, message_s, step_s = tiny_busy(tmp_path, digits, "sync")
    assert pushes > 30
    assert steps == pushes // 3  # one step per round of 3 pushes (the last may be open)
    # the messages: each worker's first pull, then one fused push+pull per step
    assert_busy(busy, pushes + 3, steps, message_s, step_s)


def test_every_async_push_costs_a_message_and_an_optimizer_step(tmp_path, digits):
    busy, pushes, steps, message_s, step_s = tiny_busy(tmp_path, digits, "async")
    assert pushes > 30
    assert steps == pushes
    assert_busy(busy, pushes + 3, steps, message_s, step_s)
