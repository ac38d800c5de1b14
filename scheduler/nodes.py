"""What the scheduler keeps about each node of the cluster and about the
evaluations it was sent: plain records, saved with the scheduler's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetps.proto.records import NodeStats


@dataclass
class Node:
    node_id: int
    role: str
    rank: int
    address: str
    last_seen: float
    profiled_speed: float = 0.0
    # from its latest heartbeat (checked at decode)
    stats: NodeStats = field(default_factory=NodeStats)
    left: bool = False  # said BYE
    dead: bool = False  # silent for longer than cluster.dead_after_s
    host: str = ""  # as the node reported it when it registered
    replica_address: str = ""  # a shard with cluster.replicas: where it serves the backup it holds
    spare_slots: list = field(default_factory=list)  # a spare: the addresses of its backup sockets

    def __post_init__(self):
        self.stats = NodeStats.read(self.stats)  # a restored state holds the plain map

    @property
    def gone(self) -> bool:
        return self.left or self.dead

    def failure(self, what: str, t: float, **more) -> dict:
        """A `failures` entry for this node, e.g. kind `worker_dead`, `shard_error`."""
        kind = "shard" if self.role == "ps" else self.role
        return {
            "kind": f"{kind}_{what}",
            "node": f"{self.role}{self.rank}",
            "node_id": self.node_id,
            "t": t,
            **more,
        }

    @property
    def speed(self) -> float:
        """Latest measured speed: from heartbeats once training, else the profile."""
        return self.stats.speed or self.profiled_speed or 1.0


def free_rank(nodes: list[Node], role: str, configured: int) -> int | None:
    """The rank `--rank auto` claims for a node of `role`, given the `configured` count
    of that role in the config. A shard: the lowest of 0..configured-1 no live shard holds
    (None: every one is held), so it takes a missing shard's place and settings in the plan.
    A worker or evaluator: the lowest rank from `configured` up that no live node of its
    role holds; the configured ranks stay free for launchers that give indices."""
    held = {n.rank for n in nodes if n.role == role and not n.gone}
    start, stop = (0, configured) if role == "ps" else (configured, configured + len(held) + 1)
    return next((r for r in range(start, stop) if r not in held), None)


@dataclass
class EvalTrack:
    target: float | None
    # evaluations in a row at or above target that stop the run
    patience: int = 1
    # evaluations in a row at or above target, up to the latest
    streak: int = 0
    best: float = 0.0
    final: float | None = None
    final_loss: float | None = None
    time_to_target_s: float | None = None
    # training examples computed by then (workers' latest heartbeats)
    samples_to_target: int | None = None
    count: int = 0
