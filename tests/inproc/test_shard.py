"""The parameter-server shard as a Service, driven in-process and deterministically.

Every test binds a Shard on a `mem://` transport and talks to it with
RpcClients (one per worker node id) through the ShardHarness of
shard_harness.py. A request is `send`, then the test runs `serve_once` until
the shard's inbox is empty, then `wait`s; a reply that must NOT have come yet
(a parked pull) is checked with a short `wait` that times out.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from shard_harness import PLAN_ID, A, B, ShardHarness, not_answered, tiny_model
from torch import nn

from hetps.proto.messages import Ack, Init, Params, Pull, Push, Register, Status
from hetps.proto.rpc import RemoteError
from hetps.training.state import model_tensors

TIGHT = dict(rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- fixtures and helpers


def init_values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, (t, _) in model_tensors(model).items()}


def fake_push(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A push as a worker makes it: a gradient per parameter, current values per buffer."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (t, kind) in model_tensors(model).items():
        if kind == "param":
            out[name] = torch.randn(t.shape, generator=g, dtype=t.dtype)
        elif t.is_floating_point():
            out[name] = torch.rand(t.shape, generator=g, dtype=t.dtype) + 0.5
        else:
            out[name] = torch.tensor(seed + 7, dtype=t.dtype)
    return out


def assert_values(actual: dict, expected: dict, names) -> None:
    for n in names:
        torch.testing.assert_close(actual[n], expected[n], **TIGHT, msg=lambda m, n=n: f"{n}: {m}")


def reference_optimizer(ref: nn.Module, cfg) -> torch.optim.Optimizer:
    o = cfg.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(
            ref.parameters(),
            lr=o.lr,
            momentum=o.momentum,
            nesterov=o.nesterov,
            weight_decay=o.weight_decay,
        )
    return torch.optim.Adam(
        ref.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay
    )


# ---------------------------------------------------------------- sync arithmetic

OPTIMIZERS = {
    "sgd": [
        "optimizer.name=sgd",
        "optimizer.lr=0.1",
        "optimizer.momentum=0.9",
        "optimizer.weight_decay=1e-4",
        "optimizer.nesterov=false",
    ],
    "sgd-nesterov": [
        "optimizer.name=sgd",
        "optimizer.lr=0.1",
        "optimizer.momentum=0.9",
        "optimizer.weight_decay=1e-4",
        "optimizer.nesterov=true",
    ],
    "adam": ["optimizer.name=adam", "optimizer.lr=0.01", "optimizer.weight_decay=1e-4"],
}


@pytest.mark.parametrize("n_shards", [1, 2])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_sync_rounds_equal_one_optimizer_step_on_the_mean(harnesses, opt, n_shards):
    model = tiny_model()
    h = harnesses(model, OPTIMIZERS[opt], n_shards=n_shards)
    assert all(h.owned(i) for i in range(n_shards))
    h.init(init_values(model))
    ref = copy.deepcopy(model)
    ref_opt = reference_optimizer(ref, h.cfg)
    params = dict(ref.named_parameters())
    buffer_names = [n for n, k in h.kinds.items() if k == "buffer"]
    assert h.versions() == [0] * n_shards

    for rnd in range(3):  # several rounds: momentum buffers / Adam moments matter
        ga, gb = fake_push(model, 100 + 2 * rnd), fake_push(model, 101 + 2 * rnd)
        before = h.values()
        acks = h.push(A, rnd, ga, base_version=rnd)
        assert [a.version for a in acks] == [rnd] * n_shards  # round still open
        # A pulls for its next step: parked until B's push closes the round
        pulls = [
            (i, h.client(A, i).send(Pull(plan_id=PLAN_ID, clock=rnd + 1))) for i in range(n_shards)
        ]
        h.serve()
        for i, req in pulls:
            assert not_answered(h.client(A, i), req), "pull answered before the round closed"
        assert all(s.stats()["parked"] == 1 for s in h.shards)
        assert_values(h.values(), before, before)  # nothing applied yet
        acks = h.push(B, rnd, gb, base_version=rnd)
        assert [a.version for a in acks] == [rnd + 1] * n_shards
        assert [a.staleness for a in acks] == [0] * n_shards
        assert h.versions() == [rnd + 1] * n_shards
        h.serve()
        pulled = {}
        for i, req in pulls:
            params_msg = h.client(A, i).wait(req, timeout_s=2.0)
            assert isinstance(params_msg, Params) and params_msg.version == rnd + 1
            pulled.update(params_msg.tensors)
        assert all(s.stats()["parked"] == 0 for s in h.shards)

        # reference: one optimizer step in-process with .grad = mean of the two gradients
        for name, p in params.items():
            p.grad = (ga[name].clone().add_(gb[name])).div_(2)
        ref_opt.step()
        expected = {n: p.detach() for n, p in params.items()}
        got = h.values()
        assert_values(got, expected, params)
        assert_values(pulled, expected, params)
        for name in buffer_names:
            if got[name].is_floating_point():
                torch.testing.assert_close(got[name], (ga[name] + gb[name]) / 2, **TIGHT)
            else:  # num_batches_tracked: the largest
                assert torch.equal(got[name], torch.maximum(ga[name], gb[name]))
        assert_values(pulled, got, got)


def test_sync_pull_before_init_is_parked_and_answered_by_init(harnesses):
    model = tiny_model()
    h = harnesses(model, [])
    c = h.client(B)
    req = c.send(Pull(plan_id=PLAN_ID, clock=0))
    h.serve()
    assert not_answered(c, req)
    h.init(init_values(model))
    reply = c.wait(req, timeout_s=2.0)
    assert isinstance(reply, Params) and reply.version == 0
    assert_values(reply.tensors, init_values(model), h.kinds)


def test_init_first_offer_wins(harnesses):
    model = tiny_model()
    h = harnesses(model, [])
    h.init(init_values(model))
    other = init_values(tiny_model(seed=1))
    ack = h.call(B, Init(plan_id=PLAN_ID, tensors=other))
    assert isinstance(ack, Ack) and ack.info["first"] is False
    assert_values(h.values(), init_values(model), h.kinds)


def test_duplicate_push_is_applied_once(harnesses):
    model = tiny_model()
    h = harnesses(model, OPTIMIZERS["sgd"])
    h.init(init_values(model))
    ga, gb = fake_push(model, 1), fake_push(model, 2)
    h.push(A, 0, ga)
    # same worker, same clock, different payload while the round is open: ignored
    (ack,) = h.push(A, 0, fake_push(model, 99))
    assert ack.version == 0
    h.push(B, 0, gb)
    assert h.versions() == [1]
    after_round = h.values()
    ref = copy.deepcopy(model)
    opt = reference_optimizer(ref, h.cfg)
    for name, p in ref.named_parameters():
        p.grad = (ga[name] + gb[name]) / 2
    opt.step()
    assert_values(after_round, dict(ref.named_parameters()), dict(ref.named_parameters()))
    # replay of a closed round: tensors and version unchanged
    (ack,) = h.push(A, 0, ga)
    assert ack.version == 1
    (ack,) = h.push(B, 0, fake_push(model, 5))
    assert ack.version == 1
    assert h.versions() == [1]
    assert_values(h.values(), after_round, after_round)
    # the next round still works normally
    h.push(A, 1, ga, base_version=1)
    h.push(B, 1, gb, base_version=1)
    assert h.versions() == [2]


# ---------------------------------------------------------------- ssp and async


def test_ssp_parks_a_pull_more_than_staleness_ahead(harnesses):
    model = tiny_model()
    h = harnesses(model, ["algorithm.staleness=2"], algorithm="ssp")
    h.init(init_values(model))
    a = h.client(A)
    for clock in range(2):
        (ack,) = h.push(A, clock, fake_push(model, clock), base_version=clock)
        assert ack.version == clock + 1  # applied at once
    # after 2 pushes, B at 0: 0 >= 2 - 2 -> answered immediately
    reply = h.call(A, Pull(plan_id=PLAN_ID, clock=2))
    assert isinstance(reply, Params) and reply.version == 2
    h.push(A, 2, fake_push(model, 2), base_version=2)
    # after 3 pushes: 0 >= 3 - 2 fails -> parked
    req = a.send(Pull(plan_id=PLAN_ID, clock=3))
    h.serve()
    assert not_answered(a, req)
    assert h.shards[0].stats()["parked"] == 1
    # the evaluator's clock -1 is never parked
    reply = h.call(B, Pull(plan_id=PLAN_ID, clock=-1))
    assert isinstance(reply, Params) and reply.version == 3
    (ack,) = h.push(B, 0, fake_push(model, 50), base_version=0)
    assert ack.version == 4 and ack.staleness == 3
    h.serve()
    reply = a.wait(req, timeout_s=2.0)
    assert isinstance(reply, Params) and reply.version == 4
    assert h.shards[0].stats()["parked"] == 0


def test_async_applies_every_push_and_never_parks(harnesses):
    model = tiny_model()
    h = harnesses(
        model, ["optimizer.name=sgd", "optimizer.momentum=0", "optimizer.lr=0.1"], algorithm="async"
    )
    h.init(init_values(model))
    ref = copy.deepcopy(model)
    ref_opt = reference_optimizer(ref, h.cfg)
    params = dict(ref.named_parameters())
    expected_buffers = {
        n: t.clone() for n, t in init_values(model).items() if h.kinds[n] == "buffer"
    }
    schedule = [(A, 0, 0), (B, 0, 0), (B, 1, 0), (A, 1, 1)]  # (worker, clock, base_version)
    for version, (worker, clock, base) in enumerate(schedule):
        # a pull far ahead of everyone is never parked
        reply = h.call(worker, Pull(plan_id=PLAN_ID, clock=clock + 10))
        assert isinstance(reply, Params) and reply.version == version
        g = fake_push(model, 10 * version + worker)
        (ack,) = h.push(worker, clock, g, base_version=base)
        assert ack.version == version + 1
        assert ack.staleness == version - base  # shard version at the push - base_version
        for name, p in params.items():
            p.grad = g[name]
        ref_opt.step()
        for name, t in expected_buffers.items():  # running mean with weight 1/P
            if t.is_floating_point():
                t.lerp_(g[name], 0.5)
            else:
                torch.maximum(t, g[name], out=t)
        assert_values(h.values(), params, params)
        assert_values(h.values(), expected_buffers, expected_buffers)
    assert h.shards[0].stats()["parked"] == 0
    # duplicate push (same worker, same clock): not applied again
    before = h.values()
    (ack,) = h.push(A, 1, fake_push(model, 77), base_version=3)
    assert ack.version == len(schedule)
    assert_values(h.values(), before, before)


# ---------------------------------------------------------------- refusals


def refused(h: ShardHarness, node: int, msg, status: Status) -> None:
    with pytest.raises(RemoteError) as info:
        h.call(node, msg)
    assert info.value.status == status, info.value


def good_pull(h: ShardHarness, node: int = A) -> Params:
    reply = h.call(node, Pull(plan_id=PLAN_ID, clock=-1))
    assert isinstance(reply, Params)
    return reply


def test_push_before_init_is_not_ready(harnesses):
    model = tiny_model()
    h = harnesses(model, [])
    refused(
        h,
        A,
        Push(plan_id=PLAN_ID, clock=0, base_version=0, tensors=fake_push(model, 1)),
        Status.NOT_READY,
    )
    h.init(init_values(model))
    (ack,) = h.push(A, 0, fake_push(model, 1))
    assert isinstance(ack, Ack)


def test_refusals_leave_the_shard_serving(harnesses):
    model = tiny_model()
    h = harnesses(model, OPTIMIZERS["sgd"])
    h.init(init_values(model))
    start = h.values()
    good = fake_push(model, 1)
    names = list(good)

    def push(tensors, plan_id=PLAN_ID, clock=0):
        return Push(plan_id=plan_id, clock=clock, base_version=0, tensors=tensors)

    nan = dict(good)
    nan[names[0]] = good[names[0]].clone()
    nan[names[0]].view(-1)[1] = math.nan
    inf_buffer = dict(good)
    inf_buffer["1.running_var"] = good["1.running_var"].clone().fill_(math.inf)
    wrong_shape = dict(good)
    wrong_shape[names[0]] = torch.zeros(2, 2)
    wrong_dtype = dict(good)
    wrong_dtype[names[0]] = good[names[0]].double()
    missing_grad = {n: t for n, t in good.items() if n != "3.bias"}
    cases = [
        (A, push(good, plan_id=PLAN_ID - 1), Status.STALE_PLAN),
        (A, push(nan), Status.NONFINITE),
        (A, push(inf_buffer), Status.NONFINITE),
        (A, push({**good, "ghost.weight": torch.zeros(3)}), Status.UNKNOWN_TENSOR),
        (A, push(wrong_shape), Status.SHAPE_MISMATCH),
        (A, push(wrong_dtype), Status.DTYPE_NOT_ALLOWED),
        (A, push(missing_grad), Status.MALFORMED),
        (99, push(good), Status.BAD_STATE),
        (A, Register(role="worker", rank=0), Status.UNKNOWN_OP),
        (A, Init(plan_id=PLAN_ID, tensors={names[0]: torch.zeros(7)}), Status.SHAPE_MISMATCH),
    ]
    for node, msg, status in cases:
        refused(h, node, msg, status)
        reply = good_pull(h)  # a following valid request is served
        assert reply.version == 0
        assert h.versions() == [0]
        assert_values(h.values(), start, start)  # nothing applied
    assert h.shards[0].stats()["nonfinite"] == 2
    assert h.shards[0].stats()["malformed"] == 5  # refused at decode: tensor checks and the op

    # and the refused pushes left no trace in the round: a normal round applies exactly the mean
    gb = fake_push(model, 2)
    h.push(A, 0, good)
    h.push(B, 0, gb)
    assert h.versions() == [1]
    ref = copy.deepcopy(model)
    opt = reference_optimizer(ref, h.cfg)
    for name, p in ref.named_parameters():
        p.grad = (good[name] + gb[name]) / 2
    opt.step()
    assert_values(h.values(), dict(ref.named_parameters()), dict(ref.named_parameters()))


def test_buffers_are_optional_in_a_push(harnesses):
    model = tiny_model()
    h = harnesses(model, [])
    h.init(init_values(model))
    grads_only = {n: t for n, t in fake_push(model, 3).items() if h.kinds[n] == "param"}
    h.push(A, 0, grads_only)
    h.push(B, 0, grads_only)
    assert h.versions() == [1]
    after = h.values()
    for n, k in h.kinds.items():
        if k == "buffer":
            assert torch.equal(after[n], init_values(model)[n])


def test_sync_buffer_mean_counts_only_the_pushes_that_carried_it(harnesses):
    model = tiny_model()
    h = harnesses(model, [])
    h.init(init_values(model))
    with_buffers = fake_push(model, 4)
    grads_only = {n: t for n, t in fake_push(model, 5).items() if h.kinds[n] == "param"}
    h.push(A, 0, with_buffers)
    h.push(B, 0, grads_only)
    assert h.versions() == [1]
    after = h.values()
    for n, k in h.kinds.items():
        if k == "buffer":  # the mean of the one value pushed, not half of it
            torch.testing.assert_close(after[n], with_buffers[n], **TIGHT)


# ---------------------------------------------------------------- learning-rate schedule


def run_rounds(h: ShardHarness, model: nn.Module, k: int) -> list[tuple[float, dict, dict]]:
    """k single-worker updates; per update: (lr reported before it, values before, grad)."""
    out = []
    for clock in range(k):
        before = h.values()
        g = fake_push(model, clock)
        lr = h.shards[0].stats()["lr"]
        assert lr == h.shards[0].policy.updater.lr
        h.push(A, clock, g, base_version=clock)
        out.append((lr, before, g))
    return out


def plain_sgd(lr: float) -> list[str]:
    return [
        "optimizer.name=sgd",
        f"optimizer.lr={lr}",
        "optimizer.momentum=0",
        "optimizer.weight_decay=0",
    ]


def check_steps(h: ShardHarness, steps, expected_lrs) -> None:
    values = [s[1] for s in steps[1:]] + [h.values()]
    for (lr, before, g), after, want in zip(steps, values, expected_lrs):
        assert lr == pytest.approx(want, rel=1e-12)
        for n, k in h.kinds.items():
            if k == "param":  # the update really used that lr
                torch.testing.assert_close(after[n], before[n] - want * g[n], **TIGHT)


def test_step_schedule_halves_lr_every_update(harnesses):
    model = tiny_model()
    h = harnesses(
        model,
        plain_sgd(0.2)
        + [
            "optimizer.schedule.name=step",
            "optimizer.schedule.step_size=1",
            "optimizer.schedule.gamma=0.5",
        ],
        workers=(A,),
    )
    h.init(init_values(model))
    steps = run_rounds(h, model, 4)
    check_steps(h, steps, [0.2 * 0.5**k for k in range(4)])
    assert h.shards[0].stats()["lr"] == pytest.approx(0.2 * 0.5**4, rel=1e-12)
    assert h.shards[0].policy.updater.updates == 4


def test_step_schedule_with_step_size(harnesses):
    model = tiny_model()
    h = harnesses(
        model,
        plain_sgd(0.2)
        + [
            "optimizer.schedule.name=step",
            "optimizer.schedule.step_size=2",
            "optimizer.schedule.gamma=0.1",
        ],
        workers=(A,),
    )
    h.init(init_values(model))
    steps = run_rounds(h, model, 5)
    assert [s[0] for s in steps] == pytest.approx([0.2, 0.2, 0.02, 0.02, 0.002], rel=1e-12)


def test_warmup_then_constant(harnesses):
    model = tiny_model()
    h = harnesses(model, plain_sgd(0.3) + ["optimizer.schedule.warmup_steps=3"], workers=(A,))
    h.init(init_values(model))
    steps = run_rounds(h, model, 5)
    check_steps(h, steps, [0.1, 0.2, 0.3, 0.3, 0.3])


def test_warmup_then_step(harnesses):
    model = tiny_model()
    h = harnesses(
        model,
        plain_sgd(0.4)
        + [
            "optimizer.schedule.warmup_steps=2",
            "optimizer.schedule.name=step",
            "optimizer.schedule.step_size=1",
            "optimizer.schedule.gamma=0.5",
        ],
        workers=(A,),
    )
    h.init(init_values(model))
    steps = run_rounds(h, model, 5)
    assert [s[0] for s in steps] == pytest.approx([0.2, 0.4, 0.4, 0.2, 0.1], rel=1e-12)


def test_sync_schedule_counts_rounds_not_pushes(harnesses):
    model = tiny_model()
    h = harnesses(
        model,
        plain_sgd(0.2)
        + [
            "optimizer.schedule.name=step",
            "optimizer.schedule.step_size=1",
            "optimizer.schedule.gamma=0.5",
        ],
    )
    h.init(init_values(model))
    for clock in range(3):
        h.push(A, clock, fake_push(model, clock), base_version=clock)
        assert h.shards[0].stats()["lr"] == pytest.approx(0.2 * 0.5**clock)
        h.push(B, clock, fake_push(model, clock + 10), base_version=clock)
        assert h.shards[0].stats()["lr"] == pytest.approx(0.2 * 0.5 ** (clock + 1))
    assert h.versions() == [3]
