"""Copying a primary's whole state to a backup that starts after training
began (a spare named by a failover plan, `cluster.spare_shards`).

Replay (replication.py) builds a backup from the INIT on; a late backup has
missed it, so the primary sends one SNAPSHOT of its `state_dict()` (values,
versions, optimizer moments, the policy's rounds and clocks, the last ACK per
worker, counts) at one point of its push order, on the same connection it
then forwards every later push on. The copy is *streamed*, not held: the
primary goes on applying pushes while the snapshot travels; each reply waits,
as always, until the backup confirmed everything forwarded before it (the
snapshot included). So nothing acknowledged is missing from the backup, and
training does not stop for the copy.

The wire form has no pickle: the state becomes msgpack-able plain data in
which every map is `{"d": [[key, value], ...]}` (optimizer state has integer
keys), every list `{"l": [...]}`, tuple `{"u": [...]}`, set `{"s": [...]}`
and tensor `{"t": frame name}`; the tensors travel as frames. A tensor larger
than a frame may be (`cluster.max_message_bytes` bounds every frame a socket
takes; a sparse table's slice is often larger) travels flattened, in pieces
that each fit: `{"c": [shape, [frame names]]}`. The snapshot is encoded
unpacked (one frame per piece), so that no pack frame of many small tensors
(open rounds' rows) outgrows the bound either.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from hetps.proto.errors import ProtocolError
from hetps.proto.messages import Ack, Snapshot, Status

log = logging.getLogger(__name__)
_CONTAINERS = {"l": list, "u": tuple, "s": set}
_SCALARS = (type(None), bool, int, float, str)
MAX_DEPTH = 32


def to_wire(state: Any, max_frame_bytes: int | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """(plain data, tensors by frame name) for `state`. Every tensor is
    copied, so the snapshot is of this moment however the shard goes on; one
    over `max_frame_bytes` (None: no bound) is split into flat pieces that
    each fit. Raises TypeError for a value it cannot carry."""
    tensors: dict[str, torch.Tensor] = {}

    def frame(t: torch.Tensor) -> str:
        name = f"s{len(tensors)}"
        tensors[name] = t
        return name

    def walk(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            v = v.detach()
            if max_frame_bytes is None or v.numel() * v.element_size() <= max_frame_bytes:
                return {"t": frame(v.clone())}
            per = max(1, max_frame_bytes // v.element_size())
            flat = v.reshape(-1)
            names = [frame(flat[i : i + per].clone()) for i in range(0, flat.numel(), per)]
            return {"c": [list(v.shape), names]}
        if isinstance(v, _SCALARS):
            return v
        if isinstance(v, dict):
            return {"d": [[walk(k), walk(x)] for k, x in v.items()]}
        for tag, kind in _CONTAINERS.items():
            if type(v) is kind:
                return {tag: [walk(x) for x in v]}
        raise TypeError(f"cannot copy a {type(v).__name__} to a backup")

    return walk(state), tensors


def from_wire(plain: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The state `to_wire` made. Tensors are copied out of the frames (the
    backup writes them in place). Raises ProtocolError (MALFORMED) for
    anything `to_wire` would not have made."""

    def walk(v: Any, depth: int) -> Any:
        if isinstance(v, _SCALARS):
            return v
        if depth > MAX_DEPTH or type(v) is not dict or len(v) != 1:
            raise ProtocolError(Status.MALFORMED, f"SNAPSHOT: not a state value: {v!r:.60}")
        ((tag, body),) = v.items()
        if tag == "t" and isinstance(body, str) and body in tensors:
            return tensors[body].clone()
        if tag == "c":
            return _joined(body, tensors)
        if (
            tag == "d"
            and isinstance(body, list)
            and all(isinstance(p, list) and len(p) == 2 for p in body)
        ):
            return {_key(walk(k, depth + 1)): walk(x, depth + 1) for k, x in body}
        if tag in _CONTAINERS and isinstance(body, list):
            return _CONTAINERS[tag](walk(x, depth + 1) for x in body)
        raise ProtocolError(Status.MALFORMED, f"SNAPSHOT: not a state value: {v!r:.60}")

    return walk(plain, 0)


def _joined(body: Any, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A tensor `to_wire` split into pieces: [shape, [frame names]]."""
    ok = (
        isinstance(body, list)
        and len(body) == 2
        and isinstance(body[0], list)
        and all(type(n) is int and n >= 0 for n in body[0])
        and isinstance(body[1], list)
        and body[1]
        and all(isinstance(n, str) and n in tensors for n in body[1])
    )
    pieces = [tensors[n] for n in body[1]] if ok else []
    if not ok or any(p.dim() != 1 or p.dtype != pieces[0].dtype for p in pieces):
        raise ProtocolError(Status.MALFORMED, f"SNAPSHOT: not a split tensor: {body!r:.60}")
    flat = torch.cat(pieces)
    if flat.numel() != math.prod(body[0]):
        raise ProtocolError(
            Status.MALFORMED, f"SNAPSHOT: pieces of {flat.numel()} values for shape {body[0]}"
        )
    return flat.reshape(body[0])


def _key(k: Any) -> Any:
    if isinstance(k, (list, set, dict)):
        raise ProtocolError(Status.MALFORMED, f"SNAPSHOT: unhashable map key {k!r:.40}")
    return k


def snapshot_of(shard) -> Snapshot:
    """The SNAPSHOT message of `shard`'s state now (its open rounds included)."""
    shard.store.settle()
    state, tensors = to_wire(shard.state_dict(), shard.max_tensor_bytes())
    return Snapshot(plan=shard.plan, state=state, tensors=tensors)


def load_snapshot(shard, msg: Snapshot) -> Ack:
    """Make backup `shard` an exact copy of the primary that sent `msg` (the caller checked
    that its primary did): its plan, values, optimizer, policy (open rounds and all, unlike
    a checkpoint restore, which realigns), sparse tables (slices, row optimizer state, open
    rounds of rows), last ACK and row ACK per worker and counts (Shard.load_copy). Raises
    ProtocolError (BAD_STATE) when the state is of another run or algorithm, or lacks the
    sparse tables this backup's plan has, (MALFORMED) when it is not a shard's state."""
    state = from_wire(msg.state, msg.tensors)
    try:
        for key, mine in (("algorithm", shard.plan.algorithm), ("run_id", shard.plan.run_id)):
            if state[key] != mine:
                raise ProtocolError(
                    Status.BAD_STATE, f"SNAPSHOT of {key} {state[key]!r}, this backup's is {mine!r}"
                )
        shard.load_copy(msg.plan, state)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(
            Status.MALFORMED, f"SNAPSHOT: {type(exc).__name__}: {exc}"[:200]
        ) from None
    log.warning(
        "backup of shard node %d: copied the primary's state at version %d (plan %d)",
        shard.node_id,
        shard.store.version,
        shard.plan.plan_id,
    )
    return Ack(version=shard.store.version, plan_id=shard.plan.plan_id)
