"""Sparse tables on the worker: embeddings whose rows come from the shards.

`install(model, cfg)` replaces each `nn.Embedding` / `nn.EmbeddingBag` that
`sparse.tables` selects (docs/sparse.md) by a `SparseEmbedding` of the same
shape and options that holds no weight. Its forward takes the unique ids of
its input, asks the shards for those rows only (`RowExchange.rows`: one
request per shard holding any of them), and computes the module's output on
that small matrix; backward leaves the gradient of exactly those rows. After
the step, `RowExchange.push` sends each shard the row-sparse gradient of its
rows (unique ids, each id's gradient summed over its uses in the step), so a
worker's memory grows with the rows a step touches, never with the table.

The table is built once by the model factory and freed at install (a table
larger than the worker's memory cannot be built by an ordinary factory:
build it on the meta device, `torch.device("meta")`, and install swaps it
all the same). The dense parameters travel as before (client.py).

Rows are pulled with the worker's count of row pushes (`clock`): a shard
answers once the worker's previous push has been applied (under sync and
grouping, once its group's round closed), so a step never sees rows without
its own last update. The evaluator and `hetps export` read the latest rows
(clock -1).
"""

from __future__ import annotations

import collections
import logging

import torch
import torch.nn.functional as F
from torch import nn

from hetps.proto.codec import dtype_name
from hetps.proto.plan import TensorSpec
from hetps.proto.sparse import ids_key, owner_of, rows_key
from hetps.runconfig.checks import sparse_tables_problem
from hetps.runconfig.schema import RunConfig

log = logging.getLogger(__name__)
EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


class SparseConfigError(ValueError):
    """A `sparse:` setting this model or run cannot work with; the message starts with its key."""


class SparseEmbedding(nn.Module):
    """An `nn.Embedding` or `nn.EmbeddingBag` whose rows live on the shards.
    Same call signature and result; holds no parameter. `spec`: the table
    (a TensorSpec of kind "table", named after the weight it replaces)."""

    def __init__(self, name: str, module: nn.Module):
        super().__init__()
        weight = module.weight
        self.spec = TensorSpec(name, dtype_name(weight.dtype), tuple(weight.shape), "table")
        self.bag = isinstance(module, nn.EmbeddingBag)
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = module.padding_idx
        self.mode = getattr(module, "mode", "mean")
        self.include_last_offset = getattr(module, "include_last_offset", False)
        self.dtype = weight.dtype
        self.exchange: TouchedRows | None = None

    def extra_repr(self) -> str:
        kind = f"EmbeddingBag, mode={self.mode}" if self.bag else "Embedding"
        return f"{self.num_embeddings}, {self.embedding_dim}, {kind}, rows on the shards"

    def forward(self, input, offsets=None, per_sample_weights=None):
        # int64 on the wire whatever the input's integer type (torch takes int32 ids too)
        unique, inverse = torch.unique(input.reshape(-1).long(), return_inverse=True)
        rows = self._rows(unique.cpu()).to(input.device, non_blocking=True)
        if torch.is_grad_enabled() and self.training:
            rows.requires_grad_(True)
            if self.exchange is not None:
                self.exchange.touched.append((self.spec.name, unique.cpu(), rows))
        padding = None
        if self.padding_idx is not None:
            hit = (unique == self.padding_idx).nonzero()
            padding = int(hit[0, 0]) if hit.numel() else None
            if padding is not None and not self.bag:
                # nn.Embedding's padding row is zero and never learns: so here, whatever the shard holds
                rows = rows.index_fill(0, hit[0], 0.0)
        local = inverse.view(input.shape)
        if not self.bag:
            return F.embedding(local, rows, padding_idx=padding)
        return F.embedding_bag(
            local,
            rows,
            offsets,
            mode=self.mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
            padding_idx=padding,
        )

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(
                f"{self.spec.name}: ids must lie in [0, {self.num_embeddings}), got "
                f"{int(ids.min())}..{int(ids.max())}"
            )
        if self.exchange is None:
            # before the cluster: the dry step and speed profiling compute on stand-in rows
            return torch.zeros(ids.numel(), self.embedding_dim, dtype=self.dtype)
        return self.exchange.rows(self.spec.name, ids, self.embedding_dim, self.dtype)


def selected(model: nn.Module, cfg: RunConfig) -> list[tuple[str, nn.Module]]:
    """The (module path, module) pairs `sparse.tables` selects. Raises
    SparseConfigError naming the key for a name that is not an embedding of
    the model, or an option the row-wise path cannot honour."""
    embeddings = {n: m for n, m in model.named_modules() if isinstance(m, EMBEDDINGS)}
    tables = cfg.sparse.tables
    if tables == "auto":
        chosen = [n for n, m in embeddings.items() if m.weight.shape[0] >= cfg.sparse.min_rows]
    elif isinstance(tables, list) and all(isinstance(t, str) for t in tables):
        chosen = [t.removesuffix(".weight") for t in tables]
        unknown = [t for t in chosen if t not in embeddings]
        if unknown:
            raise SparseConfigError(
                f"sparse.tables: {unknown[0]!r} is not an nn.Embedding or nn.EmbeddingBag of "
                f"model {cfg.model.name!r}; its embeddings: {sorted(embeddings) or 'none'}"
            )
    else:
        raise SparseConfigError(
            f"sparse.tables: want 'auto' or a list of module names, got {tables!r:.80}"
        )
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for name in chosen:
        m = embeddings[name]
        if uses[id(m.weight)] > 1:
            raise SparseConfigError(
                f"sparse.tables: {name!r} shares its weight with another module (tied "
                "embeddings): a table served row by row cannot also be a dense weight; leave it "
                "out of sparse.tables"
            )
        if m.max_norm is not None or m.scale_grad_by_freq:
            raise SparseConfigError(
                f"sparse.tables: {name!r} sets max_norm or scale_grad_by_freq, which the shards' "
                "row-wise update does not apply; drop the option or leave the table dense"
            )
    if chosen and (problem := sparse_tables_problem(cfg)):
        raise SparseConfigError(problem)
    return [(n, embeddings[n]) for n in chosen]


def install(model: nn.Module, cfg: RunConfig) -> list[TensorSpec]:
    """Replace the selected embeddings of `model` by SparseEmbedding modules
    (their weights freed); returns the tables' specs."""
    specs = []
    for path, module in selected(model, cfg):
        parent = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
        proxy = SparseEmbedding(f"{path}.weight", module)
        setattr(parent, path.rpartition(".")[2], proxy)
        specs.append(proxy.spec)
        log.info("sparse table %s: %d x %d", proxy.spec.name, *proxy.spec.shape)
    return specs


def tables_of(model: nn.Module) -> dict[str, SparseEmbedding]:
    """The model's sparse tables by name."""
    return {m.spec.name: m for m in model.modules() if isinstance(m, SparseEmbedding)}


class TouchedRows:
    """The rows a step's forward passes pulled (`touched`, appended by the
    SparseEmbedding modules bound to it) and, after backward, their
    row-sparse gradient, cut per shard. Subclasses fetch rows (`rows`)."""

    def __init__(self, shards: int):
        self.n_shards = shards
        self.touched: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def bind(self, model: nn.Module) -> None:
        for table in tables_of(model).values():
            table.exchange = self

    def rows(self, table: str, ids: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def by_shard(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """A permutation grouping `ids` by owning shard, and each shard's count."""
        owner = owner_of(ids, self.n_shards)
        order = torch.argsort(owner, stable=True)
        return order, torch.bincount(owner, minlength=self.n_shards).tolist()

    def gradients(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """This step's row-sparse gradient per table: unique ids and each id's gradient summed
        over the forward passes that used it."""
        by_table: dict[str, list] = {}
        for table, ids, rows in self.touched:
            if rows.grad is not None:
                by_table.setdefault(table, []).append((ids, rows.grad.detach().cpu()))
        out = {}
        for table, entries in by_table.items():
            if len(entries) == 1:
                out[table] = entries[0]
                continue
            ids = torch.cat([i for i, _ in entries])
            grads = torch.cat([g for _, g in entries])
            unique, inverse = torch.unique(ids, return_inverse=True)
            summed = torch.zeros(unique.numel(), grads.shape[1], dtype=grads.dtype)
            out[table] = (unique, summed.index_add_(0, inverse, grads))
        return out

    def take_pushes(self) -> list[dict]:
        """Per shard, the frames of its PUSH_ROWS for this step (every table the step touched
        named in each, with no ids where none of that shard's rows: lazy Adam counts the
        table's steps alike on every shard); the step's rows are forgotten."""
        per_shard: list[dict] = [{} for _ in range(self.n_shards)]
        for table, (ids, grads) in self.gradients().items():
            order, counts = self.by_shard(ids)
            ids, grads = ids[order], grads[order]
            start = 0
            for i, n in enumerate(counts):
                per_shard[i][ids_key(table)] = ids[start : start + n]
                per_shard[i][rows_key(table)] = grads[start : start + n]
                start += n
        self.touched.clear()
        return per_shard
