"""`hetps simulate` runs what placement does: large tensors cut into parts
(`cluster.chunk_bytes`, default auto) spread a push's bytes over the shards,
so where the shards bound the run the busiest shard's service falls and the
workers step more often in the same virtual time. The shard's cost is a
fixed time per message plus a time per byte (sim/events.py ServiceQueue)."""

from __future__ import annotations

import json

import pytest

from hetps.runconfig.load import load_config
from hetps.sim.engine import simulate
from hetps.sim.events import ServiceQueue
from hetps.worker.data import load_datasets

# 8 equal LeNet-5 workers, 4 equal shards, sync; shards slow enough to bound the run: a whole
# push (246,824 bytes) takes 1.2 ms of shard service, 8 of them per 6.4 ms round of compute
SLOW_SHARDS = [
    "algorithm.name=sync",
    "cluster.workers={count: 8}",
    "cluster.shards={count: 4}",
    "sim.sample_s=0.0002",
    "sim.shard_bytes_per_s=2e8",
    "sim.shard_message_s=0",
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
