"""Grouping's asynchrony-aware update options against torch's own optimizers on real
shards (ps.shard.Shard over the in-process mem:// transport, shard_harness.py):
`algorithm.optimizer_state: per_group`, `algorithm.delay_compensation` (DC-ASGD, also
under async and ssp) and `algorithm.lr_share`, each exact to rtol 1e-6, and the per-group
state carried through a re-grouping and a checkpoint."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from shard_harness import ShardHarness, closing_factory, tiny_model

from hetps.ps.store import TensorStore
from hetps.ps.updater import Updater
from hetps.runconfig.load import load_config
from hetps.training.state import model_specs, model_tensors

W = [11, 12, 13, 14]
TIGHT = dict(rtol=1e-6, atol=1e-6)


class Cluster(ShardHarness):
    """One shard over tiny_model()'s tensors, workers W[:n], initialised by W[0]."""

    def __init__(self, algorithm: str, overrides: list[str], n_workers: int, groups=()):
        self.model = tiny_model()
        self.workers = W[:n_workers]
        super().__init__(
            model_specs(self.model), overrides, self.workers, 1, algorithm, groups=groups
        )
        self.initial = {n: t.detach().clone() for n, (t, _) in model_tensors(self.model).items()}
        self.init(self.initial, self.workers[0])

    def grad(self, seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {
            n: torch.randn(t.shape, generator=g) if t.is_floating_point() else t.clone()
            for n, (t, _) in model_tensors(self.model).items()
        }


@pytest.fixture
def clusters():
    yield from closing_factory(Cluster)


def assert_params(c: Cluster, ref: list[torch.Tensor]) -> None:
    got = c.values()
    for n, p in zip(c.params(), ref):
        torch.testing.assert_close(got[n], p.detach(), **TIGHT, msg=lambda m, n=n: f"{n}: {m}")


def reference(c: Cluster) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(c.initial[n].clone()) for n in c.params()]


def step(opt: torch.optim.Optimizer, ref, grads: dict, names, lr: float) -> None:
    for p, n in zip(ref, names):
        p.grad = grads[n].clone()
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()


OPTIMIZERS = {
    "sgd": (
        ["optimizer.name=sgd", "optimizer.lr=0.1", "optimizer.momentum=0.9"],
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.0),
    ),
    "adam": (
        ["optimizer.name=adam", "optimizer.lr=0.01"],
        lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.9, 0.999)),
    ),
}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("state", ["per_group", "shared"])
def test_each_group_steps_its_own_optimizer_state(clusters, opt_name, state):
    """per_group: each group's updates step its own momentum buffer / Adam moments (torch: one
    optimizer per group over the same parameters); shared: one optimizer for all."""
    keys, make = OPTIMIZERS[opt_name]
    c = clusters(
        "grouping",
        [*keys, "optimizer.weight_decay=0", f"algorithm.optimizer_state={state}"],
        n_workers=3,
        groups=[[W[0], W[1]], [W[2]]],
    )
    names = c.params()
    ref = reference(c)
    shared = make(ref)
    opts = [make(ref), make(ref)] if state == "per_group" else [shared, shared]
    base_lr = opts[0].defaults["lr"]
    version = 0
    last = {0: 0, 1: 0}
    # group 1 twice, then group 0 once, then group 1: the order asynchrony gives
    for clock, g in [(0, 1), (1, 1), (0, 0), (2, 1)]:
        members = [W[0], W[1]] if g == 0 else [W[2]]
        grads = [c.grad(100 * clock + 10 * g + i) for i in range(len(members))]
        for w, gr in zip(members, grads):
            c.push(w, clock, gr, base_version=version)
        staleness = 1 + version - last[g]
        mean = {n: sum(gr[n] for gr in grads) / len(grads) for n in names}
        step(opts[g], ref, mean, names, base_lr / staleness)
        version += 1
        last[g] = version
        assert c.versions() == [version]
    assert_params(c, ref)


def test_a_regrouping_gives_each_new_group_its_members_mean_state(clusters):
    """After a re-plan, a new group's optimizer state is the mean of its members' old groups'
    states weighted by members: groups {A}, {B, C} -> {A, B, C} steps 1/3 A's buffer + 2/3
    the other's."""
    c = clusters(
        "grouping",
        [
            "optimizer.name=sgd",
            "optimizer.lr=0.1",
            "optimizer.momentum=0.9",
            "optimizer.weight_decay=0",
            "algorithm.optimizer_state=per_group",
            "algorithm.scale_lr=false",
        ],
        n_workers=3,
        groups=[[W[0]], [W[1], W[2]]],
    )
    names = c.params()
    ga, gb, gc = c.grad(1), c.grad(2), c.grad(3)
    c.push(W[0], 0, ga)
    c.push(W[1], 0, gb)
    c.push(W[2], 0, gc)
    buf_a = {n: ga[n] for n in names}  # a first SGD step's buffer is the gradient
    buf_bc = {n: (gb[n] + gc[n]) / 2 for n in names}
    before = c.values()
    shard = c.shards[0]
    c.plan_id += 1
    shard.adopt(dataclasses.replace(c.plan, plan_id=c.plan_id, groups=[[W[0], W[1], W[2]]]))
    grads = [c.grad(10 + i) for i in range(3)]
    for w, gr in zip(W[:3], grads):
        c.push(w, 1, gr, base_version=2)
    got = c.values()
    for n in names:
        buf = 0.9 * (buf_a[n] / 3 + 2 * buf_bc[n] / 3) + sum(gr[n] for gr in grads) / 3
        torch.testing.assert_close(got[n], before[n] - 0.1 * buf, **TIGHT)


PLAIN_SGD = [
    "optimizer.name=sgd",
    "optimizer.lr=0.1",
    "optimizer.momentum=0",
    "optimizer.weight_decay=0",
]


def assert_dc_asgd(c: Cluster, lam: float, pushes: list[tuple[int, int]]) -> None:
    """Push (clock, sender k) in order, each worker W[k] alone in its group (or under async),
    and check the shard against DC-ASGD by hand at lr 0.1: k's gradient g becomes g +
    lambda g*g*(w_now - w_stale), w_stale the values right after k's previous update; k's
    first update is plain."""
    names = c.params()
    w = {n: c.initial[n].clone() for n in names}
    served: dict[int, dict] = {}
    for clock, k in pushes:
        grad = c.grad(10 * clock + k)
        c.push(W[k], clock, grad)
        d = {n: grad[n] for n in names}
        if k in served:
            d = {n: d[n] + lam * d[n] * d[n] * (w[n] - served[k][n]) for n in names}
        w = {n: w[n] - 0.1 * d[n] for n in names}
        served[k] = {n: t.clone() for n, t in w.items()}
    got = c.values()
    for n in names:
        torch.testing.assert_close(got[n], w[n], **TIGHT)


@pytest.mark.parametrize("lam", [0.5, 0.0])
def test_grouping_delay_compensation_is_dc_asgd(clusters, lam):
    """A group's gradient is compensated with the values right after that group's previous
    update (what its members were served). lambda 0: plain."""
    c = clusters(
        "grouping",
        [*PLAIN_SGD, "algorithm.scale_lr=false", f"algorithm.delay_compensation={lam}"],
        n_workers=2,
        groups=[[W[0]], [W[1]]],
    )
    assert_dc_asgd(c, lam, [(0, 0), (0, 1), (1, 1), (1, 0), (2, 0)])


@pytest.mark.parametrize("algorithm", ["async", "ssp"])
def test_async_delay_compensation_uses_each_workers_last_values(clusters, algorithm):
    lam = 2.0
    staleness = ["algorithm.staleness=5"] if algorithm == "ssp" else []
    c = clusters(
        algorithm, [*PLAIN_SGD, f"algorithm.delay_compensation={lam}", *staleness], n_workers=2
    )
    assert_dc_asgd(c, lam, [(0, 0), (0, 1), (1, 0), (2, 0), (1, 1)])


def test_lr_share_scales_each_update_by_its_members_share(clusters):
    """lr_share: the config's lr is sync's; a group of k of P workers updates with lr k / P
    (times 1 / staleness with scale_lr); async pushes with lr / P."""
    plain = ["optimizer.name=sgd", "optimizer.lr=0.3", "optimizer.momentum=0"]
    plain.append("optimizer.weight_decay=0")
    c = clusters(
        "grouping",
        [*plain, "algorithm.lr_share=true"],
        n_workers=3,
        groups=[[W[0], W[1]], [W[2]]],
    )
    names = c.params()
    w = {n: c.initial[n].clone() for n in names}
    g0, g1, g2 = c.grad(1), c.grad(2), c.grad(3)
    c.push(W[2], 0, g2)  # group 1: 1 of 3, staleness 1
    w = {n: w[n] - 0.3 * (1 / 3) * g2[n] for n in names}
    c.push(W[0], 0, g0)
    c.push(W[1], 0, g1)  # group 0: 2 of 3, staleness 2 (group 1 updated since)
    w = {n: w[n] - 0.3 * (2 / 3) / 2 * (g0[n] + g1[n]) / 2 for n in names}
    got = c.values()
    for n in names:
        torch.testing.assert_close(got[n], w[n], **TIGHT)
    a = clusters("async", [*plain, "algorithm.lr_share=true"], n_workers=3)
    a.push(W[1], 0, g1)
    got = a.values()
    for n in names:
        torch.testing.assert_close(got[n], a.initial[n] - 0.3 / 3 * g1[n], **TIGHT)


@pytest.mark.parametrize("flat", [True, False])
def test_per_group_states_survive_a_checkpoint(flat):
    """Updater.state_dict holds every group's state (per-tensor form, as a checkpoint keeps
    it); a new updater loaded from it steps each group exactly as the first would."""
    model = tiny_model()
    cfg = load_config(None, ["optimizer.name=adam", "optimizer.lr=0.01"]).optimizer
    specs = model_specs(model)
    names = [s.name for s in specs if s.kind == "param"]

    def make(state=None):
        store = TensorStore(specs)
        store.initialize({n: t.detach().clone() for n, (t, _) in model_tensors(model).items()})
        if state is not None:  # as a shard restores: the store first, then a new updater
            store.load_state_dict(state)
        # flat: the optimizer over the store's flat runs; else over the separate tensors
        return store, Updater(store.tensors, names, cfg, store.arena if flat else None)

    def grads(seed):
        g = torch.Generator().manual_seed(seed)
        return {n: torch.randn(model.state_dict()[n].shape, generator=g) for n in names}

    store, first = make()
    for seed, key in [(1, 0), (2, 1), (3, 0)]:
        first.apply(grads(seed), state_key=key)
    saved = copy.deepcopy(first.state_dict())  # as written to a checkpoint, not the live buffers
    assert set(saved["group_states"]) == {0, 1}
    store2, second = make(store.state_dict())
    second.load_state_dict(saved)
    for seed, key in [(4, 1), (5, 0)]:
        first.apply(grads(seed), state_key=key)
        second.apply(grads(seed), state_key=key)
    for n in names:
        torch.testing.assert_close(store2.tensors[n], store.tensors[n], rtol=0, atol=0)
