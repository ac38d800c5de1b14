"""The ACK of each worker's last push, so that a retried push (same worker, same request
id: its ACK was lost, or it went to a backup promoted since) is answered with the first
ACK instead of being applied twice. One per push path (dense pushes, row pushes)."""

from __future__ import annotations

import dataclasses

from hetps.proto.messages import Ack


class RetryCache:
    """Worker -> (request id, ACK) of its newest push: bounded by the number of workers
    (a worker's next push replaces its entry). A hit is counted in `counts["retried"]`
    (the shard's counters, shared with its other parts). Not thread-safe: the shard's
    loop owns it."""

    def __init__(self, counts: dict):
        self.counts = counts
        # worker -> (request id, ACK): read it, write it through `remember`
        self.by_worker: dict[int, tuple[int, Ack]] = {}

    def answer(self, worker: int, req_id: int) -> Ack | None:
        """The ACK already given to `worker`'s request `req_id` (a retry; counted), or None."""
        last = self.by_worker.get(worker)
        if last is None or last[0] != req_id:
            return None
        self.counts["retried"] += 1
        return last[1]

    def remember(self, worker: int, req_id: int, ack: Ack) -> None:
        """`ack` answered `worker`'s request `req_id`: its only entry from now on."""
        self.by_worker[worker] = (req_id, ack)

    def state_dict(self) -> dict:
        """Worker -> (request id, the ACK as plain fields): torch.save-able, msgpack-able."""
        return {w: (req, dataclasses.asdict(ack)) for w, (req, ack) in self.by_worker.items()}

    def load_state_dict(self, state: dict) -> None:
        """Replace every entry by those of `state_dict()`; TypeError for a field Ack lacks."""
        self.by_worker = {w: (req, Ack(**ack)) for w, (req, ack) in state.items()}
