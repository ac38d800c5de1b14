"""The cluster PLAN: who the workers and shards are and which shard owns
which tensor. Made by the scheduler, versioned by `plan_id`, shipped as plain
data in PLAN messages, read by shards and workers.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

from .dtypes import ITEMSIZES
from .errors import ProtocolError
from .ops import Status

# "table": a sparse table (proto/sparse.py), shape (rows, dim); served row by row by every shard
TENSOR_KINDS = ("param", "buffer", "table")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    # "param" (optimizer-updated), "buffer" (e.g. BatchNorm statistics) or "table" (served row by row)
    kind: str = "param"

    @classmethod
    def from_wire(cls, spec) -> "TensorSpec":
        """Read `[name, dtype, shape, kind]`. Raises ProtocolError: MALFORMED
        for a bad layout, DTYPE_NOT_ALLOWED for a dtype outside the allow-list."""
        if not (
            isinstance(spec, (list, tuple))
            and len(spec) == 4
            and type(spec[0]) is str
            and type(spec[1]) is str
            and isinstance(spec[2], (list, tuple))
            and all(type(d) is int and 0 <= d < 2**63 for d in spec[2])
            and spec[3] in TENSOR_KINDS
        ):
            raise ProtocolError(
                Status.MALFORMED,
                f"bad tensor spec {spec!r:.80} (want [name, dtype, "
                f"[dims >= 0], kind in {TENSOR_KINDS}])",
            )
        name, dtype, shape, kind = spec
        if dtype not in ITEMSIZES:
            raise ProtocolError(
                Status.DTYPE_NOT_ALLOWED,
                f"tensor {name!r}: dtype {dtype!r} not in {sorted(ITEMSIZES)}",
            )
        return cls(name, dtype, tuple(shape), kind)

    def to_wire(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.kind]

    @property
    def nbytes(self) -> int:
        n = ITEMSIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def schema_hash(specs: list[TensorSpec]) -> str:
    """Fingerprint of a model's tensor list; workers of one run must agree on it."""
    text = ";".join(f"{s.name}:{s.dtype}:{list(s.shape)}:{s.kind}" for s in specs)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# cluster.chunk_bytes=auto: parts of about 1/AUTO_PARTS_PER_SHARD of a shard's fair share of the
# model's bytes. Placement moves to the next shard within half a part of the boundary, so a shard
# holds at most about one part more than its share: 1/8 keeps the busiest within ~1.1x of fair
# while a shard's push still carries only ~8 parts per large tensor (ps-lite and BytePS split
# keys the same way: into pieces well below a server's share, then spread them evenly).
AUTO_PARTS_PER_SHARD = 8
AUTO_MIN_CHUNK_BYTES = 4096  # below this a part's per-tensor handling outweighs the balance it buys


def chunk_size(setting: int | str, specs: list[TensorSpec], shards: int) -> int:
    """The part size `cluster.chunk_bytes` means for a model of `specs` on
    `shards` shards: an int as given (0: never cut); "auto": 0 on one shard,
    else the model's bytes / (shards x AUTO_PARTS_PER_SHARD), at least
    AUTO_MIN_CHUNK_BYTES. Workers and the scheduler derive the same size
    from the same config and model."""
    if setting != "auto":
        return int(setting)
    if shards <= 1:
        return 0
    total = sum(s.nbytes for s in specs)
    return max(AUTO_MIN_CHUNK_BYTES, -(-total // (shards * AUTO_PARTS_PER_SHARD)))


def chunk_specs(
    specs: list[TensorSpec], max_bytes: int | str, shards: int = 1
) -> tuple[list[TensorSpec], dict[str, dict]]:
    """Cut every tensor larger than `max_bytes` (0: none; "auto": see
    `chunk_size`, for `shards` shards) into 1-D parts `NAME#0, NAME#1, ...`
    of at most that many bytes, in place in forward order, so placement can
    spread one large tensor over several shards. Returns the new spec list
    and name -> {"shape": original shape, "parts": part names}."""
    max_bytes = chunk_size(max_bytes, specs, shards)
    out: list[TensorSpec] = []
    chunks: dict[str, dict] = {}
    for s in specs:
        if not max_bytes or s.nbytes <= max_bytes:
            out.append(s)
            continue
        itemsize = ITEMSIZES[s.dtype]
        numel, per = s.nbytes // itemsize, max(1, max_bytes // itemsize)
        parts = [
            TensorSpec(f"{s.name}#{i}", s.dtype, (min(per, numel - start),), s.kind)
            for i, start in enumerate(range(0, numel, per))
        ]
        out.extend(parts)
        chunks[s.name] = {"shape": list(s.shape), "parts": [p.name for p in parts]}
    return out, chunks


@dataclass(frozen=True)
class NodeEntry:
    node_id: int
    rank: int
    address: str = ""


@dataclass(frozen=True)
class ClusterPlan:
    plan_id: int
    algorithm: str
    workers: list[NodeEntry]
    shards: list[NodeEntry]  # fastest first
    tensors: list[TensorSpec]  # forward order
    placement: dict[str, int]  # tensor name -> index into `shards`
    schema_hash: str = ""
    groups: list[list[int]] = field(default_factory=list)  # worker node ids per synchronous group
    speeds: dict[str, float] = field(default_factory=dict)  # node id -> measured speed
    shares: dict[str, float] = field(default_factory=dict)  # worker node id -> relative data share
    placement_id: int = 1  # plan id that last changed the placement
    # name -> {shape, parts}: tensors cut into 1-D parts
    chunks: dict[str, dict] = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    run_id: str = ""  # names the run's checkpoints; kept by a resumed run
    # resolved; every node checks its config against them
    algorithm_params: dict = field(default_factory=dict)
    # cluster.replicas: shard node id -> {"node": node id of the process holding its backup, "address": where}
    backups: dict = field(default_factory=dict)
    # shard node id -> node id of the process serving it now (a promoted backup); absent: itself
    served_by: dict = field(default_factory=dict)
    # worker node id -> its batch size (balanced)
    batches: dict[str, float] = field(default_factory=dict)
    # sparse tables (kind "table"), in forward order: every shard holds a slice of each (sparse.py)
    tables: list[TensorSpec] = field(default_factory=list)
    # the first member's node id (a string) of each group of two or more -> the plan since which
    # the group has had exactly these members: names its collectives (worker/group_reduce.py)
    group_since: dict[str, int] = field(default_factory=dict)

    def shard_index(self, node_id: int) -> int:
        for i, s in enumerate(self.shards):
            if s.node_id == node_id:
                return i
        raise KeyError(f"node {node_id} is not a shard of plan {self.plan_id}")

    def owned(self, index: int) -> list[TensorSpec]:
        """Specs of the tensors shard `index` holds, in forward order."""
        return [t for t in self.tensors if self.placement[t.name] == index]

    def worker_ids(self) -> list[int]:
        return [w.node_id for w in self.workers]

    def share_weights(self) -> list[float]:
        """Data-share weights in worker order (equal when the plan sets none)."""
        return [float(self.shares.get(str(w), 1.0)) for w in self.worker_ids()]

    def batch_of(self, worker: int, default: int) -> int:
        """Worker `worker`'s batch size: the plan's (balanced), else `default`."""
        return int(self.batches.get(str(worker), default))

    def group_of(self, worker: int) -> int:
        for g, members in enumerate(self.groups):
            if worker in members:
                return g
        return 0

    def to_dict(self) -> dict:
        data = asdict(self)
        data["tensors"] = [t.to_wire() for t in self.tensors]
        data["tables"] = [t.to_wire() for t in self.tables]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "ClusterPlan":
        return cls(
            plan_id=data["plan_id"],
            algorithm=data["algorithm"],
            workers=[NodeEntry(**w) for w in data["workers"]],
            shards=[NodeEntry(**s) for s in data["shards"]],
            tensors=[TensorSpec.from_wire(t) for t in data["tensors"]],
            placement=dict(data["placement"]),
            schema_hash=data.get("schema_hash", ""),
            groups=[list(g) for g in data.get("groups", [])],
            speeds=dict(data.get("speeds", {})),
            shares=dict(data.get("shares", {})),
            placement_id=data.get("placement_id", 1),
            chunks=dict(data.get("chunks", {})),
            info=dict(data.get("info", {})),
            run_id=str(data.get("run_id", "")),
            group_since=dict(data.get("group_since", {})),
            algorithm_params=dict(data.get("algorithm_params", {})),
            backups=dict(data.get("backups", {})),
            served_by=dict(data.get("served_by", {})),
            batches=dict(data.get("batches", {})),
            tables=[TensorSpec.from_wire(t) for t in data.get("tables", [])],
        )
