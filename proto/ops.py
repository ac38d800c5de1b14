"""The protocol's ops and status codes: what a message asks for, and why a
request was refused. Imports nothing of hetps, so every module of the wire
(plans, records, checked reads, errors) may name a Status without importing
the messages."""

from __future__ import annotations

import enum


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
