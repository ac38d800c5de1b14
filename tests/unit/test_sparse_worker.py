"""The worker's side of sparse tables (worker/sparse.py) without shards: a
SparseEmbedding serving rows from a local table must give nn.Embedding's and
nn.EmbeddingBag's outputs and, as row-sparse pushes, their gradients; the
selection of tables refuses what the row-wise path cannot honour, naming
`sparse.tables`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetps.runconfig.load import load_config
from hetps.training.sparse import SparseConfigError, TouchedRows, install, selected, tables_of
from hetps.training.state import model_specs

ROWS, DIM = 30, 4


class LocalRows(TouchedRows):
    """Rows from a dense copy of the table (as the shards would serve them)."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        super().__init__(shards=2)
        self.weights = weights
        self.asked: list[torch.Tensor] = []

    def rows(self, table, ids, dim, dtype):
        self.asked.append(ids)
        return self.weights[table][ids].clone()


def cfg(*overrides):
    return load_config(None, ["sparse.tables=auto", "sparse.min_rows=10", *overrides])


def dense_grad(pushes: list[dict], table: str) -> torch.Tensor:
    """The whole-table gradient the per-shard pushes stand for."""
    out = torch.zeros(ROWS, DIM)
    for part in pushes:
        ids = part.get(f"{table}:ids")
        if ids is not None:
            out.index_add_(0, ids, part[f"{table}:rows"])
    return out


CASES = {
    "embedding 2-D": (lambda: nn.Embedding(ROWS, DIM), lambda m, x: m(x), None),
    "embedding padding": (lambda: nn.Embedding(ROWS, DIM, padding_idx=3), lambda m, x: m(x), None),
    "bag sum": (lambda: nn.EmbeddingBag(ROWS, DIM, mode="sum"), lambda m, x: m(x), None),
    "bag mean": (lambda: nn.EmbeddingBag(ROWS, DIM, mode="mean"), lambda m, x: m(x), None),
    "bag max": (lambda: nn.EmbeddingBag(ROWS, DIM, mode="max"), lambda m, x: m(x), None),
    "bag offsets + weights": (
        lambda: nn.EmbeddingBag(ROWS, DIM, mode="sum"),
        lambda m, x: m(x.reshape(-1), torch.tensor([0, 2, 7]), torch.linspace(0.5, 2.0, x.numel())),
        None,
    ),
    "bag padding": (
        lambda: nn.EmbeddingBag(ROWS, DIM, mode="mean", padding_idx=3),
        lambda m, x: m(x),
        None,
    ),
    "int32 ids": (lambda: nn.Embedding(ROWS, DIM), lambda m, x: m(x.int()), None),
    "used twice": (lambda: nn.Embedding(ROWS, DIM), lambda m, x: m(x) + 2 * m(x[:, :1]), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rows_from_the_shards_give_torchs_outputs_and_gradients(case):
    make, call, _ = CASES[case]
    torch.manual_seed(0)
    reference = nn.Sequential(make())
    with torch.no_grad():
        if reference[0].padding_idx is not None:
            reference[0].weight[reference[0].padding_idx] = 0.0  # as torch builds it
    model = nn.Sequential(make())
    install(model, cfg())
    table = tables_of(model)["0.weight"]
    assert table.spec.kind == "table" and table.spec.shape == (ROWS, DIM)
    assert [s.kind for s in model_specs(model)] == ["table"] and not list(model.parameters())
    weight = reference[0].weight.detach().clone()
    source = LocalRows({"0.weight": weight + 0.0})
    source.bind(model)
    x = torch.tensor([[1, 3, 3, 5], [7, 1, 9, 3], [2, 2, 2, 2]])
    want = call(reference[0], x)
    got = call(model[0], x)
    torch.testing.assert_close(got, want)
    (want**2).sum().backward()
    (got**2).sum().backward()
    pushes = source.take_pushes()
    assert not source.touched
    torch.testing.assert_close(dense_grad(pushes, "0.weight"), reference[0].weight.grad)
    for i, part in enumerate(pushes):
        ids = part["0.weight:ids"]
        assert ids.dtype == torch.int64 and bool((ids % 2 == i).all())  # each shard its own rows
        assert torch.unique(ids).numel() == ids.numel()  # each id once, summed
    assert all(a.dtype == torch.int64 for a in source.asked)


def test_a_table_not_touched_in_eval_mode_records_nothing():
    model = nn.Sequential(nn.Embedding(ROWS, DIM))
    install(model, cfg())
    source = LocalRows({"0.weight": torch.randn(ROWS, DIM)})
    source.bind(model)
    model.eval()
    with torch.no_grad():
        model(torch.tensor([[1, 2]]))
    assert not source.touched


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(ROWS, DIM)
        self.head = nn.Linear(DIM, ROWS, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, x):
        return self.head(self.tok(x))


@pytest.mark.parametrize(
    "model, overrides, words",
    [
        (lambda: nn.Sequential(nn.Embedding(ROWS, DIM)), ["algorithm.name=diloco"], "diloco"),
        (lambda: nn.Sequential(nn.Embedding(ROWS, DIM)), ["algorithm.name=cpsgd"], "cpsgd"),
        (lambda: nn.Sequential(nn.Embedding(ROWS, DIM)), ["model.autocast=float16"], "float16"),
        (lambda: Tied(), [], "tied"),
        (lambda: nn.Sequential(nn.Embedding(ROWS, DIM, max_norm=1.0)), [], "max_norm"),
        (lambda: nn.Sequential(nn.Linear(2, 2)), ["sparse.tables=[fc]"], "not an nn.Embedding"),
    ],
)
def test_what_the_row_wise_path_cannot_honour_is_refused(model, overrides, words):
    with pytest.raises(SparseConfigError, match="sparse.tables") as err:
        selected(model(), cfg(*overrides))
    assert words in str(err.value)


def test_auto_takes_the_tables_of_at_least_min_rows_rows():
    model = nn.Sequential(nn.Embedding(9, DIM), nn.EmbeddingBag(10, DIM), nn.Embedding(50, DIM))
    assert [n for n, _ in selected(model, cfg())] == ["1", "2"]
    assert [n for n, _ in selected(model, cfg("sparse.tables=[0.weight]"))] == ["0"]
    assert selected(model, cfg("sparse.tables=[]")) == []
