"""What the scheduler keeps about each node of the cluster and about the
evaluations it was sent: plain records, saved with the scheduler's state.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Node:
    node_id: int
    role: str
    rank: int
    address: str
    last_seen: float
    profiled_speed: float = 0.0
    stats: dict = field(default_factory=dict)
    left: bool = False    # said BYE
    dead: bool = False    # silent for longer than cluster.dead_after_s
    host: str = ""        # as the node reported it when it registered

    @property
    def gone(self) -> bool:
        return self.left or self.dead

    @property
    def speed(self) -> float:
        """Latest measured speed: from heartbeats once training, else the profile."""
        return float(self.stats.get("speed") or self.profiled_speed or 1.0)


@dataclass
class EvalTrack:
    target: float | None
    best: float = 0.0
    final: float | None = None
    final_loss: float | None = None
    time_to_target_s: float | None = None
    count: int = 0
