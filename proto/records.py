"""Typed records for the free-form fields of messages, and their readers.

TRUST BOUNDARY. A message's header fields are annotated with what they hold
(messages.py); the fields below carry structure of their own, which the codec
reads here from a peer's plain value at decode, after checking its wire type
(each field names its reader: messages.read_as). A sender builds the records
itself (or reads its own plain values with the same readers):

    HEARTBEAT.stats, BYE.stats  -> NodeStats (counts and speed: finite, bounded;
                                   whom a shard waits for: waits.py)
    HEARTBEAT.records           -> list of step records (STEP_RECORD_FIELDS typed, `step`
                                   and `ago` required; other keys plain values)
    HEARTBEAT.hold_s            -> a finite, bounded float
    REGISTER.tensor_specs       -> list[TensorSpec] (dtype allow-list, unique names)
    REGISTER.speed              -> a finite, bounded float
    REGISTER.startup, .spare_slots, .agreed -> bounded maps and lists of plain values
    PUSH.info                   -> PushInfo (known keys only)
    PARAMS.ack                  -> FusedAck, or None when the reply carries no ACK
    PLAN.plan, SNAPSHOT.plan    -> ClusterPlan (placement and groups consistent)

A bad value raises ProtocolError(MALFORMED, or DTYPE_NOT_ALLOWED) naming the
field; the codec adds the request id. Numbers the scheduler computes with are
bounded well below overflow, so one node's heartbeat cannot make placement or
grouping produce inf or NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from .plan import ClusterPlan, NodeEntry, TensorSpec
from .read_values import (
    MAX_RATE,
    MAX_SECONDS,
    MAX_TEXT,
    is_int,
    read_count,
    read_int,
    read_map,
    read_number,
    read_plain,
)
from .read_values import bad as _bad
from .waits import HeldUp, WaitingFor, read_held, read_waiting

RESERVED_RECORD_KEYS = ("kind", "t")  # the run log's own keys for a step record
MAX_PHASES = 16  # REGISTER's `startup` carries at most this many phases (runtime/startup.py)
MAX_PHASE_S = 86400.0  # a phase longer than a day is a bad value, not a slow start


# ---------------------------------------------------------------- heartbeat statistics

_STAT_COUNTS = (
    "steps",
    "bytes_sent",
    "bytes_received",
    "version",
    "rounds",
    "resent",
    "dropped",
    "delayed",
    "grad_dense_bytes",
    "grad_sent_bytes",
    "samples",
)


_STAT_WAITS = {"waiting": read_waiting, "held": read_held}  # stall attribution (waits.py)


@dataclass(frozen=True)
class NodeStats:
    """A node's statistics as its heartbeats and BYE carry them. The fields
    the scheduler counts or plans with are typed (None: not reported); the
    rest is role-specific plain data kept for the summary (`extra`)."""

    steps: int | None = None  # training steps done (workers)
    bytes_sent: int | None = None
    bytes_received: int | None = None
    version: int | None = None  # updates applied (shards)
    rounds: int | None = None  # communication rounds (averaging algorithms)
    resent: int | None = None  # requests re-sent after a timeout
    dropped: int | None = None  # emulated wire faults
    delayed: int | None = None
    grad_dense_bytes: int | None = None  # gradient bytes before compression
    grad_sent_bytes: int | None = None  # ... and after
    speed: float | None = None  # samples/s (workers), measured while training
    # shards: whom their rounds and parked pulls wait for
    waiting: tuple[WaitingFor, ...] | None = None
    held: tuple[HeldUp, ...] | None = None  # shards: seconds each node held their waiters up
    samples: int | None = None  # training examples computed on (workers)
    extra: dict = field(default_factory=dict)

    @classmethod
    def read(cls, value: Any) -> "NodeStats":
        """From the wire's map (a NodeStats passes as it is: a restored scheduler state)."""
        if isinstance(value, cls):
            return value
        stats = read_map("stats", value)
        typed: dict[str, Any] = {
            k: read_count(f"stats.{k}", stats.pop(k)) for k in _STAT_COUNTS if k in stats
        }
        if "speed" in stats:
            typed["speed"] = read_number("stats.speed", stats.pop("speed"), MAX_RATE)
        for key, read in _STAT_WAITS.items():
            if key in stats:
                typed[key] = read(stats.pop(key))
        return cls(**typed, extra=stats)

    def as_dict(self) -> dict:
        """The wire form: reported fields and extras, in one map."""
        out = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "extra" and getattr(self, f.name) is not None
        }
        for key in _STAT_WAITS:
            if key in out:
                out[key] = [e.to_wire() for e in out[key]]
        return {**out, **self.extra}

    to_wire = as_dict

    def get(self, key: str, default: Any = None) -> Any:
        """A statistic by its wire name, `default` when not reported."""
        if key in _STAT_COUNTS or key == "speed" or key in _STAT_WAITS:
            value = getattr(self, key)
            return default if value is None else value
        return self.extra.get(key, default)

    def __bool__(self) -> bool:
        return bool(self.as_dict())


# ---------------------------------------------------------------- step records

# `ago`: a step that ended more than a day before its heartbeat left is a bad value, not a late
# report: a node's records wait for an answer at most cluster.scheduler_grace_s (30 s by default),
# then the node gives up on the scheduler and stops
MAX_RECORD_AGE_S = 86400.0


def _real(where: str, value: Any) -> float:
    """Any float, NaN and +-inf included (a diverged loss is worth reporting); an int is made a
    float; a bool is no number."""
    if not (is_int(value) or isinstance(value, float)):
        _bad(where, f"must be a number, got {value!r:.40}")
    return float(value)


def _reals(where: str, value: Any) -> list[float]:
    if type(value) is not list:
        _bad(where, f"must be a list of numbers, got {value!r:.40}")
    return [_real(f"{where}[{i}]", v) for i, v in enumerate(value)]


def _or_null(read: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda where, value: None if value is None else read(where, value)


def _seconds(where: str, value: Any) -> float:
    return read_number(where, value, MAX_SECONDS)


SECONDS = f"float in [0, {MAX_SECONDS:g}]"


@dataclass(frozen=True)
class StepField:
    """One field of a step record: whether a record must carry it, its type as
    docs/protocol.md names it, and its reader (where, value) -> typed value."""

    required: bool
    kind: str
    read: Callable[[str, Any], Any]
    meaning: str


# What hetps's workers send (worker/trainer.py, overlap.py, local.py, diloco.py, sim/). A record
# needs only what places it, `step` and `ago`: the scheduler knows who sent it (it writes `worker`,
# the sender's rank) and a client may measure nothing else; whatever else it sends is typed here.
STEP_RECORD_FIELDS: dict[str, StepField] = {
    "step": StepField(
        True, "int >= 0", read_count, "steps this worker has done, this one included"
    ),
    "ago": StepField(
        True,
        f"float in [0, {MAX_RECORD_AGE_S:g}]",
        lambda where, value: read_number(where, value, MAX_RECORD_AGE_S),
        "seconds from the end of the step to the heartbeat",
    ),
    "worker": StepField(
        False, "int >= 0", read_count, "the sender's rank; the scheduler records the sender's own"
    ),
    "loss": StepField(
        False,
        "float",
        _real,
        "training loss; NaN and inf are reported (the divergence guard judges them)",
    ),
    "staleness": StepField(
        False, "int >= 0", read_count, "updates applied since the values the step computed on"
    ),
    "group": StepField(False, "int >= 0", read_count, "the worker's group in the plan"),
    "compute_s": StepField(False, SECONDS, _seconds, "forward and backward"),
    "step_s": StepField(False, SECONDS, _seconds, "the whole step, pushes and pulls included"),
    "wait_s": StepField(False, SECONDS, _seconds, "overlapped pushes: waiting for the last"),
    "grad_norm": StepField(
        False,
        "float >= 0 or null",
        _or_null(lambda where, value: read_number(where, value, math.inf)),
        "the gradient's L2 norm before clipping (null: not finite)",
    ),
    "round": StepField(False, "int >= 0", read_count, "model averaging: rounds taken"),
    "period": StepField(
        False,
        "int >= 0 or null",
        _or_null(read_count),
        "model averaging: local steps per round (null: periods in seconds)",
    ),
    "variance": StepField(False, "float", _real, "model averaging: the last round's variance"),
    "weights": StepField(False, "list of floats", _reals, "model averaging: the round's weights"),
    "weights_round": StepField(False, "int >= 0", read_count, "the round `weights` belong to"),
}
_REQUIRED = [key for key, f in STEP_RECORD_FIELDS.items() if f.required]


def read_step_record(where: str, value: Any) -> dict:
    """One step record: a map of plain values, each of STEP_RECORD_FIELDS read by its reader."""
    rec = read_map(where, value)
    clash = [k for k in RESERVED_RECORD_KEYS if k in rec]
    if clash:
        _bad(where, f"keys {clash} are reserved")
    for key in _REQUIRED:
        if key not in rec:
            _bad(f"{where}.{key}", f"missing (a step record needs {' and '.join(_REQUIRED)})")
    for key, f in STEP_RECORD_FIELDS.items():
        if key in rec:
            rec[key] = f.read(f"{where}.{key}", rec[key])
    return rec


def read_step_records(value: Any) -> list[dict]:
    """HEARTBEAT.records: a list of step records (read_step_record)."""
    if type(value) is not list:
        _bad("records", f"must be a list, got {type(value).__name__}")
    return [read_step_record(f"records[{i}]", rec) for i, rec in enumerate(value)]


# ---------------------------------------------------------------- worker -> shard extras


@dataclass(frozen=True)
class PushInfo:
    """What a model-averaging worker reports with its model (None: not sent)."""

    steps: int | None = None  # local steps since the last average
    period: int | None = None  # the period it used
    lr: float | None = None
    weight_decay: float | None = None
    final: bool | None = None  # the last push of the run

    _COUNTS = ("steps", "period")
    _RATES = ("lr", "weight_decay")

    @classmethod
    def read(cls, value: Any) -> "PushInfo":
        if type(value) is not dict:
            _bad("info", f"must be a map, got {type(value).__name__}")
        if not value:  # a gradient push's (every step of most algorithms)
            return _NO_PUSH_INFO
        allowed = [f.name for f in fields(cls)]
        unknown = [k for k in value if k not in allowed]
        if unknown:
            _bad("info", f"unknown keys {unknown!r:.60}; allowed: {', '.join(allowed)}")
        out: dict[str, Any] = {}
        for key, v in value.items():
            if key == "final":
                if type(v) is not bool:
                    _bad("info.final", f"must be a bool, got {v!r:.40}")
                out[key] = v
            elif key in cls._COUNTS:  # an integral float (e.g. 3.0) counts too
                out[key] = read_count(
                    f"info.{key}", int(v) if type(v) is float and v.is_integer() else v
                )
            else:
                out[key] = read_number(f"info.{key}", v, MAX_RATE)
        return cls(**out)

    def as_dict(self) -> dict:
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }

    to_wire = as_dict


_NO_PUSH_INFO = PushInfo()


# ---------------------------------------------------------------- shard -> worker: the ACK in a fused reply


@dataclass(frozen=True)
class FusedAck:
    """The ACK a PARAMS reply to a PUSH with `pull` carries."""

    version: int
    staleness: int = 0
    plan_id: int = 0
    info: dict = field(default_factory=dict)  # the policy's reply extras (e.g. the next period)
    # seconds the values waited at the shard after the push
    held_s: float = 0.0

    _FIELDS = ("version", "staleness", "plan_id", "info", "held_s")

    @classmethod
    def read(cls, value: Any) -> "FusedAck | None":
        if type(value) is not dict:
            _bad("ack", f"must be a map, got {type(value).__name__}")
        if not value:
            return None  # a plain pull's reply
        # a newer peer's keys: plain data, like any map's
        if any(k not in cls._FIELDS for k in value):
            read_plain("ack", value)
        if "version" not in value:
            _bad("ack", "missing 'version'")
        info = value.get("info", {})
        if type(info) is not dict:
            _bad("ack.info", f"must be a map, got {type(info).__name__}")
        # each field read once, by its own reader (info one level down, as inside the ack map)
        return cls(
            version=read_count("ack.version", value["version"]),
            staleness=read_count("ack.staleness", value.get("staleness", 0)),
            plan_id=read_int("ack.plan_id", value.get("plan_id", 0)),
            info=read_plain("ack.info", info, 1),
            held_s=read_number("ack.held_s", value.get("held_s", 0.0), MAX_SECONDS),
        )

    def to_wire(self) -> dict:
        return {
            "version": self.version,
            "staleness": self.staleness,
            "plan_id": self.plan_id,
            "info": self.info,
            "held_s": self.held_s,
        }


def write_ack(ack: FusedAck | None) -> dict:
    """PARAMS.ack's wire form: an empty map for a plain pull's reply."""
    return {} if ack is None else ack.to_wire()


# ---------------------------------------------------------------- registration and plan


def _bool(where: str, value: Any) -> bool:
    if type(value) is not bool:
        _bad(where, f"must be true or false, got {value!r:.40}")
    return value


def _text(where: str, value: Any) -> str:
    if type(value) is not str or len(value) > MAX_TEXT:
        _bad(where, f"must be a string of at most {MAX_TEXT} characters, got {value!r:.40}")
    return value


def _keyed(read: Callable[[str, Any], Any]) -> Callable[[str, Any], dict]:
    """A map of string keys (checked by the msgpack decoder) to values `read` takes."""

    def read_keyed(where: str, value: Any) -> dict:
        if type(value) is not dict:
            _bad(where, f"must be a map, got {type(value).__name__}")
        return {k: read(f"{where}.{k}", v) for k, v in value.items()}

    return read_keyed


def _counts(where: str, value: Any) -> list[int]:
    if type(value) is not list:
        _bad(where, f"must be a list of counts, got {value!r:.40}")
    return [read_count(where, v) for v in value]


# REPORT `values` (an evaluation, docs/protocol.md): the fields the scheduler reads, typed
REPORT_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "accuracy": _or_null(_real),
    "loss": _or_null(_real),
    "metrics": _keyed(_real),
    "higher_is_better": _keyed(_bool),
    "watch": _text,
    "num_classes": _or_null(read_count),
    "final": _bool,
    "versions": _counts,
}


def read_report_values(value: Any) -> dict:
    """REPORT `values`: each field of REPORT_FIELDS of its type (a number: any float, NaN
    included: a diverged loss is worth reporting), the others plain data (read_plain).
    Raises ProtocolError(MALFORMED) naming the field."""
    plain = read_map("values", value)
    return {
        k: REPORT_FIELDS[k](f"values.{k}", v) if k in REPORT_FIELDS else v for k, v in plain.items()
    }


def read_tensor_specs(value: Any) -> list[TensorSpec]:
    if type(value) not in (list, tuple):
        _bad("tensor_specs", f"must be a list, got {type(value).__name__}")
    specs = [TensorSpec.from_wire(s) for s in value]
    if len({s.name for s in specs}) != len(specs):
        _bad("tensor_specs", "duplicate tensor names")
    return specs


def write_tensor_specs(specs: list[TensorSpec]) -> list[list]:
    return [s.to_wire() for s in specs]


def read_speed(value: Any) -> float:
    return read_number("speed", value, MAX_RATE)


def read_hold_s(value: Any) -> float:
    """HEARTBEAT's `hold_s`: seconds the scheduler may hold its ACK."""
    return read_number("hold_s", value, MAX_SECONDS)


def read_startup(value: Any) -> dict[str, float]:
    """REGISTER's `startup`: at most MAX_PHASES {short name: seconds}."""
    if type(value) is not dict or len(value) > MAX_PHASES:
        _bad("startup", f"must be a map of at most {MAX_PHASES} phases, got {value!r:.60}")
    for name in value:
        if type(name) is not str or not 0 < len(name) <= 32:
            _bad("startup", f"phase names must be strings of 1-32 characters, got {name!r:.40}")
    return {name: read_number(f"startup.{name}", v, MAX_PHASE_S) for name, v in value.items()}


MAX_AGREED_KEYS = 64


def read_agreed(value: Any) -> dict[str, Any]:
    """REGISTER's `agreed`: at most MAX_AGREED_KEYS {config key path: plain value}; the values
    are only compared for equality with the scheduler's, never used."""
    if type(value) is not dict or len(value) > MAX_AGREED_KEYS:
        _bad("agreed", f"must be a map of at most {MAX_AGREED_KEYS} keys, got {value!r:.60}")
    for key in value:
        if type(key) is not str or not 0 < len(key) <= 100:
            _bad("agreed", f"keys must be strings of 1-100 characters, got {key!r:.40}")
    return value


def _entries(where: str, value: Any) -> list[NodeEntry]:
    if type(value) is not list:
        _bad(where, "must be a list")
    out = []
    for i, e in enumerate(value):
        e = read_map(f"{where}[{i}]", e)
        if set(e) - {"node_id", "rank", "address"} or type(e.get("address", "")) is not str:
            _bad(f"{where}[{i}]", f"want {{node_id, rank, address}}, got {e!r:.60}")
        out.append(
            NodeEntry(
                read_int(f"{where}[{i}].node_id", e.get("node_id")),
                read_int(f"{where}[{i}].rank", e.get("rank")),
                e.get("address", ""),
            )
        )
    return out


def _str_keyed_numbers(where: str, value: Any) -> dict[str, float]:
    value = read_map(where, value)
    return {k: read_number(f"{where}.{k}", v, MAX_RATE) for k, v in value.items()}


def read_addresses(where: str, value: Any) -> list[str]:
    """A spare's backup slots: at most 64 addresses of 1-MAX_TEXT characters."""
    if (
        type(value) is list
        and len(value) <= 64
        and all(type(a) is str and 0 < len(a) <= MAX_TEXT for a in value)
    ):
        return list(value)
    _bad(where, f"must be a list of at most 64 addresses, got {value!r:.60}")


def read_spare_slots(value: Any) -> list[str]:
    return read_addresses("spare_slots", value)


MAX_MEMBERS = 4096  # nodes one aggregated push may stand for


def read_members(value: Any) -> list[tuple[int, int]]:
    """An aggregated push's members (Push.members): [node id, clock] pairs, distinct
    non-negative node ids, clocks >= 0; empty for a worker's own push."""
    if type(value) is list and len(value) <= MAX_MEMBERS:
        pairs = [
            (m[0], m[1])
            for m in value
            if type(m) is list and len(m) == 2 and all(type(x) is int and x >= 0 for x in m)
        ]
        if len(pairs) == len(value) and len({n for n, _ in pairs}) == len(pairs):
            return pairs
    _bad(
        "members",
        f"must be a list of distinct [node id, clock] pairs of ints >= 0, got {value!r:.60}",
    )


def write_members(value: list[tuple[int, int]]) -> list[list[int]]:
    return [[int(n), int(c)] for n, c in value]


def read_plan(value: Any) -> ClusterPlan:
    """A plan as the scheduler sends it, checked for consistency: every tensor
    placed on an existing shard, groups made of the plan's workers, finite
    speeds and shares."""
    d = read_map("plan", value)
    for key in ("plan_id", "algorithm", "workers", "shards", "tensors", "placement"):
        if key not in d:
            _bad("plan", f"missing {key!r}")
    if (
        type(d["algorithm"]) is not str
        or type(d.get("schema_hash", "")) is not str
        or type(d.get("run_id", "")) is not str
    ):
        _bad("plan", "algorithm, schema_hash and run_id must be strings")
    workers, shards = _entries("plan.workers", d["workers"]), _entries("plan.shards", d["shards"])
    tensors = read_tensor_specs(d["tensors"])
    placement = read_map("plan.placement", d["placement"])
    if set(placement) != {t.name for t in tensors} or not all(
        type(i) is int and 0 <= i < len(shards) for i in placement.values()
    ):
        _bad("plan.placement", "must map every tensor, and only those, to a shard index")
    groups = d.get("groups", [])
    ids = {w.node_id for w in workers}
    if type(groups) is not list or not all(
        type(g) is list and all(type(w) is int and w in ids for w in g) for g in groups
    ):
        _bad("plan.groups", "must be lists of the plan's worker ids")
    return ClusterPlan(
        plan_id=read_int("plan.plan_id", d["plan_id"]),
        algorithm=d["algorithm"],
        workers=workers,
        shards=shards,
        tensors=tensors,
        placement=placement,
        schema_hash=d.get("schema_hash", ""),
        groups=[list(g) for g in groups],
        speeds=_str_keyed_numbers("plan.speeds", d.get("speeds", {})),
        shares=_str_keyed_numbers("plan.shares", d.get("shares", {})),
        placement_id=read_int("plan.placement_id", d.get("placement_id", 1)),
        chunks=read_map("plan.chunks", d.get("chunks", {})),
        info=read_map("plan.info", d.get("info", {})),
        run_id=d.get("run_id", ""),
        algorithm_params=read_map("plan.algorithm_params", d.get("algorithm_params", {})),
        backups=_backups(d.get("backups", {})),
        served_by=_str_keyed_ints("plan.served_by", d.get("served_by", {})),
        batches=_batches(d.get("batches", {}), ids),
        tables=_tables(d.get("tables", []), tensors),
        group_since=_str_keyed_ints("plan.group_since", d.get("group_since", {})),
    )


def _tables(value: Any, tensors: list[TensorSpec]) -> list[TensorSpec]:
    """plan.tables: specs of kind "table", 2-D, named apart from the dense tensors."""
    tables = read_tensor_specs(value)
    dense = {t.name for t in tensors}
    if any(t.kind != "table" or len(t.shape) != 2 or t.name in dense for t in tables):
        _bad("plan.tables", "must be 2-D specs of kind 'table', named apart from plan.tensors")
    return tables


def _backups(value: Any) -> dict:
    """plan.backups: shard node id (a string) -> {"node": int, "address": str}."""
    backups = read_map("plan.backups", value)
    for key, entry in backups.items():
        if not (
            type(key) is str
            and isinstance(entry, dict)
            and type(entry.get("node")) is int
            and type(entry.get("address")) is str
        ):
            _bad("plan.backups", f"entry {key!r} must be {{node: int, address: str}}")
    return backups


def _str_keyed_ints(where: str, value: Any) -> dict:
    out = read_map(where, value)
    if not all(type(k) is str and type(v) is int for k, v in out.items()):
        _bad(where, "must map node ids (strings) to node ids (integers)")
    return out


def _batches(value: Any, workers: set[int]) -> dict[str, float]:
    """plan.batches: worker node id -> a positive whole batch size."""
    batches = _str_keyed_numbers("plan.batches", value)
    if not all(
        k.isdigit() and int(k) in workers and v >= 1 and v == int(v) for k, v in batches.items()
    ):
        _bad("plan.batches", "must map the plan's worker ids to whole batch sizes >= 1")
    return batches
