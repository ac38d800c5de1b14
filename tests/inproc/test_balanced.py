"""balanced: sync with speed-proportional batches. The planning function
(batch sizes follow speeds, fixed global batch, bounds), the scheduler's
re-sizing when speeds drift, and the shard's sample-weighted round mean,
checked against torch.optim on the sample-weighted mean gradient."""

from __future__ import annotations

import pytest
import torch
from shard_harness import ShardHarness, grads, tiny_model, values_of

from hetps.proto.codec import Envelope
from hetps.proto.messages import Params, Pull, Push, Register
from hetps.proto.plan import TensorSpec
from hetps.proto.records import NodeStats
from hetps.proto.transport import MemServer
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ConfigError
from hetps.runtime.speed_shares import local_steps, proportional_sizes
from hetps.scheduler.coordinator import Coordinator
from hetps.scheduler.formation import FORMATIONS
from hetps.training.state import model_specs

A, B, C = 11, 12, 13


# ------------------------------------------------------------ planning
def test_batches_are_proportional_to_speed_and_sum_to_the_global_batch():
    assert proportional_sizes({1: 1.0, 2: 1.0, 3: 3.0, 4: 3.0}, 128, 8, 0) == {
        1: 16,
        2: 16,
        3: 48,
        4: 48,
    }
    assert proportional_sizes({1: 10.0, 2: 20.0, 3: 30.0}, 100, 8, 0) == {1: 17, 2: 33, 3: 50}


def test_equal_speeds_give_equal_batches():
    assert proportional_sizes({w: 7.5 for w in range(4)}, 128, 8, 0) == {w: 32 for w in range(4)}


def test_bounds_pin_a_batch_and_the_rest_is_shared_by_speed():
    # 1:100 would give the slow worker ~1 sample; it is held at min_batch and the fast one takes the rest
    assert proportional_sizes({1: 1.0, 2: 100.0}, 128, 8, 0) == {1: 8, 2: 120}
    # the fastest would get 51.2 > max_batch 48: pinned, the other three share 80 by speed
    assert proportional_sizes({1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}, 128, 8, 48) == {
        1: 13,
        2: 27,
        3: 40,
        4: 48,
    }


def test_an_unmeasured_speed_counts_as_the_slowest():
    assert proportional_sizes({1: 0.0, 2: 2.0, 3: 4.0}, 60, 1, 0) == {1: 15, 2: 15, 3: 30}


def test_the_formation_puts_batches_and_matching_shares_in_the_plan():
    params = load_config(
        None, ["algorithm.name=balanced", "cluster.workers=4", "data.batch_size=32"]
    ).algorithm.params
    assert params.global_batch == 128  # 0 resolves to data.batch_size x cluster.workers
    fields = FORMATIONS["balanced"].plan_fields({1: 10.0, 2: 10.0, 3: 30.0, 4: 30.0}, params)
    assert fields["groups"] == [[1, 2, 3, 4]]
    assert fields["batches"] == {"1": 16.0, "2": 16.0, "3": 48.0, "4": 48.0}
    assert fields["shares"] == fields["batches"]
    # a worker gone: the same global batch over the three left
    fields = FORMATIONS["balanced"].plan_fields({1: 10.0, 3: 30.0, 4: 30.0}, params)
    assert sum(fields["batches"].values()) == 128


def test_bounds_that_cannot_hold_the_global_batch_are_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="algorithm.min_batch: 4 workers x min_batch 40 exceed"):
        load_config(
            None, ["algorithm.name=balanced", "cluster.workers=4", "algorithm.min_batch=40"]
        )
    with pytest.raises(
        ConfigError, match="algorithm.max_batch: 4 workers x max_batch 16 fall short"
    ):
        load_config(
            None,
            [
                "algorithm.name=balanced",
                "cluster.workers=4",
                "algorithm.min_batch=8",
                "algorithm.max_batch=16",
            ],
        )
    with pytest.raises(
        ConfigError, match="algorithm.max_batch: must be 0 or >= algorithm.min_batch"
    ):
        load_config(None, ["algorithm.name=balanced", "algorithm.max_batch=4"])


def test_local_steps_follow_speed_within_bounds():
    assert [local_steps(s, 4.0, 16) for s in (1.0, 2.0, 3.0, 4.0)] == [4, 8, 12, 16]
    assert local_steps(0.1, 100.0, 16, min_period=2) == 2
    assert local_steps(0.0, 4.0, 16) == 16  # unknown speed: the full period


def coordinator(tmp_path, speeds: dict[int, float], overrides=()):
    cfg = load_config(
        None,
        [
            "algorithm.name=balanced",
            f"cluster.workers={len(speeds)}",
            "cluster.shards=1",
            "data.batch_size=32",
            "algorithm.regroup_every_s=0",
            *overrides,
        ],
    )
    server = MemServer(f"mem://balanced-coordinator-{tmp_path.name}")
    coord = Coordinator(server, cfg, run_dir=tmp_path)
    coord.on_register(
        b"p", Envelope(Register(role="ps", rank=0, address="mem://ps0", speed=1.0), 1, 0)
    )
    for rank, speed in speeds.items():
        msg = Register(
            role="worker",
            rank=rank,
            speed=speed,
            tensor_specs=[TensorSpec("w", "float32", (2,))],
        )
        coord.on_register(b"p", Envelope(msg, req_id=1, src=0))
    return coord, server


def test_a_speed_change_re_sizes_the_batches(tmp_path):
    """Profiled speeds 1:1:3:3 -> batches 16:16:48:48; worker 0 turns 3x faster
    in its heartbeats -> after confirm_checks checks a new plan with 40:13:38:38-like
    shares of the same global batch."""
    coord, server = coordinator(tmp_path, {0: 10.0, 1: 10.0, 2: 30.0, 3: 30.0})
    try:
        plan = coord.plan
        ids = plan.worker_ids()
        assert [plan.batch_of(w, 0) for w in ids] == [16, 16, 48, 48]
        for node in coord.members("worker"):  # heartbeats: same speeds, noise below the hysteresis
            node.stats = NodeStats(speed=node.profiled_speed * 1.05)
        coord._maybe_regroup()
        coord._maybe_regroup()
        assert coord.plan.plan_id == plan.plan_id  # no re-size for noise
        coord.nodes[ids[0]].stats = NodeStats(speed=30.0)
        coord._maybe_regroup()
        assert coord.plan.plan_id == plan.plan_id  # one check is not enough (confirm_checks 2)
        coord._maybe_regroup()
        new = coord.plan
        assert new.plan_id == plan.plan_id + 1
        batches = [new.batch_of(w, 0) for w in ids]
        assert (
            sum(batches) == 128
            and batches[0] > 2 * batches[1]
            and abs(batches[0] - batches[2]) <= 4
        ), batches
        assert new.shares == new.batches
    finally:
        server.close()


# ------------------------------------------------------------ the shard
def push(h: ShardHarness, node: int, tensors: dict, n_samples: int):
    c = h.client(node)
    req = c.send(
        Push(
            plan_id=h.plan_id,
            clock=0,
            base_version=0,
            n_samples=n_samples,
            tensors=tensors,
        )
    )
    h.serve()
    return c.wait(req, timeout_s=2.0)


def pulled(h: ShardHarness, node: int) -> dict:
    c = h.client(node)
    req = c.send(Pull(plan_id=h.plan_id, clock=1))
    h.serve()
    reply = c.wait(req, timeout_s=2.0)
    assert isinstance(reply, Params)
    return reply.tensors


def test_the_round_update_is_torch_optim_on_the_sample_weighted_mean_gradient():
    model = tiny_model()
    overrides = ["algorithm.global_batch=96", "optimizer.momentum=0.9", "optimizer.lr=0.1"]
    h = ShardHarness(model_specs(model), overrides, [A, B, C], algorithm="balanced")
    try:
        start = values_of(model)
        h.init(start)
        pushes = {A: (grads(model, 1), 16), B: (grads(model, 2), 32), C: (grads(model, 3), 48)}
        for node, (g, n) in pushes.items():
            push(h, node, g, n)
        got = pulled(h, A)
    finally:
        h.close()
    # reference: torch.optim.SGD over the same parameters, one step on sum n_i g_i / sum n_i
    params = {n: start[n].clone() for n in h.params()}
    opt = torch.optim.SGD(list(params.values()), lr=0.1, momentum=0.9)
    for name, p in params.items():
        p.grad = sum(g[name] * n for g, n in pushes.values()) / sum(n for _, n in pushes.values())
    opt.step()
    for name, p in params.items():
        torch.testing.assert_close(got[name], p, rtol=0, atol=1e-6)
    assert not torch.allclose(got["0.weight"], start["0.weight"])


def test_equal_batches_update_exactly_as_sync():
    """Equal batches weigh 1.0 each: the balanced shard's tensors are bit-equal to sync's."""
    model = tiny_model()
    results = {}
    for name in ("sync", "balanced"):
        h = ShardHarness(
            model_specs(model),
            ["algorithm.global_batch=64"] if name == "balanced" else [],
            [A, B],
            algorithm=name,
        )
        try:
            h.init(values_of(model))
            for node in (A, B):
                push(h, node, grads(model, node), 32)
            results[name] = pulled(h, A)
        finally:
            h.close()
    for n, t in results["sync"].items():
        assert torch.equal(t, results["balanced"][n]), n


def test_a_new_batch_rescales_the_step_timer():
    """After a re-size, the speed a worker reports is its new batch over a
    time scaled to it, not the old batch's time (which would overstate a
    grown batch's speed and ask for a bigger one still)."""
    from hetps.training.timing import StepTimer

    timer = StepTimer()
    timer.update(compute_s=0.1, push_s=0.01, step_s=0.12)
    assert timer.speed(32) == pytest.approx(32 / 0.11)
    timer.rescale(2.0)  # batch 32 -> 64
    assert timer.speed(64) == pytest.approx(64 / 0.21)
