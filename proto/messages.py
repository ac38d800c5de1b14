"""Every message of the hetps wire protocol, defined once.

A message is a frozen dataclass with a class-level ``OP``. Its fields are the
header fields that travel as msgpack; a field named ``tensors`` (an ordered
``dict[str, torch.Tensor]``) travels as one raw frame per tensor, described in
the header by ``tensors: [[name, dtype, shape], ...]``.

Compatibility rule: a new protocol revision only ever *adds* optional fields
(fields with defaults). Decoders ignore header keys they do not know.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

# 2: PUSH gained `pull` (answer with PARAMS carrying the ACK) and PARAMS `ack`.
# A version-1 peer would ignore `pull` and never answer with values, so the
# bump turns a mixed deployment into a BAD_VERSION error instead of a stall.
PROTOCOL_VERSION = 2
# Frames at least this large are sent without a copy. A zero-copy send costs
# pyzmq a Frame, a hand-off to its garbage-collector thread and a GIL round
# trip when ZeroMQ lets go of the memory: measured on loopback (2-core EPYC),
# copying is cheaper up to ~256 KiB and zero-copy cheaper from ~512 KiB.
ZERO_COPY_BYTES = 256 * 1024


class Op(enum.IntEnum):
    REGISTER = 1  # node -> scheduler: join the cluster
    WELCOME = 2  # scheduler -> node: your node id
    GET_PLAN = 3  # node -> scheduler: wait for a plan newer than `after`
    PLAN = 4  # scheduler -> node: the versioned cluster plan
    HEARTBEAT = 5  # node -> scheduler: alive, with stats and step records
    INIT = 6  # worker -> shard: initial tensor values (first one wins)
    PUSH = 7  # worker -> shard: gradients (and buffers) of one step
    PULL = 8  # worker -> shard: ask for current values
    PARAMS = 9  # shard -> worker: tensor values
    ACK = 10  # generic success reply
    BARRIER = 11  # node -> scheduler: wait until `count` nodes reach `name`
    STOP = 12  # anyone -> scheduler: stop the run
    ERROR = 13  # reply: a Status and a message
    REPORT = 14  # evaluator -> scheduler: one evaluation result
    BYE = 15  # node -> scheduler: leaving cleanly
    FAILED = 16  # node -> scheduler: it cannot start (the run ends at once, naming it)
    # primary shard -> its new backup: the primary's whole state at one point of its push order
    SNAPSHOT = 17
    # sparse tables (proto/sparse.py): rows by id; a peer without them answers UNKNOWN_OP
    PULL_ROWS = 18  # worker -> shard: the current values of some rows of its sparse tables
    PUSH_ROWS = 19  # worker -> shard: row-sparse gradients of one step
    ROWS = 20  # shard -> worker: row values


class Status(enum.IntEnum):
    UNSET = 0  # no status given
    BAD_VERSION = 1  # header `v` is not this protocol version
    MALFORMED = 2  # undecodable, missing/ill-typed field, wrong frame count or byte length
    UNKNOWN_OP = 3  # `op` is not an Op this peer handles
    UNKNOWN_TENSOR = 4  # tensor name not owned by this shard
    SHAPE_MISMATCH = 5  # tensor shape differs from the registered one
    DTYPE_NOT_ALLOWED = 6  # dtype outside the allow-list, or not the registered one
    NONFINITE = 7  # NaN or Inf in a pushed tensor
    STALE_PLAN = 8  # request made under an older plan
    UNAUTHORIZED = 9  # peer not allowed
    TOO_LARGE = 10  # declared sizes exceed the configured limit
    INTERNAL = 11  # handler failed; the daemon keeps serving
    NOT_READY = 12  # e.g. push before any INIT reached the shard
    BAD_STATE = 13  # request not valid now (e.g. unknown node id)
    CONFIG_MISMATCH = 14  # REGISTER: the node's agreed settings differ from the scheduler's


@dataclass(frozen=True)
class Message:
    """Base: subclasses set OP and declare header fields, each with its wire
    type. Free-form fields (stats, info, ack, plan, tensor specs) are read
    into typed records when the message is made (records.py); a bad value
    raises ProtocolError there, in the sender as in the decoder."""

    OP: ClassVar[Op]
    # its tensors must be ones the receiving shard holds (codec.decode)
    CATALOGUED: ClassVar[bool] = True

    def __post_init__(self):
        records = _records or _import_records()
        if type(self) in records.READERS:
            records.read_fields(self)


_records = None  # records.py, once imported: it imports this module's classes, so not at the top


def _import_records():
    global _records
    from . import records

    _records = records
    return records


@dataclass(frozen=True)
class Register(Message):
    OP: ClassVar[Op] = Op.REGISTER
    role: str  # "ps" | "worker" | "evaluator"
    rank: int
    address: str = ""  # advertised server address (shards)
    # [[name, dtype, shape, kind]] forward order -> [TensorSpec]
    tensor_specs: list = field(default_factory=list)
    schema_hash: str = ""
    speed: float = 0.0  # profiled speed: samples/s (workers), bytes/s updated (shards)
    node_id: int = 0  # the id this node already had, when it registers again
    host: str = ""  # the node's host name (recorded in the run directory)
    # {phase: seconds} before registering (runtime/startup.py)
    startup: dict = field(default_factory=dict)
    # shards with cluster.replicas > 0: where it serves the backup it holds
    replica_address: str = ""
    # a spare (cluster.spare_shards): its backup sockets' addresses
    spare_slots: list = field(default_factory=list)
    # {config key path: value} of the settings every host must agree on (runconfig/agreement.py)
    agreed: dict = field(default_factory=dict)


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
    plan: dict  # read into a checked ClusterPlan


@dataclass(frozen=True)
class Heartbeat(Message):
    OP: ClassVar[Op] = Op.HEARTBEAT
    node_id: int
    stats: dict = field(default_factory=dict)  # read into records.NodeStats
    records: list = field(default_factory=list)  # step records, each with `ago` seconds
    # long poll: the scheduler may hold the ACK up to this many seconds (at most cluster.heartbeat_s)
    # and answers at once when it has news for the node (a newer plan, stop); 0 = answer now
    hold_s: float = 0.0


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
    # algorithm extras (e.g. local steps): records.PushInfo
    info: dict = field(default_factory=dict)
    # True: the reply is the PARAMS that a PULL with clock + 1 sent right behind this push
    # would get (parked alike), carrying this push's ACK in `ack`: one round trip, two messages
    pull: bool = False
    tensors: dict = field(default_factory=dict)


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
    # plus `held_s`, the seconds the values waited at the shard after the push was applied
    # records.FusedAck, None when empty (a plain pull's reply)
    ack: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Ack(Message):
    OP: ClassVar[Op] = Op.ACK
    version: int = 0
    staleness: int = 0
    plan_id: int = 0
    stop: bool = False
    info: dict = field(default_factory=dict)


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
    values: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Bye(Message):
    OP: ClassVar[Op] = Op.BYE
    node_id: int
    stats: dict = field(default_factory=dict)  # read into records.NodeStats
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
    plan: dict  # the primary's plan at the snapshot (read into a ClusterPlan)
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


@functools.cache  # per message class, on every encode and decode
def header_fields(cls: type[Message]) -> tuple:
    """The dataclass fields that travel in the msgpack header (not `tensors`)."""
    return tuple(f for f in fields(cls) if f.name != "tensors")


@functools.cache
def has_tensors(cls: type[Message]) -> bool:
    return any(f.name == "tensors" for f in fields(cls))


def describe(msg: Any) -> str:
    """Short human name for logs and errors, e.g. 'PUSH'."""
    return msg.OP.name if isinstance(msg, Message) else type(msg).__name__
