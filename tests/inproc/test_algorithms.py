"""The shard rules of eager, cpsgd, adpsgd, wpsgd and simuparallel against
hand computations, driven through ps.shard.Shard over the in-process
`mem://` transport (the ShardHarness of shard_harness.py, as in test_shard.py:
send, let the shard serve its inbox, then wait; a reply that must not have
come is a short wait that times out)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from shard_harness import ShardHarness, closing_factory, tiny_model

from hetps.proto.errors import ProtocolError
from hetps.proto.messages import Params, Status
from hetps.proto.rpc import RemoteError, RequestTimeout, RpcClient
from hetps.ps.averaging_rules import VariancePeriod, equal_weights, wpsgd_weights
from hetps.training.state import model_specs, model_tensors
from hetps.training.straggler import straggler_of

PLAN_ID = 1
W = [11, 12, 13, 14, 15]  # worker node ids
TIGHT = dict(rtol=1e-6, atol=1e-6)
PLAIN_SGD = [
    "optimizer.name=sgd",
    "optimizer.lr=0.1",
    "optimizer.momentum=0",
    "optimizer.weight_decay=0",
]


class Cluster(ShardHarness):
    """The shards of a plan over tiny_model()'s tensors and the first `n_workers`
    of W, initialised (by W[0]) with the model's values, kept as `initial`."""

    def __init__(
        self,
        algorithm: str,
        overrides: list[str],
        n_workers: int = 4,
        n_shards: int = 1,
        groups: list[list[int]] = (),
    ):
        self.model = tiny_model()
        self.workers = W[:n_workers]
        super().__init__(
            model_specs(self.model),
            overrides,
            self.workers,
            n_shards,
            algorithm,
            plan_id=PLAN_ID,
            groups=groups,
        )
        self.initial = self.tensors(seed=None)
        self.init(self.initial, self.workers[0])

    def tensors(self, seed: int | None, scale: float = 1.0) -> dict[str, torch.Tensor]:
        """Initial values (seed None), or random values of every tensor (a gradient or a model)."""
        if seed is None:
            return {n: t.detach().clone() for n, (t, _) in model_tensors(self.model).items()}
        g = torch.Generator().manual_seed(seed)
        out = {}
        for n, (t, kind) in model_tensors(self.model).items():
            out[n] = (
                torch.randn(t.shape, generator=g) * scale
                if t.is_floating_point()
                else torch.tensor(seed % 50, dtype=t.dtype)
            )
        return out

    def pull(self, node: int, clock: int) -> list[tuple[RpcClient, int]]:
        return [(self.client(node, i), req) for i, req in enumerate(self.send_pull(node, clock))]


@pytest.fixture
def clusters():
    yield from closing_factory(Cluster)


def answered(reqs, timeout_s: float = 0.05) -> list[Params] | None:
    """The replies to `reqs`, or None when the first one has not come yet."""
    try:
        return [c.wait(r, timeout_s=timeout_s) for c, r in reqs]
    except RequestTimeout:
        return None


def assert_close(actual: dict, expected: dict, names) -> None:
    for n in names:
        torch.testing.assert_close(actual[n], expected[n], **TIGHT, msg=lambda m, n=n: f"{n}: {m}")


def sgd_step(values: dict, grads: list[dict], names, lr: float, p: int) -> dict:
    """Plain SGD on sum(grads) / p: missing workers count as zero."""
    return {n: values[n] - lr * sum(g[n] for g in grads) / p for n in names}


# ---------------------------------------------------------------- eager


def test_solo_closes_on_the_first_fresh_push(clusters):
    c = clusters("eager", PLAIN_SGD + ["algorithm.quorum=solo", "algorithm.limiter=0"])
    names = c.params()
    g = [c.tensors(seed=s) for s in range(4)]
    (ack,) = c.push(W[0], 0, g[0], base_version=0)
    assert ack.version == 1 and c.versions() == [1]  # one fresh push closed round 0
    expected = sgd_step(c.initial, [g[0]], names, 0.1, 4)
    assert_close(c.values(), expected, names)
    assert answered(c.pull(W[0], 1)) is not None
    # W1 computed on version 0: late; it waits in the open round and does not close it
    (ack,) = c.push(W[1], 0, g[1], base_version=0)
    assert ack.version == 1 and ack.staleness == 1
    assert answered(c.pull(W[1], 1)) is not None, "a late pusher is answered at once"
    # W2's fresh push closes round 1 with W2's and the late W1's gradient
    (ack,) = c.push(W[2], 0, g[2], base_version=1)
    assert ack.version == 2
    assert_close(c.values(), sgd_step(expected, [g[1], g[2]], names, 0.1, 4), names)
    stats = c.shards[0].stats()
    assert (stats["rounds"], stats["fresh"], stats["late"]) == (2, 2, 1)


@pytest.mark.parametrize("p,quorum", [(3, 2), (4, 2), (5, 3)])
def test_majority_closes_on_ceil_half_and_applies_sum_over_p(clusters, p, quorum):
    opt = [
        "optimizer.name=sgd",
        "optimizer.lr=0.1",
        "optimizer.momentum=0.9",
        "optimizer.weight_decay=1e-3",
    ]
    c = clusters(
        "eager", opt + ["algorithm.quorum=majority", "algorithm.limiter=0"], n_workers=p, n_shards=2
    )
    names = c.params()
    ref = tiny_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    for rnd in range(2):  # two rounds: the momentum buffer matters
        grads = [c.tensors(seed=10 * rnd + i) for i in range(quorum)]
        first = None
        for i, g in enumerate(grads):
            assert c.versions() == [rnd, rnd]
            acks = c.push(W[i], rnd, g, base_version=rnd)
            assert [a.staleness for a in acks] == [0, 0]
            if i == 0:
                first = c.pull(W[0], rnd + 1)
            if i < quorum - 1:
                assert answered(first) is None, f"closed after {i + 1} of {quorum} fresh pushes"
        assert c.versions() == [rnd + 1, rnd + 1]
        replies = answered(first, timeout_s=2.0)
        assert replies and all(r.version == rnd + 1 for r in replies)
        for name, prm in ref.named_parameters():  # the workers that did not push count as zero
            prm.grad = sum(g[name] for g in grads) / p
        ref_opt.step()
        assert_close(c.values(), dict(ref.named_parameters()), names)


def test_late_gradient_is_counted_once_in_the_next_round(clusters):
    c = clusters("eager", PLAIN_SGD + ["algorithm.quorum=majority", "algorithm.limiter=0"])
    names = c.params()
    g = {(w, k): c.tensors(seed=100 * w + k) for w in W[:4] for k in range(3)}
    c.push(W[0], 0, g[W[0], 0], base_version=0)
    c.push(W[1], 0, g[W[1], 0], base_version=0)
    after0 = sgd_step(c.initial, [g[W[0], 0], g[W[1], 0]], names, 0.1, 4)
    assert c.versions() == [1]
    # W2's gradient of round 0 arrives after the round closed: it joins round 1
    (ack,) = c.push(W[2], 0, g[W[2], 0], base_version=0)
    assert ack.staleness == 1 and c.versions() == [1]
    assert_close(c.values(), after0, names)
    c.push(W[2], 0, c.tensors(seed=999), base_version=0)  # a replay of the same push: ignored
    c.push(W[0], 1, g[W[0], 1], base_version=1)
    c.push(W[1], 1, g[W[1], 1], base_version=1)
    after1 = sgd_step(after0, [g[W[0], 1], g[W[1], 1], g[W[2], 0]], names, 0.1, 4)
    assert c.versions() == [2]
    assert_close(c.values(), after1, names)
    # round 2 holds only its own pushes: the late gradient was not counted again
    c.push(W[0], 2, g[W[0], 2], base_version=2)
    c.push(W[1], 2, g[W[1], 2], base_version=2)
    assert_close(c.values(), sgd_step(after1, [g[W[0], 2], g[W[1], 2]], names, 0.1, 4), names)
    assert c.shards[0].stats()["late"] == 1


def test_every_limiter_round_is_a_full_barrier(clusters):
    c = clusters("eager", PLAIN_SGD + ["algorithm.quorum=solo", "algorithm.limiter=2"])
    c.push(W[0], 0, c.tensors(seed=1), base_version=0)
    assert c.versions() == [1]  # round 0: solo
    for i in range(3):  # round 1 is a barrier: three fresh pushes are not enough
        c.push(W[i], 1 if i == 0 else 0, c.tensors(seed=2 + i), base_version=1)
        assert c.versions() == [1]
    waiting = c.pull(W[0], 2)
    assert answered(waiting) is None
    c.push(W[3], 0, c.tensors(seed=9), base_version=0)  # the slow worker's (late) push completes it
    assert c.versions() == [2] and answered(waiting, timeout_s=2.0) is not None
    c.push(W[1], 1, c.tensors(seed=10), base_version=2)
    assert c.versions() == [3]  # round 2: solo again
    assert c.shards[0].stats()["barriers"] == 1


def test_random_initiator_closes_the_round(clusters):
    c = clusters(
        "eager", PLAIN_SGD + ["algorithm.quorum=random", "algorithm.limiter=0", "algorithm.seed=7"]
    )
    draw = random.Random(7)
    for rnd in range(3):
        initiator = draw.choice(W[:4])
        others = [w for w in W[:4] if w != initiator]
        c.push(others[0], rnd, c.tensors(seed=rnd), base_version=rnd)
        assert c.versions() == [rnd]
        c.push(others[1], rnd, c.tensors(seed=rnd + 80), base_version=rnd)
        assert c.versions() == [rnd]  # two fresh pushes, neither from the initiator
        c.push(initiator, rnd, c.tensors(seed=rnd + 50), base_version=rnd)
        assert c.versions() == [rnd + 1]


@pytest.mark.parametrize("mode", ["fold", "drop"])
def test_a_push_staler_than_the_bound_is_folded_or_dropped(clusters, mode):
    c = clusters(
        "eager",
        PLAIN_SGD
        + [
            "algorithm.quorum=solo",
            "algorithm.limiter=0",
            "algorithm.max_staleness=1",
            f"algorithm.too_stale={mode}",
        ],
    )
    names = c.params()
    for k in range(2):
        c.push(W[0], k, c.tensors(seed=k), base_version=k)
    before = c.values()
    stale = c.tensors(seed=42)
    (ack,) = c.push(W[1], 0, stale, base_version=0)  # two versions stale > 1
    assert ack.staleness == 2
    assert answered(c.pull(W[1], 1)) is not None
    fresh = c.tensors(seed=43)
    c.push(W[0], 2, fresh, base_version=2)
    applied = [fresh, stale] if mode == "fold" else [fresh]
    assert_close(c.values(), sgd_step(before, applied, names, 0.1, 4), names)
    assert c.shards[0].stats()["folded" if mode == "fold" else "dropped"] == 1


# ---------------------------------------------------------------- model averaging


def info(steps: int, lr: float = 0.1, wd: float = 0.0) -> dict:
    return {"steps": steps, "period": steps, "lr": lr, "weight_decay": wd}


def test_cpsgd_round_holds_the_mean_model(clusters):
    c = clusters("cpsgd", ["algorithm.period=5"], n_workers=3, n_shards=2)
    models = [c.tensors(seed=s) for s in range(3)]
    waiting = None
    for i, m in enumerate(models):
        acks = c.push(W[i], 0, m, info=info(5))
        assert all(a.info["period"] == 5 for a in acks)
        if i == 0:
            waiting = c.pull(W[0], 1)
        if i < 2:
            assert answered(waiting) is None and c.versions() == [0, 0]
    assert c.versions() == [1, 1]
    pulled = {}
    for reply in answered(waiting, timeout_s=2.0):
        pulled.update(reply.tensors)
    got = c.values()
    for name, kind in c.kinds.items():
        if got[name].is_floating_point():
            torch.testing.assert_close(got[name], sum(m[name] for m in models) / 3, **TIGHT)
        else:
            # a counter: max
            assert torch.equal(got[name], max([c.initial[name]] + [m[name] for m in models]))
    assert_close(pulled, got, got)
    params = c.params()
    variance = sum(float((m[n] - got[n]).pow(2).sum()) for m in models for n in params) / 3
    assert sum(s.stats()["variance"] for s in c.shards) == pytest.approx(variance, rel=1e-5)
    assert c.shards[0].stats()["rounds"] == 1
    # the server optimizer is bypassed: a replayed push changes nothing
    c.push(W[0], 0, c.tensors(seed=77), info=info(5))
    assert_close(c.values(), got, got)


@pytest.mark.parametrize("budget", [0, 40, 28])
def test_adpsgd_rule_grows_the_period_as_the_spread_shrinks_within_budget(budget):
    horizon = 400 if budget else 0
    rule = VariancePeriod(
        warmup_rounds=3, base_period=1.0, max_period=16, budget_rounds=budget, horizon_steps=horizon
    )
    periods, steps = [1, 1, 1], 0
    for r in range(60):  # the policy's order: observe round r-1, then plan round r+1 at round r
        if r >= 1:
            spread = 1.0 / (1 + 0.3 * (r - 1))  # decreasing per-step spread
            rule.observe(spread * periods[r - 1], periods[r - 1], 0.1)
        steps += periods[r]
        if r + 1 >= len(periods):
            periods.append(rule.next_period(steps, r + 1))
    assert all(a <= b for a, b in zip(periods, periods[1:])), periods
    assert periods[-1] > periods[3] >= 1
    assert periods[3] == (2 if budget != 28 else 13)  # short early unless the budget is tight
    if budget:
        ends = [sum(periods[: k + 1]) for k in range(len(periods))]
        assert sum(1 for e in ends if e <= horizon) <= budget


def test_adpsgd_rule_stays_at_period_1_while_the_spread_rises():
    rule = VariancePeriod(warmup_rounds=2, max_period=64, smoothing=0.5)
    periods = []
    for v in [1, 2, 4, 8, 16, 12, 8, 4, 2, 1]:
        rule.observe(v, 1, 0.1)
        periods.append(rule.next_period(0, 0))
    # smoothed: 1, 1.5, 2.75, 5.375, 10.69, 11.34 (peak), 9.67, 6.84, 4.42, 2.71
    assert periods == [1, 1, 1, 1, 1, 1, 2, 2, 3, 5]


def test_adpsgd_rule_hand_computed_and_rescaled_on_lr_change():
    rule = VariancePeriod(warmup_rounds=2, base_period=2.0, max_period=8)  # no smoothing
    rule.observe(4.0, 1, 0.1)  # peak 4
    assert rule.next_period(2, 2) == 2  # ceil(2 * 4 / 4)
    rule.observe(3.0, 2, 0.1)  # v = 1.5 -> ceil(2 * 4 / 1.5) = 6
    assert rule.next_period(4, 3) == 6
    # lr halved, v quartered: the same spread in lr units
    rule.observe(6 * 1.5 / 4, 6, 0.05)
    assert rule.next_period(10, 4) == 6
    # spread up to a new peak: the period never decreases
    rule.observe(8.0, 2, 0.05)
    assert rule.next_period(16, 5) == 6
    rule.observe(0.01, 6, 0.05)  # tiny spread: capped at max_period
    assert rule.next_period(22, 6) == 8


def test_adpsgd_shard_returns_the_rule_periods(clusters):
    """Two workers whose models sit at mean +- d: V = d^2 |u|^2. Per-step
    spread v_0 = 1, then v_r = 1 / (r + 0.5): round r+2 (planned at round
    r+1's first push, from the latest closed round r) gets ceil(v_0 / v_r)."""
    c = clusters(
        "adpsgd",
        ["algorithm.warmup_rounds=2", "algorithm.max_period=32", "algorithm.smoothing=1"],
        n_workers=2,
        n_shards=2,
    )
    center, u = c.tensors(seed=1), c.tensors(seed=2)
    norm2 = sum(float(u[n].pow(2).sum()) for n in c.params())
    periods = [1]
    for r in range(7):
        v = 1.0 if r == 0 else 1.0 / (r + 0.5)
        d = math.sqrt(v * periods[r] / norm2)
        for i, sign in enumerate((1, -1)):
            model = {
                n: center[n] + sign * d * u[n] if n in c.params() else center[n] for n in center
            }
            acks = c.push(W[i], r, model, info=info(periods[r]))
            proposals = {a.info["period"] for a in acks}
            assert len(proposals) == 1  # both shards see the same relative spread
        periods.append(proposals.pop())
        assert c.versions() == [r + 1, r + 1]
    assert periods == [1, 1, 1, 2, 3, 4, 5, 6]


def test_wpsgd_weights_by_hand():
    steps, lr, wd = [10, 20, 40], 0.1, 0.01
    raw = [1 - 0.999**10, 1 - 0.999**20, 1 - 0.999**40]
    assert wpsgd_weights(steps, lr, wd) == pytest.approx([r / sum(raw) for r in raw], rel=1e-12)
    assert wpsgd_weights([7, 7, 7], lr, wd) == pytest.approx([1 / 3] * 3, rel=1e-12)
    # wd 0: T_i
    assert wpsgd_weights(steps, lr, 0.0) == pytest.approx([1 / 7, 2 / 7, 4 / 7], rel=1e-12)
    assert equal_weights(steps, lr, wd) == pytest.approx([1 / 3] * 3)


@pytest.mark.parametrize("algorithm", ["wpsgd", "simuparallel"])
def test_weighted_round_mean_and_reported_weights(clusters, algorithm):
    c = clusters(algorithm, [], n_workers=3)
    steps = [10, 20, 40]
    models = [c.tensors(seed=s) for s in range(3)]
    acks = [
        c.push(W[i], 0, m, info=info(steps[i], lr=0.1, wd=0.01))[0] for i, m in enumerate(models)
    ]
    expected = wpsgd_weights(steps, 0.1, 0.01) if algorithm == "wpsgd" else [1 / 3] * 3
    # the closing push sees them
    assert acks[-1].info["weights"] == pytest.approx(expected, rel=1e-5)
    assert c.shards[0].stats()["weights"] == pytest.approx(expected, rel=1e-5)
    got = c.values()
    for n in c.params():
        torch.testing.assert_close(got[n], sum(w * m[n] for w, m in zip(expected, models)), **TIGHT)
    # the evaluator's pull (clock -1) is never parked, even with a round open
    c.push(W[0], 1, models[0], info=info(3))
    (reply,) = answered(c.pull(W[1], -1))
    assert reply.version == 1


@pytest.mark.parametrize(
    "bad_info,clock,status",
    [
        ({"steps": "many"}, 0, Status.MALFORMED),
        ({"lr": float("nan")}, 0, Status.MALFORMED),
        ({"steps": -3}, 0, Status.MALFORMED),
        ({"bogus": 1}, 0, Status.MALFORMED),
        ({"steps": 4}, 1, Status.BAD_STATE),  # round 1 is not open before round 0 closed
    ],
)
def test_a_bad_model_push_is_refused_and_leaves_no_trace(clusters, bad_info, clock, status):
    c = clusters("cpsgd", ["algorithm.period=4"], n_workers=2)
    models = [c.tensors(seed=s) for s in range(2)]
    # a bad info is refused where the PUSH is made (records.PushInfo), in a sender as at decode
    with pytest.raises((RemoteError, ProtocolError)) as refused:
        c.push(W[0], clock, c.tensors(seed=9), info=bad_info)
    assert refused.value.status == status
    c.push(W[0], 0, models[0], info=info(4))  # the same round, now valid: taken
    c.push(W[1], 0, models[1], info=info(4))
    assert c.versions() == [1]
    got = c.values()
    for n in c.params():
        torch.testing.assert_close(got[n], (models[0][n] + models[1][n]) / 2, **TIGHT)


# ---------------------------------------------------------------- worker-side helpers


def test_straggler_draw_is_shared_and_spread():
    draws = [straggler_of(0, s, 4) for s in range(800)]
    assert draws == [straggler_of(0, s, 4) for s in range(800)]  # every worker computes the same
    assert all(150 < draws.count(i) < 250 for i in range(4))


# ---------------------------------------------------------------- grouping: momentum correction
@pytest.mark.parametrize("correct, groups", [(True, 2), (True, 3), (False, 3)])
def test_grouping_momentum_correction_lowers_each_group_updates_momentum(clusters, correct, groups):
    """`algorithm.momentum_correction`: with G asynchronous groups a group's update steps
    with momentum max(0, m - (1 - 1/G)), the buffer shared (Mitliagkas et al., 2016); off,
    with m. Each group is one worker, lr / staleness as always; against torch's own SGD."""
    m = 0.9
    opt_keys = ["optimizer.lr=0.1", f"optimizer.momentum={m}", "optimizer.weight_decay=1e-3"]
    c = clusters(
        "grouping",
        [
            *opt_keys,
            f"algorithm.momentum_correction={str(correct).lower()}",
            "algorithm.optimizer_state=shared",
        ],
        n_workers=groups,
        groups=[[w] for w in W[:groups]],
    )
    names = c.params()
    ref = [torch.nn.Parameter(c.initial[n].clone()) for n in names]
    used = max(0.0, m - (1 - 1 / groups)) if correct else m
    opt = torch.optim.SGD(ref, lr=0.1, momentum=used, weight_decay=1e-3)
    version = 0
    for step in range(2):  # every group twice: the shared buffer carries over
        for i, w in enumerate(c.workers):
            g = c.tensors(seed=100 * step + i)
            (ack,) = c.push(w, step, g, base_version=version)
            # 1 + the other groups' updates since this group's last (none before the first)
            staleness = groups if step else i + 1
            for p, n in zip(ref, names):
                p.grad = g[n].clone()
            opt.param_groups[0]["lr"] = 0.1 / staleness
            opt.step()
            version += 1
            assert ack.version == version
    assert_close(c.values(), dict(zip(names, ref)), names)
