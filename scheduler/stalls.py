"""Who the cluster waits for: the scheduler's stall attribution.

The shards say, in every heartbeat (proto/waits.py), which nodes their open
rounds and parked pulls wait for right now (`waiting`) and for how many
seconds in all each node's push was what released their waiters (`held`).
The tracker combines that with what the scheduler knows itself and names,
for each node that holds others up, why:

- `dead`: declared dead (silent longer than cluster.dead_after_s);
- `unresponsive`: no heartbeat for `unresponsive_after_s`, i.e.
  min(3 heartbeats, dead_after_s / 2): named before it is declared dead;
- `shard busy`: a shard that spent at least BUSY_SHARE of the last interval
  applying updates; a worker whose slow push is that shard's doing is not
  named as well;
- `network`: a worker whose pushes take longer than its compute;
- `compute`: a worker whose compute takes longer than its pushes.

A node is a blocker when a shard waits for it now for at least one heartbeat
interval, or when it released waiters for at least HOLD_SHARE of the time
between a shard's last two heartbeats (a 10x slower worker in a sync round
holds the others up about 90% of the time, but a heartbeat may fall between
two of its rounds); once named, KEEP_SHARE keeps it named. A silent shard is a blocker by itself: nobody can report
waiting for it.

Driven from the coordinator's single loop (`on_heartbeat`, `update`);
`current` and `summary` may be read from the metrics thread (they copy).
Times come from the injected `clock` (seconds, monotonic).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

REASONS = ("compute", "network", "unresponsive", "dead", "shard busy")
HOLD_SHARE = 0.5  # share of an interval a node's releases must cover to be named ...
# ... and to stay named once it is (hysteresis: a loaded machine's rounds jitter)
KEEP_SHARE = 0.25
BUSY_SHARE = 0.8  # share of an interval a shard must spend updating to be busy
# re-assessments per heartbeat interval: a shard's news is acted on within 1/4
ASSESS_PER_HEARTBEAT = 4


@dataclass(frozen=True)
class Blocker:
    """A node that holds others up now: why, since when (clock), how many wait."""

    node: str
    reason: str
    since: float
    waiters: int


@dataclass
class Stall:
    """An open stall: one node holding others up, from `start` (clock)."""

    node: str
    reason: str
    start: float
    waiters: int
    seen: float  # last update that named it (clock)
    written: float = -math.inf

    def record(self, now: float, ended: bool) -> dict:
        """The `stall` record of metrics.jsonl (the caller adds `t`)."""
        return {
            "node": self.node,
            "reason": self.reason,
            "for_s": round(now - self.start, 3),
            "waiting": self.waiters,
            "ended": ended,
        }


@dataclass
class ShardSample:
    """What one shard's latest heartbeats said, for rates between two of them."""

    at: float
    held: dict = field(default_factory=dict)  # node id -> cumulative seconds
    held_rate: dict = field(default_factory=dict)  # node id -> share of the last interval
    last_waiters: dict = field(default_factory=dict)
    busy_s: float = 0.0
    busy_share: float = 0.0


def _number(stats, key: str) -> float:
    value = stats.get(key, 0.0)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0


def name_of(node) -> str:
    return f"{node.role}{node.rank}"


class StallTracker:
    def __init__(
        self, heartbeat_s: float, dead_after_s: float, clock: Callable[[], float] = time.monotonic
    ):
        self.heartbeat_s = heartbeat_s
        self.unresponsive_after_s = min(3 * heartbeat_s, dead_after_s / 2)
        self.clock = clock
        self.shards: dict[int, ShardSample] = {}
        self.open: dict[str, Stall] = {}
        # node -> reason -> seconds it held others up
        self.held_s: dict[str, dict[str, float]] = {}
        self.stall_count: dict[str, int] = {}
        self.last_update = -math.inf

    # ------------------------------------------------------------ input
    def on_heartbeat(self, node) -> None:
        """A shard's heartbeat arrived (its stats already on `node`)."""
        now, stats = self.clock(), node.stats
        held = {h.node: h.seconds for h in stats.held or ()}
        busy = _number(stats, "busy_s")
        prev = self.shards.get(node.node_id)
        sample = ShardSample(
            now, held, last_waiters={h.node: h.waiters for h in stats.held or ()}, busy_s=busy
        )
        if prev is not None and now - prev.at > 1e-3:
            span = now - prev.at
            sample.held_rate = {n: (s - prev.held.get(n, 0.0)) / span for n, s in held.items()}
            sample.busy_share = max(0.0, busy - prev.busy_s) / span
        self.shards[node.node_id] = sample

    # ------------------------------------------------------------ combining
    def blockers(self, nodes: dict, replaced: frozenset = frozenset()) -> list[Blocker]:
        """The nodes holding others up now, by node id `nodes` (coordinator Nodes);
        the shards in `replaced` are served by their promoted backups."""
        now = self.clock()
        live_workers = sum(1 for n in nodes.values() if n.role == "worker" and not n.gone)
        found: dict[str, Blocker] = {}
        busy = set()
        for shard in (
            n for n in nodes.values() if n.role == "ps" and not n.left and n.node_id not in replaced
        ):
            reason = self._silence(shard, now)
            if reason:
                found[name_of(shard)] = Blocker(
                    name_of(shard), reason, shard.last_seen, live_workers
                )
            elif self.shards.get(shard.node_id, ShardSample(0.0)).busy_share >= BUSY_SHARE:
                busy.add(shard.node_id)
                found[name_of(shard)] = Blocker(
                    name_of(shard), "shard busy", now - self.heartbeat_s, live_workers
                )
        for node_id, (since, waiters) in self._waited_for(nodes, now).items():
            node = nodes.get(node_id)
            if node is None or node.left or name_of(node) in found:
                continue
            reason = self._silence(node, now) or self._worker_reason(node)
            if reason == "network" and busy:
                continue  # its push is slow because a shard is busy: that shard is named
            found[name_of(node)] = Blocker(name_of(node), reason, since, waiters)
        return sorted(found.values(), key=lambda b: (b.since, b.node))

    def _silence(self, node, now: float) -> str | None:
        if node.dead:
            return "dead"
        return "unresponsive" if now - node.last_seen > self.unresponsive_after_s else None

    @staticmethod
    def _worker_reason(node) -> str:
        return (
            "network"
            if _number(node.stats, "push_s") > _number(node.stats, "compute_s")
            else "compute"
        )

    def _waited_for(self, nodes: dict, now: float) -> dict[int, tuple[float, int]]:
        """node id -> (since, how many wait) over every live shard's report."""
        since: dict[int, float] = {}
        waiters: dict[int, set] = {}
        counts: dict[int, int] = {}
        for shard in (n for n in nodes.values() if n.role == "ps" and not n.gone):
            sample = self.shards.get(shard.node_id)
            age = now - sample.at if sample else 0.0
            # as of that heartbeat: a wait since then is not known
            for w in shard.stats.waiting or ():
                if w.for_s >= self.heartbeat_s:
                    since[w.node] = min(since.get(w.node, math.inf), now - age - w.for_s)
                    waiters.setdefault(w.node, set()).update(w.waiters)
            for node, rate in (sample.held_rate if sample else {}).items():
                named = node in nodes and name_of(nodes[node]) in self.open
                if rate >= (KEEP_SHARE if named else HOLD_SHARE):
                    since[node] = min(since.get(node, math.inf), sample.at - self.heartbeat_s)
                    counts[node] = max(counts.get(node, 0), sample.last_waiters.get(node, 0))
        return {n: (s, max(len(waiters.get(n, ())), counts.get(n, 0))) for n, s in since.items()}

    # ------------------------------------------------------------ stalls over time
    def update(
        self, nodes: dict, stopping: bool = False, replaced: frozenset = frozenset()
    ) -> list[dict]:
        """Re-assess (at most ASSESS_PER_HEARTBEAT times per heartbeat
        interval; `stopping`: end every stall now). Returns the `stall` records to write: one per stall
        that ended, one per stall still open whose last record is at least a
        heartbeat old. `replaced`: shard node ids a promoted backup serves
        (cluster.replicas): a dead one holds nobody up."""
        now = self.clock()
        if not stopping and now - self.last_update < self.heartbeat_s / ASSESS_PER_HEARTBEAT:
            return []
        self.last_update = now
        current = {} if stopping else {b.node: b for b in self.blockers(nodes, replaced)}
        out = []
        for name, stall in list(self.open.items()):
            if name not in current:  # it ended after the last update that named it
                out.append(stall.record(stall.seen, ended=True))
                del self.open[name]
        for name, b in current.items():
            stall = self.open.get(name)
            if stall is None:  # the time before it was named counts too
                start = min(b.since, now)
                stall = self.open[name] = Stall(name, b.reason, start, b.waiters, seen=start)
                self.stall_count[name] = self.stall_count.get(name, 0) + 1
            stall.reason, stall.waiters = b.reason, b.waiters
            self._count(stall, now - stall.seen)
            stall.seen = now
            if now - stall.written >= self.heartbeat_s:
                stall.written = now
                out.append(stall.record(now, ended=False))
        return out

    def _count(self, stall: Stall, seconds: float) -> None:
        by_reason = self.held_s.setdefault(stall.node, {})
        by_reason[stall.reason] = by_reason.get(stall.reason, 0.0) + max(0.0, seconds)

    # ------------------------------------------------------------ output
    def current(self) -> list[Stall]:
        """The open stalls, longest first (a copy; safe from another thread)."""
        return sorted(list(self.open.values()), key=lambda s: s.start)

    def gauges(self) -> dict[str, dict[str, float]]:
        """node -> reason -> seconds the open stall has lasted (for /metrics)."""
        now = self.clock()
        out: dict[str, dict[str, float]] = {}
        for s in self.current():
            out.setdefault(s.node, {})[s.reason] = round(now - s.start, 3)
        return out

    def summary(self, shard_held: Iterable[tuple[str, float]] = ()) -> dict:
        """summary.json `stalls`: per node, the seconds it held others up (in
        all and by reason), how many stalls, and the largest hold a shard
        measured (`shard_held_s`, from its releases)."""
        measured: dict[str, float] = {}
        for node, seconds in shard_held:
            measured[node] = max(measured.get(node, 0.0), seconds)
        names = sorted(set(self.held_s) | set(measured))
        return {
            n: {
                "held_s": round(sum(self.held_s.get(n, {}).values()), 3),
                "by_reason": {r: round(s, 3) for r, s in self.held_s.get(n, {}).items()},
                "stalls": self.stall_count.get(n, 0),
                "shard_held_s": round(measured.get(n, 0.0), 3),
            }
            for n in names
        }
