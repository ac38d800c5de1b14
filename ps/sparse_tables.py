"""A shard's slices of the sparse tables, their row-wise optimizers, and the open rounds.

A sparse table (an `nn.Embedding` / `nn.EmbeddingBag` weight served row by
row, docs/sparse.md) is spread over every shard: row `i` lives on shard
`i % shards` at local index `i // shards` (proto/sparse.py). A worker pulls
the rows its batch names and pushes one gradient row per distinct id it
touched (its batch's repeats already summed); only those rows change.

**Initial values.** Every slice starts as `normal(0, sparse.init_std)`, drawn
by the shard that holds it from a generator seeded by (the run's seed, the
table's name, the shard's index). The same plan therefore gives the same
values on every start, and a backup shard built from the plan holds the
same rows as its primary without copying them.

**When updates apply.** Under the synchronous families (sync, grouping,
balanced) the pushes of one synchronous group form a round: the round's rows
are summed per id over its members and divided by the number of members that
pushed, the same plain mean the dense tables get (a member that did not touch
a row adds zero to it), and applied once, when every member has pushed. A
member's next pull waits until its round has closed. If the plan changes
while a round is open (a member left), the round is applied with the pushes
it has, divided by their number. Under the asynchronous families (async, ssp,
eager) every push is applied when it arrives, undivided.

**Optimizers** (`sparse.optimizer`), applied to the touched rows `i` with
gradient row `g` (the round's mean or one push), every other row and its
optimizer state unchanged; equal to the torch optimizer named on the whole
table with the whole-table gradient (zero on untouched rows):

- `sgd`: `w[i] -= lr * g` (torch.optim.SGD, no momentum).
- `adagrad`: `s[i] += g * g; w[i] -= lr * g / (sqrt(s[i]) + eps)`, `s`
  starting at `initial_accumulator_value` (torch.optim.Adagrad with no
  lr_decay nor weight_decay; eps defaults to 1e-10).
- `rowwise_adagrad`: one accumulator per row (FBGEMM's exact row-wise
  Adagrad): `a[i] += mean(g * g); w[i] -= lr * g / (sqrt(a[i]) + eps)`;
  eps defaults to 1e-8, as in FBGEMM.
- `adam`: lazy Adam, as torch.optim.SparseAdam: the moments of touched rows
  only, `m[i] = b1 m[i] + (1 - b1) g`, `v[i] = b2 v[i] + (1 - b2) g * g`,
  `w[i] -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m[i] / (sqrt(v[i]) + eps)`,
  where `t` counts the table's steps on this shard: one per round (or push,
  under the asynchronous families) that names the table, even with no ids on
  this shard (torch.optim.SparseAdam counts a step for an empty gradient too,
  so a worker that names every table it touched in every shard's push gets
  torch's step count on every shard). eps defaults to 1e-8.

**Memory.** A shard holds its slices (rows / shards x dim x itemsize per
table) plus optimizer state: none for sgd, one more slice for adagrad, one
value per row (1/dim of a slice) for rowwise_adagrad, two more slices for
adam. Everything is allocated when the shard starts, so its memory is known
up front and the step path allocates only tensors of the touched rows; a
shard that cannot hold its tables fails at start, not hours into a run.
(Allocating the optimizer state of a row on its first touch would save memory
for tables whose rows are never all touched, at the cost of a growing,
unpredictable footprint; it is left out.) Optimizer state has the table's
dtype, as torch keeps it. Open rounds hold a copy of each pushed row until
they close.
"""

from __future__ import annotations

import hashlib
import logging
import math

import torch

from hetps.proto.dtypes import DTYPES
from hetps.proto.sparse import TableSpec, global_ids, local_index
from hetps.runconfig.schema import SparseConfig

log = logging.getLogger(__name__)

MODES = ("round", "each")
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
# eps when the config leaves it null: torch's defaults, FBGEMM's for its row-wise Adagrad
DEFAULT_EPS = {"sgd": 0.0, "adagrad": 1e-10, "rowwise_adagrad": 1e-8, "adam": 1e-8}
STATE_VERSION = 1


def init_seed(seed: int, table: str, shard: int) -> int:
    """The generator seed of `table`'s slice on `shard`: stable across processes and
    Python versions (no `hash()`), so every node derives the same one."""
    digest = hashlib.blake2b(f"{seed}/{table}/{shard}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class SparseTable:
    """One table's slice on this shard and its optimizer state.

    `weight` is the slice, row `j` holding global row `j * shards + shard`;
    `state` the optimizer's tensors by name (`sum` for adagrad, `acc` for
    rowwise_adagrad, `exp_avg` and `exp_avg_sq` for adam); `step` the number
    of optimizer steps taken (adam's bias correction)."""

    def __init__(self, spec: TableSpec, shard: int, shards: int, cfg: SparseConfig, seed: int):
        self.spec = spec
        self.shard = shard
        self.shards = shards
        n = spec.local_rows(shard, shards)
        dtype = DTYPES[spec.dtype]
        if not dtype.is_floating_point:
            raise ValueError(
                f"sparse table {spec.name!r}: dtype {spec.dtype} is not floating point"
            )
        g = torch.Generator().manual_seed(init_seed(seed, spec.name, shard))
        self.weight = torch.empty(n, spec.dim, dtype=dtype).normal_(0, cfg.init_std, generator=g)
        opt = cfg.optimizer
        self.name = opt.name
        self.state: dict[str, torch.Tensor] = {}
        if opt.name == "adagrad":
            self.state["sum"] = torch.full_like(self.weight, opt.initial_accumulator_value)
        elif opt.name == "rowwise_adagrad":
            self.state["acc"] = torch.full((n,), opt.initial_accumulator_value, dtype=dtype)
        elif opt.name == "adam":
            self.state["exp_avg"] = torch.zeros_like(self.weight)
            self.state["exp_avg_sq"] = torch.zeros_like(self.weight)
        self.step = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the slice and its optimizer state."""
        tensors = [self.weight, *self.state.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def full_slice(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(global ids, a copy of their rows) of the whole slice, for export."""
        local = torch.arange(self.weight.shape[0], dtype=torch.int64)
        return global_ids(local, self.shard, self.shards), self.weight.clone()


class SparseTables:
    """All sparse-table slices of one shard, their row-wise optimizer state, and the open rounds.

    `mode` "round": a synchronous group's pushes are summed per id, divided by
    the number of members that pushed, and applied once when every member has
    pushed (sync, grouping, balanced). `mode` "each": every push is applied
    when it arrives (async, ssp, eager). Not thread-safe: the shard's loop owns it.
    Callers validate ids (int64, unique, owned by this shard) before calling."""

    def __init__(
        self,
        specs: list[TableSpec],
        shard: int,
        shards: int,
        cfg: SparseConfig,
        seed: int,
        mode: str,
    ):
        if mode not in MODES:
            raise ValueError(f"sparse tables: mode {mode!r} not in {MODES}")
        opt = cfg.optimizer
        if opt.name not in OPTIMIZERS:
            raise ValueError(f"sparse.optimizer.name: {opt.name!r} not in {OPTIMIZERS}")
        if not 0 <= shard < shards:
            raise ValueError(f"sparse tables: shard {shard} not in [0, {shards})")
        self.shard = shard
        self.shards = shards
        self.mode = mode
        self.optimizer = opt.name
        self.lr = float(opt.lr)
        self.eps = float(DEFAULT_EPS[opt.name] if opt.eps is None else opt.eps)
        self.beta1, self.beta2 = (float(b) for b in opt.betas)
        self.tables = {s.name: SparseTable(s, shard, shards, cfg, seed) for s in specs}
        # open rounds: sorted member tuple -> worker -> table -> [(ids, rows), ...]
        self.rounds: dict[tuple[int, ...], dict[int, dict[str, list]]] = {}
        self._round_of: dict[int, tuple[int, ...]] = {}  # worker -> key of its open round
        self._warned_repush = False
        self.rows_pulled = 0
        self.rows_updated = 0
        self.updates = 0

    # ---- reads

    def table(self, name: str) -> SparseTable:
        """The table `name` (its live slice and optimizer state: read, do not write)."""
        try:
            return self.tables[name]
        except KeyError:
            raise ValueError(
                f"sparse table {name!r}: not served (tables: {sorted(self.tables)[:5]})"
            ) from None

    def full_slice(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(global ids, a copy of their rows) of table `name`'s whole slice on this shard."""
        return self.table(name).full_slice()

    def rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Current values of rows `ids` (global int64 ids owned by this shard), shape
        (len(ids), dim), a new tensor (safe to send while later updates run)."""
        t = self.table(table)
        out = t.weight.index_select(0, local_index(ids, self.shards))
        self.rows_pulled += int(ids.numel())
        return out

    def waiting(self, worker: int) -> bool:
        """True while `worker`'s last push sits in an open round (its next pull must wait)."""
        return worker in self._round_of

    # ---- writes

    def push(
        self,
        worker: int,
        members: list[int],
        grads: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> bool:
        """One worker's row gradients of one step: table -> (unique global ids owned
        here, rows (n, dim)). `members`: the node ids of the worker's synchronous
        group in the current plan ("round" mode; ignored in "each" mode). A push with
        no tables still counts as the worker's contribution to its round. Returns True
        if an update was applied now (the round closed, or "each" mode).

        ValueError naming the table if a table is not served, its ids are not a 1-D
        int64 tensor of unique ids, or its rows are not (len(ids), dim)."""
        parts = {name: self._checked(name, ids, rows) for name, (ids, rows) in grads.items()}
        if self.mode == "each":
            self._apply({name: [p] for name, p in parts.items()}, 1)
            return True
        key = tuple(sorted(set(members)))
        if worker not in key:
            raise ValueError(f"sparse push: worker {worker} is not in its group {list(key)}")
        old = self._round_of.get(worker)
        if old is not None and old != key:
            # its group changed under an open round: the plan moved on; finish the old one
            log.warning(
                "sparse tables: worker %s pushed for group %s with a round of group %s open; "
                "applying that round with the pushes it has",
                worker,
                list(key),
                list(old),
            )
            self._close(old)
        contributions = self.rounds.setdefault(key, {})
        mine = contributions.get(worker)
        if mine is not None and not self._warned_repush:
            self._warned_repush = True
            log.warning(
                "sparse tables: worker %s pushed again while its push of this round was open; "
                "adding the two (logged once)",
                worker,
            )
        mine = contributions.setdefault(worker, {})
        closes = set(contributions) >= set(key)
        for name, (ids, rows) in parts.items():
            # a round left open holds copies: the pushed tensors may be a message's memory
            mine.setdefault(name, []).append((ids, rows) if closes else (ids.clone(), rows.clone()))
        self._round_of[worker] = key
        if closes:
            self._close(key)
        return closes

    def close_rounds(self) -> bool:
        """Apply every open round with the pushes it has, divided by their number (the
        plan changed: a member left); True if any round was open."""
        keys = list(self.rounds)
        for key in keys:
            self._close(key)
        return bool(keys)

    def _checked(self, name: str, ids: torch.Tensor, rows: torch.Tensor):
        t = self.table(name)
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError(f"sparse table {name!r}: ids must be a 1-D int64 tensor")
        if tuple(rows.shape) != (ids.numel(), t.spec.dim):
            raise ValueError(
                f"sparse table {name!r}: rows of shape {tuple(rows.shape)}, want "
                f"({ids.numel()}, {t.spec.dim})"
            )
        if ids.numel() > 1 and torch.unique(ids).numel() != ids.numel():
            raise ValueError(f"sparse table {name!r}: ids pushed are not unique")
        return ids, rows

    def _close(self, key: tuple[int, ...]) -> None:
        contributions = self.rounds.pop(key)
        for worker in contributions:
            if self._round_of.get(worker) == key:
                del self._round_of[worker]
        tables: dict[str, list] = {}
        for mine in contributions.values():
            for name, parts in mine.items():
                tables.setdefault(name, []).extend(parts)
        self._apply(tables, len(contributions))

    def _apply(self, tables: dict[str, list], contributors: int) -> None:
        """One optimizer step per table of `tables` (table -> [(ids, rows), ...]) with the
        per-id sum of its parts divided by `contributors`. A table named with no ids at
        all counts a step and changes nothing, as torch.optim.SparseAdam does with an
        empty gradient."""
        for name, parts in tables.items():
            t = self.tables[name]
            parts = [p for p in parts if p[0].numel()]
            if not parts:
                t.step += 1
                continue
            if len(parts) == 1:
                ids, g = parts[0]
                g = g.to(t.weight.dtype)
                if contributors != 1:
                    g = g / contributors
            else:
                ids, inverse = torch.unique(torch.cat([p[0] for p in parts]), return_inverse=True)
                rows = torch.cat([p[1] for p in parts]).to(t.weight.dtype)
                g = torch.zeros(ids.numel(), t.spec.dim, dtype=t.weight.dtype)
                g.index_add_(0, inverse, rows)
                if contributors != 1:
                    g.div_(contributors)
            self._step(t, local_index(ids, self.shards), g)
            self.rows_updated += int(ids.numel())
        self.updates += 1

    def _step(self, t: SparseTable, local: torch.Tensor, g: torch.Tensor) -> None:
        """The optimizer on rows `local` of `t` with gradient rows `g`: the touched rows
        gathered, updated with torch's own arithmetic in torch's order, written back."""
        t.step += 1
        lr, w = self.lr, t.weight
        if self.optimizer == "sgd":
            # as torch.optim.SGD: param.add_(grad, alpha=-lr)
            w.index_copy_(0, local, w.index_select(0, local).add_(g, alpha=-lr))
        elif self.optimizer == "adagrad":
            # as torch.optim.Adagrad's dense step (lr_decay 0, weight_decay 0)
            s = t.state["sum"].index_select(0, local).addcmul_(g, g, value=1)
            std = s.sqrt().add_(self.eps)
            t.state["sum"].index_copy_(0, local, s)
            w.index_copy_(0, local, w.index_select(0, local).addcdiv_(g, std, value=-lr))
        elif self.optimizer == "rowwise_adagrad":
            a = t.state["acc"].index_select(0, local).add_(g.mul(g).mean(dim=1))
            std = a.sqrt().add_(self.eps)
            t.state["acc"].index_copy_(0, local, a)
            w.index_copy_(
                0, local, w.index_select(0, local).addcdiv_(g, std.unsqueeze(1), value=-lr)
            )
        else:
            # torch.optim._functional.sparse_adam, on the gathered rows, in its order
            m, v = t.state["exp_avg"], t.state["exp_avg_sq"]
            b1, b2 = self.beta1, self.beta2
            old_m = m.index_select(0, local)
            m_update = g.sub(old_m).mul_(1 - b1)
            m.index_add_(0, local, m_update)
            old_v = v.index_select(0, local)
            v_update = g.pow(2).sub_(old_v).mul_(1 - b2)
            v.index_add_(0, local, v_update)
            numer = m_update.add_(old_m)
            v_update.add_(old_v)
            denom = v_update.sqrt_().add_(self.eps)
            bias_correction1 = 1 - b1**t.step
            bias_correction2 = 1 - b2**t.step
            step_size = lr * math.sqrt(bias_correction2) / bias_correction1
            w.index_add_(0, local, -step_size * numer.div_(denom))

    # ---- checkpoints and stats

    def state_dict(self) -> dict:
        """Every table's slice and optimizer state (step counts included), the open
        rounds and the counters: copies, torch.save-able, consistent as of this call."""
        return {
            "version": STATE_VERSION,
            "shard": self.shard,
            "shards": self.shards,
            "optimizer": self.optimizer,
            "tables": {
                name: {
                    "weight": t.weight.clone(),
                    "state": {k: s.clone() for k, s in t.state.items()},
                    "step": t.step,
                }
                for name, t in self.tables.items()
            },
            "rounds": [
                {
                    "members": list(key),
                    "pushes": {
                        w: {
                            n: [(i.clone(), r.clone()) for i, r in parts]
                            for n, parts in mine.items()
                        }
                        for w, mine in contributions.items()
                    },
                }
                for key, contributions in self.rounds.items()
            ],
            "counters": [self.rows_pulled, self.rows_updated, self.updates],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore from `state_dict()` of the same tables on the same shard of the same
        number of shards with the same optimizer; ValueError naming what differs, before
        anything is changed."""
        where = f"sparse tables of shard {self.shard}/{self.shards}"
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"{where}: checkpoint version {state.get('version')!r}, want 1")
        if (state["shard"], state["shards"]) != (self.shard, self.shards):
            raise ValueError(
                f"{where}: checkpoint of shard {state['shard']}/{state['shards']}: not the "
                "same placement"
            )
        if state["optimizer"] != self.optimizer:
            raise ValueError(
                f"{where}: checkpoint optimizer state is {state['optimizer']!r}, this run's "
                f"sparse.optimizer.name is {self.optimizer!r}"
            )
        tables = state["tables"]
        if set(tables) != set(self.tables):
            raise ValueError(
                f"{where}: checkpoint holds tables {sorted(tables)[:5]}, this run serves "
                f"{sorted(self.tables)[:5]}"
            )
        for name, saved in tables.items():
            t = self.tables[name]
            live = {"weight": t.weight, **t.state}
            got = {"weight": saved["weight"], **saved["state"]}
            if set(got) != set(live) or any(got[k].shape != live[k].shape for k in live):
                raise ValueError(
                    f"{where}: table {name!r} in the checkpoint has "
                    f"{ {k: tuple(v.shape) for k, v in got.items()} }, want "
                    f"{ {k: tuple(v.shape) for k, v in live.items()} }"
                )
        for name, saved in tables.items():
            t = self.tables[name]
            t.weight.copy_(saved["weight"])
            for k, s in saved["state"].items():
                t.state[k].copy_(s)
            t.step = int(saved["step"])
        self.rounds, self._round_of = {}, {}
        for r in state["rounds"]:
            key = tuple(r["members"])
            self.rounds[key] = {
                int(w): {n: [(i.clone(), g.clone()) for i, g in parts] for n, parts in mine.items()}
                for w, mine in r["pushes"].items()
            }
            for w in self.rounds[key]:
                self._round_of[w] = key
        self.rows_pulled, self.rows_updated, self.updates = (int(c) for c in state["counters"])

    def stats(self) -> dict:
        """Counters since start (or as restored) and the memory held."""
        return {
            "sparse_rows_pulled": self.rows_pulled,
            "sparse_rows_updated": self.rows_updated,
            "sparse_updates": self.updates,
            "sparse_open_rounds": len(self.rounds),
            "sparse_bytes": sum(t.nbytes for t in self.tables.values()),
        }
