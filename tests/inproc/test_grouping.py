"""Grouping-SGD: the scheduler's pure functions (k-means groups, data shares,
drift, speed-ranked placement) and the shard's group policy driven
in-process over mem://, with updates checked against hand computations.

The shard harness (shard_harness.py) here runs on a model-free tensor list,
one RpcClient per worker node id: a request is `send`, the shard runs
`serve_once` until its inbox is empty, then the client `wait`s; a reply that
must NOT have come yet (a parked pull) is checked with a short `wait` that
times out.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from shard_harness import PLAN_ID, ShardHarness, closing_factory, not_answered

from hetps.proto.messages import Ack, Params
from hetps.proto.plan import ClusterPlan, NodeEntry, TensorSpec
from hetps.runconfig.algorithm_params import GroupingParams
from hetps.scheduler.grouping import calinski_harabasz, data_shares, drifted, form_groups, kmeans_1d
from hetps.scheduler.placement import place
from hetps.training.data import partition

# ================================================================ form_groups


def check_partition(groups: list[list[int]], speeds: dict[int, float]) -> None:
    """Every worker exactly once, no empty group, members sorted by id, fastest
    group first, and (1-D k-means) each group a contiguous run of the speed order."""
    flat = [w for g in groups for w in g]
    assert sorted(flat) == sorted(speeds), (groups, speeds)
    assert len(flat) == len(set(flat)), groups
    assert all(g for g in groups), groups
    assert all(g == sorted(g) for g in groups), groups
    slowest = [min(speeds[w] for w in g) for g in groups]
    fastest = [max(speeds[w] for w in g) for g in groups]
    for i in range(len(groups) - 1):
        # group i entirely at least as fast as group i+1: fastest first, no interleaving
        assert slowest[i] >= fastest[i + 1], (groups, speeds)


def test_two_clear_tiers():
    speeds = {1: 100.0, 2: 98.0, 3: 33.0, 4: 34.0}
    groups = form_groups(speeds, GroupingParams())
    assert groups == [[1, 2], [3, 4]]
    # the order of the dict does not matter, ids do
    assert form_groups(dict(reversed(list(speeds.items()))), GroupingParams()) == [[1, 2], [3, 4]]


def test_fastest_group_first_even_when_fast_workers_have_high_ids():
    speeds = {1: 10.0, 2: 11.0, 3: 100.0, 4: 95.0}
    assert form_groups(speeds, GroupingParams()) == [[3, 4], [1, 2]]


def test_three_tiers():
    speeds = dict(zip(range(10, 16), [100.0, 90.0, 50.0, 48.0, 10.0, 11.0]))
    groups = form_groups(speeds, GroupingParams())
    assert groups == [[10, 11], [12, 13], [14, 15]]


def test_explicit_k():
    speeds = dict(zip(range(6), [100.0, 90.0, 50.0, 48.0, 10.0, 11.0]))
    two = form_groups(speeds, GroupingParams(groups=2))
    assert len(two) == 2
    check_partition(two, speeds)
    # k-means on log speeds: 10/11 are 5x slower than 48/50, which are 2x slower than 90/100
    assert two == [[0, 1, 2, 3], [4, 5]]
    assert form_groups(speeds, GroupingParams(groups=3)) == [[0, 1], [2, 3], [4, 5]]
    assert len(form_groups(speeds, GroupingParams(groups=6))) == 6
    # explicit k wins over "all within equal_ratio"
    close = {1: 100.0, 2: 99.0, 3: 98.0, 4: 97.0}
    assert form_groups(close, GroupingParams(groups=2)) == [[1, 2], [3, 4]]


@pytest.mark.parametrize(
    "params",
    [
        GroupingParams(),
        GroupingParams(groups=3),
        GroupingParams(choose_k="ch"),
        GroupingParams(equal_ratio=1.0),
        GroupingParams(max_groups=1),
    ],
    ids=["ratio", "k=3", "ch", "equal_ratio=1", "max_groups=1"],
)
def test_one_worker_is_one_group(params):
    assert form_groups({7: 3.5}, params) == [[7]]


@pytest.mark.parametrize(
    "params",
    [
        GroupingParams(),
        GroupingParams(groups=3),
        GroupingParams(choose_k="ch"),
        GroupingParams(equal_ratio=1.0),
    ],
    ids=["ratio", "k=3", "ch", "equal_ratio=1"],
)
def test_equal_speeds_are_one_group(params):
    speeds = {w: 42.0 for w in (3, 1, 2, 5, 4)}
    assert form_groups(speeds, params) == [[1, 2, 3, 4, 5]]


def test_no_workers():
    assert form_groups({}, GroupingParams()) == []


def test_k_capped_by_distinct_speeds():
    speeds = {1: 100.0, 2: 100.0, 3: 30.0, 4: 30.0}
    groups = form_groups(speeds, GroupingParams(groups=4))
    assert groups == [[1, 2], [3, 4]]
    assert form_groups({1: 5.0, 2: 1.0}, GroupingParams(groups=9)) == [[1], [2]]


def test_max_groups_bounds_the_automatic_k():
    speeds = dict(zip(range(6), [100.0, 90.0, 50.0, 48.0, 10.0, 11.0]))
    for choose_k in ("ratio", "ch"):
        assert form_groups(speeds, GroupingParams(max_groups=1, choose_k=choose_k)) == [
            list(range(6))
        ]
        groups = form_groups(speeds, GroupingParams(max_groups=2, choose_k=choose_k))
        assert len(groups) == 2
        check_partition(groups, speeds)


def test_choose_k_ch_returns_a_partition():
    speeds = {1: 100.0, 2: 98.0, 3: 33.0, 4: 34.0}
    groups = form_groups(speeds, GroupingParams(choose_k="ch"))
    check_partition(groups, speeds)
    assert 2 <= len(groups) <= 3  # CH may over-split the tiny clusters (module docstring)
    assert groups[0] in ([1, 2], [1])


def test_the_same_speeds_in_any_order_give_the_same_groups():
    rng = random.Random(3)
    speeds = {w: rng.uniform(1, 100) for w in range(8)}
    shuffled = list(speeds.items())
    rng.shuffle(shuffled)
    for params in (GroupingParams(), GroupingParams(choose_k="ch"), GroupingParams(groups=3)):
        assert form_groups(speeds, params) == form_groups(dict(shuffled), params)


def brute_force_kmeans_cost(values: list[float], k: int) -> float:
    """The least within-cluster sum of squares over every partition of the
    sorted values into k runs (the optimal 1-D clusters are runs)."""
    import itertools

    xs = sorted(values)
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(xs)), k - 1):
        bounds = (0, *cuts, len(xs))
        runs = [xs[a:b] for a, b in zip(bounds, bounds[1:])]
        best = min(best, sum(sum((v - sum(r) / len(r)) ** 2 for v in r) for r in runs))
    return best


def test_kmeans_1d_finds_the_optimal_clusters():
    """Against every partition into k runs (brute force) on random values,
    ties and duplicates included; labels come back in input order."""
    rng = random.Random(7)
    for case in range(150):
        n = rng.randint(1, 9)
        values = (
            [rng.uniform(-3, 5) for _ in range(n)]
            if case % 3
            else [rng.choice([0.5, 1.0, 2.5]) for _ in range(n)]
        )
        k = rng.randint(1, n)
        labels = kmeans_1d(values, k)
        assert len(labels) == n and set(labels) <= set(range(k))
        clusters = [[v for v, c in zip(values, labels) if c == j] for j in set(labels)]
        cost = sum(sum((v - sum(c) / len(c)) ** 2 for v in c) for c in clusters)
        assert cost == pytest.approx(brute_force_kmeans_cost(values, k), abs=1e-9), (
            values,
            k,
            labels,
        )
    assert kmeans_1d([5.0, 1.0, 5.1, 1.1], 2) in ([1, 0, 1, 0], [0, 1, 0, 1])


def test_calinski_harabasz_by_hand():
    # clusters {0, 2} and {10}: means 1 and 10, overall 4; between = 2 * 9 + 1 * 36 = 54,
    # within = 2; score = (54 / (2 - 1)) / (2 / (3 - 2)) = 27
    assert calinski_harabasz([0.0, 2.0, 10.0], [0, 0, 1]) == pytest.approx(27.0)
    # every cluster a point: defined as 1
    assert calinski_harabasz([1.0, 1.0, 4.0], [0, 0, 1]) == 1.0


def random_speeds(rng: random.Random) -> dict[int, float]:
    n = rng.randint(1, 8)
    ids = rng.sample(range(1, 200), n)
    style = rng.choice(["uniform", "ints", "ties", "wide"])
    if style == "uniform":
        return {w: rng.uniform(1, 100) for w in ids}
    if style == "ints":
        return {w: float(rng.randint(1, 100)) for w in ids}
    if style == "ties":
        levels = [rng.uniform(1, 100) for _ in range(rng.randint(1, 3))]
        return {w: rng.choice(levels) for w in ids}
    return {w: 10 ** rng.uniform(-2, 4) for w in ids}


def test_random_speeds_always_give_a_partition():
    rng = random.Random(1234)
    modes = [
        GroupingParams(),
        GroupingParams(choose_k="ch"),
        GroupingParams(groups=2),
        GroupingParams(groups=3),
        GroupingParams(max_groups=2),
        GroupingParams(equal_ratio=1.0),
    ]
    for case in range(200):
        speeds = random_speeds(rng)
        params = modes[case % len(modes)]
        groups = form_groups(speeds, params)
        check_partition(groups, speeds)
        distinct = len({round(s, 6) for s in speeds.values()})
        if params.groups:
            assert len(groups) == min(params.groups, distinct), (speeds, params, groups)
        else:
            assert 1 <= len(groups) <= min(params.max_groups, distinct), (speeds, params, groups)
        if params.groups == 0 and max(speeds.values()) / min(speeds.values()) < params.equal_ratio:
            assert len(groups) == 1


def test_random_well_separated_tiers_are_recovered():
    """Tiers a factor 3 apart with +-2% noise: ratio mode finds exactly the tiers.
    (With +-5% noise, k-means on linear speeds may instead split the fastest
    tier, whose absolute spread is largest, and merge the two slowest tiers.)"""
    rng = random.Random(99)
    for _ in range(40):
        n_tiers = rng.randint(1, 4)
        base = rng.uniform(1, 50)
        speeds, tier = {}, {}
        ids = iter(rng.sample(range(1, 500), 4 * 3))
        for t in range(n_tiers):
            for _ in range(rng.randint(1, 3)):
                w = next(ids)
                speeds[w] = base * 3**t * rng.uniform(0.98, 1.02)
                tier[w] = t
        expected = [sorted(w for w in speeds if tier[w] == t) for t in reversed(range(n_tiers))]
        assert form_groups(speeds, GroupingParams()) == expected, speeds


# ================================================================ data shares


def test_share_is_the_slowest_speed_in_the_group():
    speeds = {1: 100.0, 2: 98.0, 3: 33.0, 4: 34.0}
    groups = [[1, 2], [3, 4]]
    assert data_shares(groups, speeds) == {1: 98.0, 2: 98.0, 3: 33.0, 4: 33.0}
    assert data_shares([[1, 2, 3, 4]], speeds) == {w: 33.0 for w in speeds}
    assert data_shares([[w] for w in speeds], speeds) == speeds


def check_partition_by_weights(n: int, weights: list[float], seed: int) -> None:
    world = len(weights)
    shares = [partition(n, r, world, seed, weights) for r in range(world)]
    everything = torch.cat(shares)
    assert everything.dtype == torch.int64
    assert sorted(everything.tolist()) == list(range(n))  # disjoint and covering
    total = sum(weights)
    for r, share in enumerate(shares):
        assert abs(len(share) - n * weights[r] / total) <= 1, (n, weights, [len(s) for s in shares])


def test_shares_partition_the_data_in_proportion():
    speeds = {1: 100.0, 2: 98.0, 3: 33.0, 4: 34.0}
    groups = form_groups(speeds, GroupingParams())
    shares = data_shares(groups, speeds)
    workers = sorted(speeds)
    weights = [shares[w] for w in workers]
    check_partition_by_weights(1000, weights, seed=7)
    sizes = [len(partition(1000, r, 4, 7, weights)) for r in range(4)]
    assert sizes[0] == sizes[1] and abs(sizes[2] - sizes[3]) <= 1  # same group, same share
    assert sizes[0] > 2.5 * sizes[2]

    # the same through the plan, the way workers read it
    plan = ClusterPlan(
        plan_id=1,
        algorithm="grouping",
        workers=[NodeEntry(w, r) for r, w in enumerate(workers)],
        shards=[],
        tensors=[],
        placement={},
        groups=groups,
        shares={str(w): s for w, s in shares.items()},
    )
    assert plan.share_weights() == weights


def test_random_weighted_partitions():
    rng = random.Random(5)
    for _ in range(100):
        world = rng.randint(1, 7)
        weights = [
            rng.choice([rng.uniform(0.1, 100), float(rng.randint(1, 5))]) for _ in range(world)
        ]
        check_partition_by_weights(rng.randint(0, 3000), weights, seed=rng.randint(0, 10**6))


# ================================================================ drift


def test_drift_hysteresis_both_ways():
    old = {1: 100.0, 2: 50.0}
    assert not drifted(old, dict(old), 0.3)
    assert not drifted(old, {1: 129.0, 2: 50.0}, 0.3)
    assert drifted(old, {1: 131.0, 2: 50.0}, 0.3)
    assert not drifted(old, {1: 71.0, 2: 50.0}, 0.3)
    assert drifted(old, {1: 69.0, 2: 50.0}, 0.3)
    # relative to each worker's own old speed, not the fastest
    assert not drifted(old, {1: 100.0, 2: 64.0}, 0.3)
    assert drifted(old, {1: 100.0, 2: 66.0}, 0.3)
    assert drifted(old, {1: 100.0, 2: 34.0}, 0.3)
    assert not drifted(old, {1: 125.0, 2: 40.0}, 0.3)
    assert drifted(old, {1: 125.0, 2: 40.0}, 0.1)


def test_drift_on_worker_set_change():
    old = {1: 100.0, 2: 50.0}
    assert drifted(old, {1: 100.0}, 0.3)
    assert drifted(old, {1: 100.0, 2: 50.0, 3: 50.0}, 0.3)
    assert drifted(old, {1: 100.0, 3: 50.0}, 0.3)
    assert not drifted({}, {}, 0.3)


def test_drift_from_zero_speed():
    assert drifted({1: 0.0}, {1: 1.0}, 0.3)
    assert not drifted({1: 0.0}, {1: 0.0}, 0.3)


# ================================================================ placement


def specs(sizes: list[int], dtype: str = "float32") -> list[TensorSpec]:
    return [TensorSpec(f"layer{i}.weight", dtype, (n,)) for i, n in enumerate(sizes)]


def shard_bytes(tensors: list[TensorSpec], placement: dict[str, int], n_shards: int) -> list[int]:
    out = [0] * n_shards
    for t in tensors:
        out[placement[t.name]] += t.nbytes
    return out


def check_placement(tensors: list[TensorSpec], placement: dict[str, int], n_shards: int) -> None:
    assert set(placement) == {t.name for t in tensors}
    order = [placement[t.name] for t in tensors]
    if order:
        assert order[0] == 0  # the bottom layer on the fastest shard
    assert all(0 <= k < n_shards for k in order)
    # contiguous, no shard skipped
    assert all(b - a in (0, 1) for a, b in zip(order, order[1:])), order
    if len(tensors) >= n_shards:
        assert set(order) == set(range(n_shards)), order


def test_two_to_one_speeds_give_two_thirds_of_the_bytes():
    tensors = specs([100] * 30)
    placement = place(tensors, [2.0, 1.0])
    check_placement(tensors, placement, 2)
    assert shard_bytes(tensors, placement, 2) == [8000, 4000]


def test_bytes_per_speed_balanced_within_the_largest_tensor():
    rng = random.Random(11)
    for _ in range(200):
        sizes = [
            rng.choice([1, rng.randint(1, 500), rng.randint(1, 50000)])
            for _ in range(rng.randint(2, 25))
        ]
        tensors = specs(sizes)
        speeds = [2.0, 1.0]
        placement = place(tensors, speeds)
        check_placement(tensors, placement, 2)
        b = shard_bytes(tensors, placement, 2)
        largest = max(t.nbytes for t in tensors)
        assert abs(b[0] / speeds[0] - b[1] / speeds[1]) <= largest, (sizes, b)


def test_many_shards_even_tensors():
    tensors = specs([64] * 80)
    placement = place(tensors, [4.0, 2.0, 1.0, 1.0])
    check_placement(tensors, placement, 4)
    assert shard_bytes(tensors, placement, 4) == [256 * 40, 256 * 20, 256 * 10, 256 * 10]


def test_random_placements_are_contiguous_and_cover_every_shard():
    rng = random.Random(21)
    for _ in range(300):
        n_shards = rng.randint(1, 5)
        tensors = specs(
            [
                rng.choice([0, 1, rng.randint(1, 1000), rng.randint(1, 100000)])
                for _ in range(rng.randint(0, 20))
            ]
        )
        speeds = [rng.uniform(0.05, 10) for _ in range(n_shards)]
        placement = place(tensors, speeds)
        check_placement(tensors, placement, n_shards)


def test_one_tensor_two_shards():
    tensors = specs([10])
    assert place(tensors, [1.0, 1.0]) == {"layer0.weight": 0}
    assert place(tensors, [1.0, 100.0]) == {"layer0.weight": 0}
    assert place([], [1.0, 2.0]) == {}


def test_a_huge_first_tensor_still_stays_on_shard_zero():
    tensors = specs([10**6, 4, 4, 4])
    placement = place(tensors, [1.0, 1.0])
    check_placement(tensors, placement, 2)
    assert [placement[t.name] for t in tensors] == [0, 1, 1, 1]


@pytest.mark.parametrize(
    "speeds",
    [[], [0.0, 1.0], [1.0, -2.0], [float("nan"), 1.0], [1.0, float("inf")]],
    ids=["none", "zero", "negative", "nan", "inf"],
)
def test_invalid_speeds(speeds):
    with pytest.raises(ValueError):
        place(specs([10, 10]), speeds)


# ================================================================ the shard's group policy

A, B, C, D = 11, 12, 13, 14
TENSORS = [TensorSpec("w", "float32", (2, 3)), TensorSpec("b", "float32", (3,))]
LR = 0.5


def plain_sgd(lr: float = LR) -> list[str]:
    return [
        "optimizer.name=sgd",
        f"optimizer.lr={lr}",
        "optimizer.momentum=0",
        "optimizer.weight_decay=0",
    ]


def grad(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in TENSORS}


def initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {t.name: torch.randn(t.shape, generator=g) for t in TENSORS}


def mean(*grads: dict) -> dict:
    return {n: sum(g[n].double() for g in grads) / len(grads) for n in grads[0]}


def sgd_step(params: dict, g: dict, lr: float) -> dict:
    """The hand computation: plain SGD in float64."""
    return {n: params[n].double() - lr * g[n].double() for n in params}


class GroupHarness(ShardHarness):
    """The shards of a plan over TENSORS with `groups`; every push must be acknowledged."""

    def __init__(
        self,
        overrides: list[str],
        groups: list[list[int]],
        algorithm: str = "grouping",
        workers=(A, B, C, D),
        n_shards: int = 1,
    ):
        super().__init__(TENSORS, overrides, workers, n_shards, algorithm, groups=groups)

    def push(self, node: int, clock: int, tensors: dict, base_version: int = 0) -> list[Ack]:
        acks = super().push(node, clock, tensors, base_version)
        assert all(isinstance(a, Ack) for a in acks), acks
        return acks

    def parked(self, node: int, reqs: list[int]) -> bool:
        return all(not_answered(self.client(node, i), req) for i, req in enumerate(reqs))

    def answered(self, node: int, reqs: list[int]) -> tuple[list[int], dict]:
        self.serve()
        versions, tensors = [], {}
        for i, req in enumerate(reqs):
            reply = self.client(node, i).wait(req, timeout_s=2.0)
            assert isinstance(reply, Params)
            versions.append(reply.version)
            tensors.update(reply.tensors)
        return versions, tensors


@pytest.fixture
def harness():
    yield from closing_factory(GroupHarness)


def assert_values(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected)
    for n in expected:
        torch.testing.assert_close(
            actual[n],
            expected[n].to(actual[n].dtype),
            rtol=1e-6,
            atol=1e-6,
            msg=lambda m, n=n: f"{n}: {m}",
        )


def assert_group_stats(h: GroupHarness, updates: dict, staleness: dict) -> None:
    got = [(s["group_updates"], s["group_staleness"]) for s in h.stats()]
    assert got == [(updates, staleness)] * len(h.shards)


@pytest.mark.parametrize("n_shards", [1, 2])
def test_groups_update_independently_with_lr_over_staleness(harness, n_shards):
    h = harness(plain_sgd(), groups=[[A, B], [C, D]], n_shards=n_shards)
    h.init(initial())
    expected = initial()
    ga, gb, gc, gd = grad(1), grad(2), grad(3), grad(4)

    # C pushes first and then waits for its group: its pull is parked
    acks = h.push(C, 0, gc)
    assert [a.version for a in acks] == [0] * n_shards
    c_pull = h.send_pull(C, 1)
    assert h.parked(C, c_pull)
    assert_values(h.values(), expected)

    # group 0 closes its round without waiting for group 1: staleness 1, plain lr
    h.push(A, 0, ga)
    assert h.versions() == [0] * n_shards
    acks = h.push(B, 0, gb)
    assert [a.version for a in acks] == [1] * n_shards
    expected = sgd_step(expected, mean(ga, gb), LR)
    assert_values(h.values(), expected)
    assert h.parked(C, c_pull), "a pull of group 1 was answered by group 0's update"
    versions, pulled = h.answered(A, h.send_pull(A, 1))  # A's own pull is ready at once
    assert versions == [1] * n_shards
    assert_values(pulled, expected)
    assert_group_stats(h, {"0": 1}, {"0": 1})

    # group 0 again: no other group updated since its last update -> staleness 1
    ga2, gb2 = grad(5), grad(6)
    h.push(A, 1, ga2, base_version=1)
    h.push(B, 1, gb2, base_version=1)
    expected = sgd_step(expected, mean(ga2, gb2), LR)
    assert_values(h.values(), expected)
    assert h.versions() == [2] * n_shards
    assert_group_stats(h, {"0": 2}, {"0": 1})
    assert h.parked(C, c_pull)
    assert all(s["parked"] == 1 for s in h.stats())

    # D completes group 1's round: 2 updates by group 0 since group 1's last (none) -> staleness 3
    acks = h.push(D, 0, gd)
    assert [a.version for a in acks] == [3] * n_shards
    # per push: version at arrival - base_version
    assert [a.staleness for a in acks] == [2] * n_shards
    expected = sgd_step(expected, mean(gc, gd), LR / 3)
    assert_values(h.values(), expected)
    versions, pulled = h.answered(C, c_pull)
    assert versions == [3] * n_shards
    assert_values(pulled, expected)
    assert all(s["parked"] == 0 for s in h.stats())
    assert_group_stats(h, {"0": 2, "1": 1}, {"0": 1, "1": 3})

    # group 0 once more: one update by group 1 since its last -> staleness 2
    ga3, gb3 = grad(7), grad(8)
    h.push(A, 2, ga3, base_version=2)
    h.push(B, 2, gb3, base_version=2)
    expected = sgd_step(expected, mean(ga3, gb3), LR / 2)
    assert_values(h.values(), expected)
    assert h.versions() == [4] * n_shards
    # mean per group
    assert_group_stats(h, {"0": 3, "1": 1}, {"0": round((1 + 1 + 2) / 3, 3), "1": 3})
    # the lr the shard reports is the base lr again after each scaled update
    assert all(s["lr"] == pytest.approx(LR) for s in h.stats())


def test_scale_lr_false_uses_the_plain_lr(harness):
    h = harness(plain_sgd() + ["algorithm.scale_lr=false"], groups=[[A, B], [C, D]])
    h.init(initial())
    expected = initial()
    for clock in range(2):  # two group-0 updates first
        ga, gb = grad(10 + clock), grad(20 + clock)
        h.push(A, clock, ga, base_version=clock)
        h.push(B, clock, gb, base_version=clock)
        expected = sgd_step(expected, mean(ga, gb), LR)
    gc, gd = grad(30), grad(31)
    h.push(C, 0, gc)
    h.push(D, 0, gd)
    expected = sgd_step(expected, mean(gc, gd), LR)  # staleness 3, but no scaling
    assert_values(h.values(), expected)
    assert h.stats()[0]["group_staleness"] == {"0": 1, "1": 3}  # still measured


def test_regroup_closes_the_open_round_and_ignores_replays(harness):
    h = harness(plain_sgd(), groups=[[A, B], [C, D]])
    shard = h.shards[0]
    h.init(initial())
    expected = initial()
    accepted = 0  # pushes that are not duplicates

    ga, gb = grad(1), grad(2)
    h.push(A, 0, ga)
    h.push(B, 0, gb)
    accepted += 2
    expected = sgd_step(expected, mean(ga, gb), LR)

    # group 1 half-way: only C pushed; C waits for its round
    gc = grad(3)
    h.push(C, 0, gc)
    accepted += 1
    c_pull = h.send_pull(C, 1)
    assert h.parked(C, c_pull)
    assert_values(h.values(), expected)
    assert h.versions() == [1]
    assert shard.stats()["pending"] == 1

    new_plan = dataclasses.replace(h.plan, plan_id=PLAN_ID + 1, groups=[[A, B, C], [D]])
    shard.adopt(new_plan)
    h.plan_id = new_plan.plan_id  # the workers follow the new plan from their next push on
    h.serve()
    # the open round closed with C alone, once, lr / (1 + 1 update by group 0)
    expected = sgd_step(expected, gc, LR / 2)
    assert_values(h.values(), expected)
    assert h.versions() == [1 + 1]
    assert shard.stats()["group_updates"] == {"0": 1, "1": 1}
    assert shard.stats()["group_staleness"] == {"0": 1, "1": 2}
    assert shard.stats()["plan_id"] == PLAN_ID + 1
    assert shard.stats()["pending"] == 0
    versions, pulled = h.answered(C, c_pull)
    assert versions == [2]
    assert_values(pulled, expected)

    # a duplicate of C's earlier push (same clock, other payload) is ignored
    acks = h.push(C, 0, grad(99))
    assert acks[0].version == 2
    assert h.versions() == [2]
    assert_values(h.values(), expected)

    # the new groups: D alone updates at once; A, B, C form one round
    gd = grad(4)
    h.push(D, 0, gd)
    accepted += 1
    expected = sgd_step(expected, gd, LR)  # staleness restarts at the switch
    assert_values(h.values(), expected)
    ga2, gb2, gc2 = grad(5), grad(6), grad(7)
    h.push(A, 1, ga2, base_version=3)
    h.push(C, 1, gc2, base_version=3)
    assert h.versions() == [3]
    h.push(B, 1, gb2, base_version=3)
    accepted += 3
    # one update by D's group since the switch
    expected = sgd_step(expected, mean(ga2, gb2, gc2), LR / 2)
    assert_values(h.values(), expected)
    assert h.versions() == [4]

    policy = shard.policy
    stats = shard.stats()
    assert stats["pushes"] == accepted + 1  # the one duplicate
    assert (stats["accepted"], stats["duplicates"], stats["contributions"], stats["pending"]) == (
        accepted,
        1,
        accepted,
        0,
    )
    assert stats["group_updates"] == {"0": 2, "1": 2}
    assert policy.pushed == policy.applied == {A: 2, B: 2, C: 2, D: 1}
    assert sum(policy.applied.values()) == accepted
    assert not policy.rounds


def test_sync_is_one_group_whatever_the_plan_says(harness):
    h = harness(plain_sgd(), groups=[[A], [B]], algorithm="sync", workers=(A, B))
    h.init(initial())
    ga, gb = grad(1), grad(2)
    h.push(A, 0, ga)
    assert h.versions() == [0]  # A alone does not close the round
    a_pull = h.send_pull(A, 1)
    assert h.parked(A, a_pull)
    assert_values(h.values(), initial())
    h.push(B, 0, gb)
    assert h.versions() == [1]
    expected = sgd_step(initial(), mean(ga, gb), LR)
    assert_values(h.values(), expected)
    versions, pulled = h.answered(A, a_pull)
    assert versions == [1]
    assert_values(pulled, expected)


def test_grouping_with_singleton_groups_does_not_wait(harness):
    """The contrast to sync: the same plan under `grouping` updates per push."""
    h = harness(plain_sgd(), groups=[[A], [B]], workers=(A, B))
    h.init(initial())
    ga, gb = grad(1), grad(2)
    h.push(A, 0, ga)
    assert h.versions() == [1]
    expected = sgd_step(initial(), ga, LR)
    h.push(B, 0, gb)
    expected = sgd_step(expected, gb, LR / 2)
    assert_values(h.values(), expected)


def test_push_made_under_a_plan_the_shard_left_is_applied_alone(harness):
    """After a switch, a push still carrying the old plan id must not join a new
    round (another shard may have closed its twin in the flush): applied at once, as
    its share of its old group's round (C was one of 2: its gradient counts 1/2)."""
    h = harness(plain_sgd(), groups=[[A, B], [C, D]], workers=(A, B, C, D))
    shard = h.shards[0]
    h.init(initial())
    shard.adopt(dataclasses.replace(h.plan, plan_id=PLAN_ID + 1, groups=[[A, B, C, D]]))
    gc = grad(3)
    h.push(C, 0, gc)  # still plan PLAN_ID
    assert h.versions() == [1] and shard.stats()["pending"] == 0
    assert_values(h.values(), sgd_step(initial(), gc, LR / 2))
    versions, _ = h.answered(C, h.send_pull(C, 1))
    assert versions == [1]
    h.plan_id = PLAN_ID + 1
    h.push(A, 0, grad(1))  # under the new plan: waits for the whole new group
    assert h.versions() == [1] and shard.stats()["pending"] == 1


@pytest.mark.parametrize("algorithm", ["async", "ssp"])
def test_async_scale_lr_divides_the_lr_by_each_pushs_staleness(harness, algorithm):
    h = harness(
        plain_sgd() + [f"algorithm.name={algorithm}", "algorithm.scale_lr=true"],
        groups=[[A], [B]],
        algorithm=algorithm,
        workers=(A, B),
    )
    h.init(initial())
    expected = initial()
    ga, gb, ga2 = grad(1), grad(2), grad(3)
    # A and B both computed on version 0: A's push is fresh (staleness 0: the plain lr), B's one update stale
    h.push(A, 0, ga)
    expected = sgd_step(expected, ga, LR)
    acks = h.push(B, 0, gb)
    assert [a.staleness for a in acks] == [1]
    expected = sgd_step(expected, gb, LR)  # staleness 1: lr / 1
    h.push(A, 1, ga2)  # base version 0, two updates since: lr / 2
    expected = sgd_step(expected, ga2, LR / 2)
    assert_values(h.values(), expected)
    assert h.stats()[0]["lr"] == pytest.approx(LR)  # the base lr again after a scaled update
    plain = harness(
        plain_sgd() + [f"algorithm.name={algorithm}"],
        groups=[[A], [B]],
        algorithm=algorithm,
        workers=(A, B),
    )
    plain.init(initial())
    for node, g in ((A, ga), (B, gb), (A, ga2)):
        plain.push(node, 0 if g is not ga2 else 1, g)
    assert_values(plain.values(), sgd_step(sgd_step(sgd_step(initial(), ga, LR), gb, LR), ga2, LR))
