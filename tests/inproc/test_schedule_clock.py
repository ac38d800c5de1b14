"""The lr schedule's clock on real shards (shard_harness.py, mem:// transport):
`optimizer.schedule.clock: samples` steps the schedule once per global batch the shards
applied (data.batch_size x the configured workers), so a sync round, two updates of a
grouping group of half the workers and P async pushes are each one schedule step;
`clock: updates` steps once per update. A pull's PARAMS carries the shard's lr."""

from __future__ import annotations

import pytest
import torch
from shard_harness import ShardHarness, closing_factory, tiny_model

from hetps.runconfig.load import load_config
from hetps.runtime.optim import schedule_batch
from hetps.training.state import model_specs, model_tensors

W = [11, 12, 13, 14]
BATCH = 8
LR = 0.1
# lr x 0.5 every 2 schedule steps
STEP = ["optimizer.schedule.name=step", "optimizer.schedule.step_size=2"]
STEP.append("optimizer.schedule.gamma=0.5")


class Cluster(ShardHarness):
    def __init__(self, algorithm: str, overrides: list[str], groups=()):
        model = tiny_model()
        cfg = [
            f"optimizer.lr={LR}",
            "optimizer.momentum=0",
            f"data.batch_size={BATCH}",
            f"cluster.workers={len(W)}",
            *STEP,
            *overrides,
        ]
        super().__init__(model_specs(model), cfg, W, 1, algorithm, groups=groups)
        self.initial = {n: t.detach().clone() for n, (t, _) in model_tensors(model).items()}
        self.init(self.initial, W[0])

    def lr(self) -> float:
        """The lr a pull's PARAMS reports."""
        (req,) = self.send_pull(W[0], -1)
        return self.client(W[0]).wait(req, timeout_s=2.0).lr

    def push_all(self, workers, clock: int) -> None:
        grad = {
            n: torch.ones_like(t) if t.is_floating_point() else t for n, t in self.initial.items()
        }
        for w in workers:
            self.push(w, clock, grad, n_samples=BATCH)


@pytest.fixture
def clusters():
    yield from closing_factory(Cluster)


def test_the_global_batch_is_the_configured_workers_batches():
    cfg = load_config(None, ["data.batch_size=8", "cluster.workers=4", "data.accumulate=2"])
    assert schedule_batch(cfg) == 64
    balanced = ["algorithm.name=balanced", "algorithm.global_batch=100", "cluster.workers=4"]
    assert schedule_batch(load_config(None, balanced)) == 100
    assert schedule_batch(load_config(None, ["optimizer.schedule.clock=updates"])) == 0


def test_sync_steps_the_schedule_once_per_round(clusters):
    c = clusters("sync", [])
    lrs = []
    for clock in range(4):
        c.push_all(W, clock)
        lrs.append(c.lr())
    assert c.versions() == [4]
    assert lrs == pytest.approx([LR, LR / 2, LR / 2, LR / 4])


@pytest.mark.parametrize("clock", ["samples", "updates"])
def test_grouping_steps_it_by_the_samples_applied(clusters, clock):
    """Two groups of two of four workers: each group update is half a global batch, so
    under `samples` four updates are two schedule steps (one halving); under `updates`
    four steps (two halvings)."""
    c = clusters("grouping", [f"optimizer.schedule.clock={clock}"], groups=[W[:2], W[2:]])
    for k in range(2):
        c.push_all(W[:2], k)
        c.push_all(W[2:], k)
    assert c.versions() == [4]
    assert c.lr() == pytest.approx(LR / 2 if clock == "samples" else LR / 4)
    assert c.shards[0].policy.updater.schedule_steps == (2 if clock == "samples" else 4)


def test_async_steps_it_once_per_p_pushes(clusters):
    c = clusters("async", [])
    for k in range(2):
        c.push_all(W, k)  # 8 pushes of one batch each: 2 global batches
    assert c.versions() == [8]
    assert c.lr() == pytest.approx(LR / 2)
    assert c.shards[0].policy.updater.schedule_steps == 2


def test_the_clock_survives_a_checkpoint(clusters):
    """A restored shard goes on from the samples it had counted: half a global batch
    before the checkpoint and half after make one schedule step."""
    c = clusters("async", [])
    c.push_all(W[:2], 0)
    shard = c.shards[0]
    state = shard.state_dict()
    assert state["updater"]["samples"] == 2 * BATCH
    shard.restore(state)
    c.push_all(W[2:], 0)
    assert shard.policy.updater.schedule_steps == 1
