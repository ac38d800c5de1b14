"""Every message of the hetps wire protocol, defined once.

A message is a frozen dataclass with a class-level ``OP``. Its fields are the
header fields that travel as msgpack; a field named ``tensors`` (an ordered
``dict[str, torch.Tensor]``) travels as one raw frame per tensor, described in
the header by ``tensors: [[name, dtype, shape], ...]``.

Each field is annotated with what it holds. A field that holds more than its
wire value (a record, or a checked plain value) says how it travels in its
metadata (`read_as`): the codec checks the wire type, runs the reader at decode
(records.py) and the writer at encode. A sender builds the records itself.

Compatibility rule: a new protocol revision only ever *adds* optional fields
(fields with defaults). Decoders ignore header keys they do not know.
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
from typing import Any, Callable, ClassVar, Mapping, Protocol, TypeGuard

from .ops import Op as Op  # re-exported: `from hetps.proto.messages import Op, Status`
from .ops import Status as Status
from .plan import ClusterPlan, TensorSpec
from .records import (
    FusedAck,
    NodeStats,
    PushInfo,
    read_agreed,
    read_hold_s,
    read_members,
    read_plan,
    read_report_values,
    read_spare_slots,
    read_speed,
    read_startup,
    read_step_records,
    read_tensor_specs,
    write_ack,
    write_members,
    write_tensor_specs,
)

# 2: PUSH gained `pull` (answer with PARAMS carrying the ACK) and PARAMS `ack`.
# A version-1 peer would ignore `pull` and never answer with values, so the
# bump turns a mixed deployment into a BAD_VERSION error instead of a stall.
# 3: PUSH gained `members` (a group's aggregated push); a version-2 shard would take it as
# the sender's own push and apply a group's mean as one member's gradient.
PROTOCOL_VERSION = 3
# Frames at least this large are sent without a copy. A zero-copy send costs
# pyzmq a Frame, a hand-off to its garbage-collector thread and a GIL round
# trip when ZeroMQ lets go of the memory: measured on loopback (2-core EPYC),
# copying is cheaper up to ~256 KiB and zero-copy cheaper from ~512 KiB.
ZERO_COPY_BYTES = 256 * 1024


@dataclass(frozen=True)
class WireForm:
    """How a field travels when it holds more than its wire value: the wire
    type the codec checks, the reader the codec runs on a peer's value at
    decode (checks it, makes the record; raises ProtocolError) and the writer
    that gives the value's wire form at encode (None: it travels as it is)."""

    type: str  # "int" | "float" | "str" | "bool" | "list" | "dict"
    read: Callable[[Any], Any]
    write: Callable[[Any], Any] | None = None


def read_as(
    wire_type: str, read: Callable[[Any], Any], write: Callable[[Any], Any] | None = None
) -> dict[str, WireForm]:
    """A field's `metadata`: it travels as `wire_type`, read by `read`, written by `write`."""
    return {"wire": WireForm(wire_type, read, write)}


_STATS = read_as("dict", NodeStats.read, NodeStats.to_wire)
_PLAN = read_as("dict", read_plan, ClusterPlan.to_dict)


@dataclass(frozen=True)
class Message:
    """Base: subclasses set OP and declare header fields, each annotated with
    what it holds; one that holds a record says how it travels (`read_as`)."""

    OP: ClassVar[Op]
    # its tensors must be ones the receiving shard holds (codec.decode)
    CATALOGUED: ClassVar[bool] = True


@dataclass(frozen=True)
class Register(Message):
    OP: ClassVar[Op] = Op.REGISTER
    role: str  # "ps" | "worker" | "evaluator"
    rank: int
    address: str = ""  # advertised server address (shards)
    # forward order; on the wire [[name, dtype, shape, kind]]
    tensor_specs: list[TensorSpec] = field(
        default_factory=list, metadata=read_as("list", read_tensor_specs, write_tensor_specs)
    )
    schema_hash: str = ""
    # profiled speed: samples/s (workers), bytes/s updated (shards)
    speed: float = field(default=0.0, metadata=read_as("float", read_speed))
    node_id: int = 0  # the id this node already had, when it registers again
    host: str = ""  # the node's host name (recorded in the run directory)
    # {phase: seconds} before registering (runtime/startup.py)
    startup: dict[str, float] = field(default_factory=dict, metadata=read_as("dict", read_startup))
    # shards with cluster.replicas > 0: where it serves the backup it holds
    replica_address: str = ""
    # a spare (cluster.spare_shards): its backup sockets' addresses
    spare_slots: list[str] = field(default_factory=list, metadata=read_as("list", read_spare_slots))
    # {config key path: value} of the settings every host must agree on (runconfig/agreement.py)
    agreed: dict[str, Any] = field(default_factory=dict, metadata=read_as("dict", read_agreed))


@dataclass(frozen=True)
class Welcome(Message):
    OP: ClassVar[Op] = Op.WELCOME
    node_id: int
    role: str
    rank: int


@dataclass(frozen=True)
class GetPlan(Message):
    OP: ClassVar[Op] = Op.GET_PLAN
    after: int = 0  # reply once plan_id > after (parked until then)


@dataclass(frozen=True)
class Plan(Message):
    OP: ClassVar[Op] = Op.PLAN
    plan_id: int
    plan: ClusterPlan = field(metadata=_PLAN)  # checked for consistency at decode


@dataclass(frozen=True)
class Heartbeat(Message):
    OP: ClassVar[Op] = Op.HEARTBEAT
    node_id: int
    stats: NodeStats = field(default_factory=NodeStats, metadata=_STATS)
    # step records (records.STEP_RECORD_FIELDS), each with `ago` seconds
    records: list[dict[str, Any]] = field(
        default_factory=list, metadata=read_as("list", read_step_records)
    )
    # long poll: the scheduler may hold the ACK up to this many seconds (at most cluster.heartbeat_s)
    # and answers at once when it has news for the node (a newer plan, stop); 0 = answer now
    hold_s: float = field(default=0.0, metadata=read_as("float", read_hold_s))


@dataclass(frozen=True)
class Init(Message):
    OP: ClassVar[Op] = Op.INIT
    plan_id: int
    tensors: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Push(Message):
    OP: ClassVar[Op] = Op.PUSH
    plan_id: int
    clock: int  # pushes this worker made before this one
    base_version: int  # shard version the gradient was computed on
    n_samples: int = 0
    # algorithm extras (e.g. local steps); on the wire a map of the fields set
    info: PushInfo = field(
        default_factory=PushInfo, metadata=read_as("dict", PushInfo.read, PushInfo.to_wire)
    )
    # True: the reply is the PARAMS that a PULL with clock + 1 sent right behind this push
    # would get (parked alike), carrying this push's ACK in `ack`: one round trip, two messages
    pull: bool = False
    tensors: dict = field(default_factory=dict)
    # a group's aggregated push (comm.aggregate): the members it stands for, [node id, clock]
    # each, the sender among them; `tensors` is their (sample-weighted) mean gradient and
    # `n_samples` their sum. Empty: the sender's own push
    members: list[tuple[int, int]] = field(
        default_factory=list, metadata=read_as("list", read_members, write_members)
    )


@dataclass(frozen=True)
class Pull(Message):
    OP: ClassVar[Op] = Op.PULL
    plan_id: int
    clock: int = -1  # -1: latest values, never parked (evaluator)


@dataclass(frozen=True)
class Params(Message):
    OP: ClassVar[Op] = Op.PARAMS
    version: int
    # a reply to a PUSH with `pull`: that push's ACK fields (version, staleness, plan_id, info),
    # plus `held_s`, the seconds the values waited at the shard after the push was applied;
    # None (on the wire an empty map) in a plain pull's reply
    ack: FusedAck | None = field(default=None, metadata=read_as("dict", FusedAck.read, write_ack))
    tensors: dict = field(default_factory=dict)
    # the lr the shard's optimizer steps with now (its schedule's, before any policy scaling);
    # 0.0 without one. An older decoder leaves the field out (unknown header keys are ignored)
    lr: float = 0.0


@dataclass(frozen=True)
class Ack(Message):
    OP: ClassVar[Op] = Op.ACK
    version: int = 0
    staleness: int = 0
    plan_id: int = 0
    stop: bool = False
    info: dict = field(default_factory=dict)

    @classmethod
    def of(cls, fused: FusedAck) -> Ack:
        """The ACK a fused PARAMS reply carries (`Params.ack`), as the ACK of its push."""
        return cls(
            version=fused.version, staleness=fused.staleness, plan_id=fused.plan_id, info=fused.info
        )


@dataclass(frozen=True)
class Barrier(Message):
    OP: ClassVar[Op] = Op.BARRIER
    name: str
    count: int


@dataclass(frozen=True)
class Stop(Message):
    OP: ClassVar[Op] = Op.STOP
    reason: str = "requested"


@dataclass(frozen=True)
class Error(Message):
    OP: ClassVar[Op] = Op.ERROR
    status: int
    message: str = ""


@dataclass(frozen=True)
class Report(Message):
    OP: ClassVar[Op] = Op.REPORT
    node_id: int
    kind: str  # "eval"
    # what the scheduler reads typed at decode (records.py REPORT_FIELDS), the rest plain data
    values: dict = field(default_factory=dict, metadata=read_as("dict", read_report_values))


@dataclass(frozen=True)
class Bye(Message):
    OP: ClassVar[Op] = Op.BYE
    node_id: int
    stats: NodeStats = field(default_factory=NodeStats, metadata=_STATS)
    error: str = ""  # why the node leaves before the run stopped ("" = it was told to stop)
    # the Status a peer's ERROR carried, when that error made it leave (0: none)
    refused: int = 0


@dataclass(frozen=True)
class Failed(Message):
    OP: ClassVar[Op] = Op.FAILED
    role: str  # "ps" | "worker" | "evaluator"
    rank: int
    error: str  # what failed, one line or a short traceback tail
    host: str = ""
    node_id: int = 0  # 0 when it failed before registering


@dataclass(frozen=True)
class Snapshot(Message):
    """A primary's whole state for a backup that starts after training began;
    the primary forwards its pushes behind it. Only a backup takes it, and only
    from its primary's connection."""

    OP: ClassVar[Op] = Op.SNAPSHOT
    CATALOGUED: ClassVar[bool] = False  # optimizer moments and open rounds, not the plan's tensors
    plan: ClusterPlan = field(metadata=_PLAN)  # the primary's plan at the snapshot
    # the shard's state_dict, tensors replaced by references (ps/state_copy.py)
    state: dict
    tensors: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PullRows(Message):
    """Rows of sparse tables by id. `tensors`: per table, "<table>:ids" (int64,
    1-D, unique, every id held by the receiving shard: id % shards == its
    index). Checked by the shard against its tables (proto/sparse.py
    `read_ids`): the tables are not in the dense catalogue."""

    OP: ClassVar[Op] = Op.PULL_ROWS
    CATALOGUED: ClassVar[bool] = False
    plan_id: int
    # pushes of rows this worker made before; -1: the latest values, never parked (evaluator,
    # export). Otherwise parked while the worker's last PUSH_ROWS waits in an open round
    clock: int = -1
    tensors: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PushRows(Message):
    """One step's row-sparse gradients: per table "<table>:ids" (int64, 1-D,
    unique, held by the receiving shard) and "<table>:rows" (len(ids) x dim,
    the table's dtype: the gradient summed over the step's uses of each id).
    Sent to every shard in every step, empty if the step touched none of its
    rows: a synchronous round counts it as the worker's contribution."""

    OP: ClassVar[Op] = Op.PUSH_ROWS
    CATALOGUED: ClassVar[bool] = False
    plan_id: int
    clock: int  # row pushes this worker made before this one
    n_samples: int = 0
    tensors: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Rows(Message):
    """Reply to PULL_ROWS: "<table>:rows" per table asked, in the order of its ids."""

    OP: ClassVar[Op] = Op.ROWS
    CATALOGUED: ClassVar[bool] = False
    version: int  # updates applied to this shard's rows
    tensors: dict = field(default_factory=dict)


MESSAGES: dict[Op, type[Message]] = {
    cls.OP: cls
    for cls in (
        Register,
        Welcome,
        GetPlan,
        Plan,
        Heartbeat,
        Init,
        Push,
        Pull,
        Params,
        Ack,
        Barrier,
        Stop,
        Error,
        Report,
        Bye,
        Failed,
        Snapshot,
        PullRows,
        PushRows,
        Rows,
    )
}


_header_fields: dict[type[Message], tuple[Field[Any], ...]] = {}


def header_fields(cls: type[Message]) -> tuple[Field[Any], ...]:
    """The dataclass fields that travel in the msgpack header (not `tensors`),
    worked out once per message class (on every encode and decode)."""
    out = _header_fields.get(cls)
    if out is None:
        out = _header_fields[cls] = tuple(f for f in fields(cls) if f.name != "tensors")
    return out


def has_tensors(cls: type[Message]) -> bool:
    return "tensors" in cls.__dataclass_fields__


class WithTensors(Protocol):
    """A message that carries tensors, which travel as raw frames."""

    @property
    def tensors(self) -> Mapping[str, Any]: ...


def carries_tensors(msg: Message) -> TypeGuard[WithTensors]:
    """Whether `msg`'s class has a `tensors` field (has_tensors)."""
    return has_tensors(type(msg))


def wire_form(f: Field[Any]) -> WireForm | None:
    """How header field `f` travels, when it holds more than its wire value (`read_as`)."""
    return f.metadata.get("wire")


def wire_type(f: Field[Any]) -> str:
    """Header field `f`'s type on the wire: "int", "float", "str", "bool", "list" or "dict"."""
    form = wire_form(f)
    return form.type if form is not None else str(f.type)


def describe(msg: Any) -> str:
    """Short human name for logs and errors, e.g. 'PUSH'."""
    return msg.OP.name if isinstance(msg, Message) else type(msg).__name__
