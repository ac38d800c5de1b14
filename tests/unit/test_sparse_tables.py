"""A shard's sparse tables (ps/sparse_tables.py): two shards' slices of one
table, stepped by the row-wise optimizers, equal the torch optimizer on the
whole table (SGD, Adagrad, SparseAdam; row-wise Adagrad against a dense
reference written here), under rounds (the members' mean) and under
apply-each-push; rounds wait and close; a checkpoint mid-run, open round
included, continues to the same values; init is deterministic; a large table
is touched only where pushed. Pure, in one process."""

from __future__ import annotations

import io

import pytest
import torch

from hetps.proto.sparse import TableSpec
from hetps.ps.sparse_tables import SparseTables
from hetps.runconfig.schema import SparseConfig, SparseOptimizerConfig

ROWS, DIM, SHARDS = 1000, 8, 2
SPEC = TableSpec("emb.weight", ROWS, DIM)
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
LR = {"sgd": 0.5, "adagrad": 0.1, "rowwise_adagrad": 0.1, "adam": 0.01}
INIT_ACC = 0.1
TORCH_EPS = {"sgd": 0.0, "adagrad": 1e-10, "rowwise_adagrad": 1e-8, "adam": 1e-8}


def config(name: str, eps: float | None = None, init_acc: float = INIT_ACC) -> SparseConfig:
    return SparseConfig(
        init_std=0.1,
        optimizer=SparseOptimizerConfig(
            name=name, lr=LR[name], eps=eps, initial_accumulator_value=init_acc
        ),
    )


def shards(
    name: str, mode: str, spec: TableSpec = SPEC, seed: int = 7, **opt
) -> list[SparseTables]:
    return [SparseTables([spec], s, SHARDS, config(name, **opt), seed, mode) for s in range(SHARDS)]


def assembled(tables: list[SparseTables], name: str = SPEC.name) -> torch.Tensor:
    """The whole table from the shards' slices: row i from shard i % shards."""
    spec = tables[0].table(name).spec
    out = torch.full((spec.rows, spec.dim), float("nan"))
    for t in tables:
        ids, values = t.full_slice(name)
        out[ids] = values
    return out


def worker_batch(g: torch.Generator, batch: int = 60) -> tuple[torch.Tensor, torch.Tensor]:
    """A worker's push of one step: its batch's ids (with repeats) and per-lookup
    gradient rows, summed per distinct id as the worker does before pushing."""
    ids = torch.randint(0, ROWS, (batch,), generator=g)
    per_lookup = torch.randn(batch, DIM, generator=g)
    unique, inverse = torch.unique(ids, return_inverse=True)
    summed = torch.zeros(unique.numel(), DIM).index_add_(0, inverse, per_lookup)
    return unique, summed


def split(ids: torch.Tensor, rows: torch.Tensor) -> list[dict]:
    """One push per shard: the ids it owns (possibly none) and their rows."""
    out = []
    for s in range(SHARDS):
        mask = ids % SHARDS == s
        out.append({SPEC.name: (ids[mask], rows[mask])})
    return out


def dense_grad(ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return torch.zeros(ROWS, DIM).index_add_(0, ids, rows)


class DenseReference:
    """The optimizer on the whole table, stepped with a whole-table gradient."""

    def __init__(
        self, name: str, weight: torch.Tensor, eps: float | None = None, init_acc: float = INIT_ACC
    ):
        self.name = name
        self.eps = TORCH_EPS[name] if eps is None else eps
        self.p = torch.nn.Parameter(weight.clone())
        if name == "sgd":
            self.opt = torch.optim.SGD([self.p], lr=LR[name])
        elif name == "adagrad":
            self.opt = torch.optim.Adagrad(
                [self.p], lr=LR[name], eps=self.eps, initial_accumulator_value=init_acc
            )
        elif name == "adam":
            self.opt = torch.optim.SparseAdam([self.p], lr=LR[name], eps=self.eps)
        else:  # FBGEMM's exact row-wise Adagrad, written out densely
            self.acc = torch.full((ROWS,), init_acc)

    def step(self, pushes: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One step with the mean of `pushes` (each a worker's (ids, summed rows))."""
        n = len(pushes)
        if self.name == "adam":
            ids = torch.cat([i for i, _ in pushes])
            rows = torch.cat([r for _, r in pushes])
            grad = torch.sparse_coo_tensor(ids[None], rows, (ROWS, DIM), check_invariants=True)
            grad = grad.coalesce()
            self.p.grad = grad / n
            self.opt.step()
            return
        grad = sum(dense_grad(i, r) for i, r in pushes) / n
        if self.name == "rowwise_adagrad":
            with torch.no_grad():
                self.acc += (grad * grad).mean(dim=1)
                self.p -= LR[self.name] * grad / (self.acc.sqrt() + self.eps)[:, None]
            return
        self.p.grad = grad
        self.opt.step()

    @property
    def weight(self) -> torch.Tensor:
        return self.p.detach()


def assert_same(tables: list[SparseTables], ref: DenseReference) -> None:
    torch.testing.assert_close(assembled(tables), ref.weight, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_round_mode_equals_dense_optimizer_on_the_mean(name):
    tables = shards(name, "round")
    start = assembled(tables)
    assert not start.isnan().any()
    ref = DenseReference(name, start)
    g = torch.Generator().manual_seed(1)
    members = [11, 12]
    for _ in range(5):
        pushes = [worker_batch(g) for _ in members]
        for i, (worker, (ids, rows)) in enumerate(zip(members, pushes)):
            for shard, push in zip(tables, split(ids, rows)):
                applied = shard.push(worker, members, push)
                assert applied == (i == len(members) - 1)
        ref.step(pushes)
        assert_same(tables, ref)
    assert not torch.equal(assembled(tables), start)
    if name == "adam":
        assert all(t.table(SPEC.name).step == 5 for t in tables)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_mode_equals_dense_optimizer_stepped_per_push(name):
    tables = shards(name, "each")
    ref = DenseReference(name, assembled(tables))
    g = torch.Generator().manual_seed(2)
    for step in range(6):
        worker = 11 + step % 2
        ids, rows = worker_batch(g)
        for shard, push in zip(tables, split(ids, rows)):
            assert shard.push(worker, [11, 12], push) is True
            assert not shard.waiting(worker)
        ref.step([(ids, rows)])
        assert_same(tables, ref)


@pytest.mark.parametrize("name", ["adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("eps", [None, 0.5])
def test_eps_from_the_config_or_torch_default(name, eps):
    """Accumulators from zero make eps matter: the default (torch's, FBGEMM's for
    rowwise) and a configured one give the reference's values."""
    tables = shards(name, "each", eps=eps, init_acc=0.0)
    assert all(t.eps == (TORCH_EPS[name] if eps is None else eps) for t in tables)
    ref = DenseReference(name, assembled(tables), eps=eps, init_acc=0.0)
    g = torch.Generator().manual_seed(8)
    for _ in range(3):
        ids, rows = worker_batch(g)
        rows = rows * 1e-6  # small gradients: eps is of their order
        for shard, push in zip(tables, split(ids, rows)):
            shard.push(11, [11], push)
        ref.step([(ids, rows)])
        assert_same(tables, ref)


def test_adam_counts_a_step_for_a_table_named_without_ids_on_a_shard():
    """A push whose ids all live on shard 0 still names the table to shard 1: its
    step count moves as SparseAdam's does, so later bias corrections agree."""
    tables = shards("adam", "each")
    ref = DenseReference("adam", assembled(tables))
    g = torch.Generator().manual_seed(3)
    for even_only in (True, False, False):
        ids, rows = worker_batch(g)
        if even_only:
            ids = torch.unique(ids - ids % 2)
            rows = rows[: ids.numel()]
        pushes = split(ids, rows)
        assert pushes[1][SPEC.name][0].numel() == 0 or not even_only
        for shard, push in zip(tables, pushes):
            shard.push(11, [11], push)
        ref.step([(ids, rows)])
        assert_same(tables, ref)
    assert [t.table(SPEC.name).step for t in tables] == [3, 3]


def test_round_waits_for_every_member_and_close_rounds_applies_the_partial_mean():
    tables = shards("sgd", "round")
    shard = tables[0]
    before = assembled(tables)
    g = torch.Generator().manual_seed(4)
    members = [1, 2, 3]
    ids, rows = worker_batch(g)
    push = split(ids, rows)[0]
    own, own_rows = (x.clone() for x in push[SPEC.name])
    assert shard.push(1, members, push) is False
    # the pushed tensors may be a message's memory, reused once the handler returns
    push[SPEC.name][0].zero_()
    push[SPEC.name][1].fill_(float("nan"))
    assert shard.waiting(1) and not shard.waiting(2) and not shard.waiting(3)
    assert shard.stats()["sparse_open_rounds"] == 1
    # a push with no tables still counts as a member's contribution
    assert shard.push(2, members, {}) is False
    assert shard.waiting(2)
    torch.testing.assert_close(assembled(tables), before, rtol=0, atol=0)  # nothing applied yet
    # member 3 left: the plan changed, the round closes with the two pushes it has
    assert shard.close_rounds() is True
    assert not shard.waiting(1) and not shard.waiting(2)
    assert shard.stats()["sparse_open_rounds"] == 0
    assert shard.close_rounds() is False
    expected = before.clone()
    expected[own] -= LR["sgd"] * own_rows / 2  # mean over the two contributors
    torch.testing.assert_close(assembled(tables), expected, rtol=1e-6, atol=1e-7)


def test_round_of_one_applies_at_once_and_a_repeated_push_is_added():
    tables = shards("sgd", "round")
    shard = tables[0]
    before = assembled(tables)
    ids = torch.tensor([0, 2, 4])
    rows = torch.ones(3, DIM)
    # worker 1 pushes twice into an open round (should not happen): the two are added
    assert shard.push(1, [1, 2], {SPEC.name: (ids, rows)}) is False
    assert shard.push(1, [1, 2], {SPEC.name: (ids[:1], rows[:1])}) is False
    assert shard.push(2, [1, 2], {SPEC.name: (ids[2:], rows[2:])}) is True
    expected = before.clone()  # per id: 1 + 1 from worker 1, 1 from worker 1, 1 + 1
    expected[ids] -= LR["sgd"] * torch.tensor([2.0, 1.0, 2.0])[:, None] / 2
    torch.testing.assert_close(assembled(tables), expected, rtol=1e-6, atol=1e-7)
    assert shard.push(3, [3], {SPEC.name: (ids, rows)}) is True
    expected[ids] -= LR["sgd"] * rows
    torch.testing.assert_close(assembled(tables), expected, rtol=1e-6, atol=1e-7)


def test_bad_pushes_name_the_table_and_change_nothing():
    tables = shards("adagrad", "each")
    shard = tables[0]
    before = assembled(tables)
    with pytest.raises(ValueError, match="'emb.weight'.*not unique"):
        shard.push(1, [1], {SPEC.name: (torch.tensor([2, 4, 2]), torch.ones(3, DIM))})
    with pytest.raises(ValueError, match="'emb.weight'.*shape"):
        shard.push(1, [1], {SPEC.name: (torch.tensor([2, 4]), torch.ones(2, DIM + 1))})
    with pytest.raises(ValueError, match="'other'.*not served"):
        shard.push(1, [1], {"other": (torch.tensor([2]), torch.ones(1, DIM))})
    torch.testing.assert_close(assembled(tables), before, rtol=0, atol=0)
    assert shard.stats()["sparse_updates"] == 0


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_checkpoint_mid_run_with_an_open_round_continues_identically(name):
    members = [1, 2]

    def pushes(seed):
        g = torch.Generator().manual_seed(seed)
        return [[split(*worker_batch(g)) for _ in members] for _ in range(4)]

    plan = pushes(5)

    def run(tables, steps, start_at=0, worker_from=0):
        for s in range(start_at, steps):
            for w in range(worker_from if s == start_at else 0, len(members)):
                for shard, push in zip(tables, plan[s][w]):
                    shard.push(members[w], members, push)

    straight = shards(name, "round")
    run(straight, 4)

    first = shards(name, "round")
    run(first, 2)
    for shard, push in zip(first, plan[2][0]):  # step 2: member 1 pushed, round open
        shard.push(members[0], members, push)
    assert all(s.waiting(members[0]) for s in first)
    saved = []
    for shard in first:
        buf = io.BytesIO()
        torch.save(shard.state_dict(), buf)
        saved.append(buf.getvalue())
    # a fresh shard (other seed: its own init must be overwritten) restores and goes on
    restored = shards(name, "round", seed=99)
    for shard, data in zip(restored, saved):
        shard.load_state_dict(torch.load(io.BytesIO(data), weights_only=True))
    assert all(s.waiting(members[0]) and s.stats()["sparse_open_rounds"] == 1 for s in restored)
    run(restored, 4, start_at=2, worker_from=1)
    torch.testing.assert_close(assembled(restored), assembled(straight), rtol=0, atol=0)
    for a, b in zip(restored, straight):
        ta, tb = a.table(SPEC.name), b.table(SPEC.name)
        assert ta.step == tb.step
        for k in tb.state:
            torch.testing.assert_close(ta.state[k], tb.state[k], rtol=0, atol=0)
        assert a.stats() == b.stats()


def test_load_refuses_another_placement_or_optimizer_and_changes_nothing():
    state = shards("adam", "round")[0].state_dict()
    other_shard = shards("adam", "round")[1]
    before = assembled([other_shard, shards("adam", "round")[0]])
    with pytest.raises(ValueError, match="shard 0/2.*not the same placement"):
        other_shard.load_state_dict(state)
    sgd = shards("sgd", "round")[0]
    with pytest.raises(ValueError, match="sparse.optimizer.name is 'sgd'"):
        sgd.load_state_dict(state)
    torch.testing.assert_close(
        assembled([other_shard, shards("adam", "round")[0]]), before, rtol=0, atol=0
    )


def test_init_is_deterministic_per_seed_table_and_shard():
    a, b = shards("sgd", "each"), shards("sgd", "each")
    for x, y in zip(a, b):
        torch.testing.assert_close(
            x.table(SPEC.name).weight, y.table(SPEC.name).weight, rtol=0, atol=0
        )
    w0, w1 = a[0].table(SPEC.name).weight, a[1].table(SPEC.name).weight
    assert not torch.equal(w0, w1)
    other_seed = shards("sgd", "each", seed=8)[0].table(SPEC.name).weight
    assert not torch.equal(w0, other_seed)
    other_name = SparseTables([TableSpec("other", ROWS, DIM)], 0, SHARDS, config("sgd"), 7, "each")
    assert not torch.equal(w0, other_name.table("other").weight)
    assert abs(float(assembled(a).std()) - 0.1) < 0.01  # normal(0, init_std)


def row_prints(x: torch.Tensor) -> torch.Tensor:
    """Each row's checksum of its bits (the int64 sum of its 32-bit words), a few rows
    at a time: a row whose bits change gets another sum, bar coincidence; no copy of
    a table-sized tensor kept."""
    words = x.reshape(x.shape[0], -1).view(torch.int32)
    return torch.cat([c.sum(dim=1, dtype=torch.int64) for c in words.split(65536)])


@pytest.mark.parametrize(
    "name, state_bytes",
    [("sgd", 0), ("adagrad", 1.0), ("rowwise_adagrad", 1 / 32), ("adam", 2.0)],
)
def test_large_table_changes_only_pushed_rows(name, state_bytes):
    rows, dim = 10**6, 32
    spec = TableSpec("big", rows, dim)
    shard = SparseTables([spec], 0, 1, config(name), 3, "each")
    slice_bytes = rows * dim * 4
    assert shard.stats()["sparse_bytes"] == slice_bytes + int(slice_bytes * state_bytes)
    t = shard.table("big")
    live = [t.weight, *t.state.values()]
    pointers = [x.data_ptr() for x in live]
    before = [row_prints(x) for x in live]
    g = torch.Generator().manual_seed(6)
    touched = torch.zeros(rows, dtype=torch.bool)
    for _ in range(3):
        ids = torch.randperm(rows, generator=g)[:1000]
        touched[ids] = True
        assert shard.push(1, [1], {"big": (ids, torch.randn(1000, dim, generator=g))})
    # updated in place (no table-sized replacement), and only where pushed
    live = [t.weight, *t.state.values()]
    assert [x.data_ptr() for x in live] == pointers
    for x, old in zip(live, before):
        changed = row_prints(x) != old
        assert torch.equal(changed & ~touched, torch.zeros(rows, dtype=torch.bool))
    assert torch.equal(row_prints(t.weight) != before[0], touched)
    stats = shard.stats()
    assert stats["sparse_rows_updated"] == 3000 and stats["sparse_updates"] == 3
    assert stats["sparse_bytes"] == slice_bytes + int(slice_bytes * state_bytes)
    assert stats["sparse_open_rounds"] == 0


def test_rows_returns_a_copy_and_counts():
    shard = shards("sgd", "each")[1]
    ids = torch.tensor([1, 5, 999])
    got = shard.rows(SPEC.name, ids)
    full_ids, values = shard.full_slice(SPEC.name)
    torch.testing.assert_close(got, values[ids // SHARDS], rtol=0, atol=0)
    assert torch.equal(full_ids[ids // SHARDS], ids)
    kept = got.clone()
    shard.push(1, [1], {SPEC.name: (ids, torch.ones(3, DIM))})
    torch.testing.assert_close(got, kept, rtol=0, atol=0)  # the pulled copy did not move
    assert shard.stats()["sparse_rows_pulled"] == 3
