"""Sparse tables on the wire: what a table is, and which shard holds which row.

A sparse table (an embedding served row by row, docs/sparse.md) is a 2-D
tensor of `rows` x `dim`. Every shard holds a slice of every table: row `i`
lives on shard `i % shards`, at local index `i // shards`. Modulo rather than
contiguous ranges because ids of real categorical data are far from uniform
(a power law, the hottest ids often the smallest after frequency-ordered
vocabularies): ranges would put every hot row on one shard, interleaving
spreads them evenly whatever the order; a hash would do the same for ids
that are already spread and cost a lookup per id. Dense tensors keep the
placement by speed (plan.py); rows are spread evenly because every worker
touches every shard's slice in every step.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import dtypes
from .dtypes import ITEMSIZES
from .errors import ProtocolError
from .ops import Status

# a table's frames in PULL_ROWS / PUSH_ROWS / ROWS messages: "<table>:ids" and "<table>:rows"
IDS_SUFFIX = ":ids"
ROWS_SUFFIX = ":rows"
TABLE_KINDS = ("embedding", "embedding_bag")


@dataclass(frozen=True)
class TableSpec:
    name: str  # the module's weight name in the model, e.g. "embeddings.3.weight"
    rows: int
    dim: int
    dtype: str = "float32"
    kind: str = "embedding"

    @classmethod
    def from_wire(cls, spec) -> "TableSpec":
        """Read `[name, rows, dim, dtype, kind]`; ProtocolError MALFORMED if ill-formed."""
        if not (
            isinstance(spec, (list, tuple))
            and len(spec) == 5
            and type(spec[0]) is str
            and spec[0]
            and type(spec[1]) is int
            and 0 < spec[1] < 2**62
            and type(spec[2]) is int
            and 0 < spec[2] < 2**31
            and spec[3] in ITEMSIZES
            and spec[4] in TABLE_KINDS
        ):
            raise ProtocolError(
                Status.MALFORMED,
                f"bad sparse table spec {spec!r:.80} (want [name, rows > 0, dim > 0, dtype, "
                f"kind in {TABLE_KINDS}])",
            )
        return cls(*spec)

    def to_wire(self) -> list:
        return [self.name, self.rows, self.dim, self.dtype, self.kind]

    @property
    def nbytes(self) -> int:
        return self.rows * self.dim * ITEMSIZES[self.dtype]

    def local_rows(self, shard: int, shards: int) -> int:
        """How many of the table's rows shard `shard` of `shards` holds."""
        return rows_on(self.rows, shard, shards)


def rows_on(rows: int, shard: int, shards: int) -> int:
    """Rows of a `rows`-row table that shard `shard` of `shards` holds (ids i with i % shards == shard)."""
    return max(0, (rows - shard + shards - 1) // shards)


def owner_of(ids, shards: int):
    """The shard index of each id (a tensor of int64 ids, or an int)."""
    return ids % shards


def local_index(ids, shards: int):
    """Where each id lies in its shard's slice."""
    return ids // shards


def global_ids(local, shard: int, shards: int):
    """The ids of local indices `local` on shard `shard` of `shards`."""
    return local * shards + shard


def ids_key(table: str) -> str:
    return table + IDS_SUFFIX


def rows_key(table: str) -> str:
    return table + ROWS_SUFFIX


def table_of(key: str) -> tuple[str, str]:
    """`(table, "ids" | "rows")` of a frame name; ProtocolError MALFORMED otherwise."""
    for suffix in (IDS_SUFFIX, ROWS_SUFFIX):
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[: -len(suffix)], suffix[1:]
    raise ProtocolError(
        Status.MALFORMED, f"frame {key!r:.80}: want '<table>{IDS_SUFFIX}' or '<table>{ROWS_SUFFIX}'"
    )


def table_spec(spec) -> TableSpec:
    """The TableSpec of a plan's `tables` entry (a TensorSpec of kind "table", shape (rows, dim))."""
    rows, dim = spec.shape
    return TableSpec(spec.name, int(rows), int(dim), spec.dtype)


def read_rows_request(
    tensors: dict,
    tables: dict[str, TableSpec],
    shard: int,
    shards: int,
    max_ids: int,
    with_rows: bool,
) -> dict:
    """The tables named by a PULL_ROWS (`with_rows` False) or PUSH_ROWS
    (`with_rows` True) message's frames, checked against this shard's
    `tables`: table -> ids, or table -> (ids, rows). Raises ProtocolError:
    UNKNOWN_TENSOR for a table this cluster does not have; DTYPE_NOT_ALLOWED
    for ids not int64 or rows not the table's dtype; SHAPE_MISMATCH for ids
    not 1-D or rows not len(ids) x dim; TOO_LARGE for more than `max_ids` ids;
    MALFORMED for a negative id, one past the table's end, one held by
    another shard, a repeated id, or a frame missing or not expected."""
    import torch  # only when a request is read: the wire module stays importable without torch

    named: dict[str, dict] = {}
    for key, value in tensors.items():
        table, what = table_of(key)
        if table not in tables:
            raise ProtocolError(
                Status.UNKNOWN_TENSOR, f"{table!r:.80} is not a sparse table of this cluster"
            )
        named.setdefault(table, {})[what] = value
    out = {}
    for table, frames in named.items():
        spec = tables[table]
        if "ids" not in frames or ("rows" in frames) != with_rows:
            want = "ids and rows" if with_rows else "ids only"
            raise ProtocolError(Status.MALFORMED, f"table {table!r}: want {want}")
        ids = frames["ids"]
        if ids.dtype != torch.int64:
            raise ProtocolError(
                Status.DTYPE_NOT_ALLOWED, f"table {table!r}: ids must be int64, got {ids.dtype}"
            )
        if ids.dim() != 1:
            raise ProtocolError(
                Status.SHAPE_MISMATCH, f"table {table!r}: ids must be 1-D, got {list(ids.shape)}"
            )
        if ids.numel() > max_ids:
            raise ProtocolError(
                Status.TOO_LARGE,
                f"table {table!r}: {ids.numel()} ids, at most {max_ids} (sparse.max_ids)",
            )
        if ids.numel():
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= spec.rows:
                bad = low if low < 0 else high
                raise ProtocolError(
                    Status.MALFORMED,
                    f"table {table!r}: id {bad} out of range [0, {spec.rows})",
                )
            foreign = ids[owner_of(ids, shards) != shard]
            if foreign.numel():
                raise ProtocolError(
                    Status.MALFORMED,
                    f"table {table!r}: id {int(foreign[0])} is held by shard "
                    f"{int(foreign[0]) % shards}, not {shard}",
                )
            if torch.unique(ids).numel() != ids.numel():
                raise ProtocolError(Status.MALFORMED, f"table {table!r}: repeated ids")
        if not with_rows:
            out[table] = ids
            continue
        rows = frames["rows"]
        if dtypes.DTYPE_NAMES.get(rows.dtype) != spec.dtype:
            raise ProtocolError(
                Status.DTYPE_NOT_ALLOWED,
                f"table {table!r}: rows must be {spec.dtype}, got {rows.dtype}",
            )
        if tuple(rows.shape) != (ids.numel(), spec.dim):
            raise ProtocolError(
                Status.SHAPE_MISMATCH,
                f"table {table!r}: rows of shape {list(rows.shape)}, want "
                f"[{ids.numel()}, {spec.dim}]",
            )
        out[table] = (ids, rows)
    return out
