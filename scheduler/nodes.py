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
    stats: NodeStats = field(default_factory=NodeStats)  # from its latest heartbeat (checked at decode)
    left: bool = False    # said BYE
    dead: bool = False    # silent for longer than cluster.dead_after_s
    host: str = ""        # as the node reported it when it registered

    def __post_init__(self):
        self.stats = NodeStats.read(self.stats)  # a restored state holds the plain map

    @property
    def gone(self) -> bool:
        return self.left or self.dead

    @property
    def speed(self) -> float:
        """Latest measured speed: from heartbeats once training, else the profile."""
        return self.stats.speed or self.profiled_speed or 1.0


@dataclass
class EvalTrack:
    target: float | None
    best: float = 0.0
    final: float | None = None
    final_loss: float | None = None
    time_to_target_s: float | None = None
    samples_to_target: int | None = None  # training examples computed by then (workers' latest heartbeats)
    count: int = 0
