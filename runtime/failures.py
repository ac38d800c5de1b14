"""What went wrong during a run, as the scheduler records it: one typed record per failure.

The coordinator keeps a run's failures as `Failure`s; summary.json `failures` and the
scheduler's state file hold their `to_json()` (a map whose keys depend on the kind, as
below), and a restarted scheduler reads them back with `from_json`. Not every failure
fails the run: a damaged checkpoint passed over, a shard that came back or was replaced
by its backup are recorded and the run goes on (scheduler/outcome.py says which end it).

    {role}_dead          a node silent for longer than cluster.dead_after_s
    {role}_error         a node that left on an error (its BYE carried one)
    shard_restarted      a shard registered again (restarted from its checkpoint)
    shard_failover       a dead shard's ranges went to their backups (a new plan)
    startup_failed       a node could not start and said why (FAILED)
    checkpoint_damaged   a starting shard passed over a damaged checkpoint file
    config               the run cannot reach its target (a setting, found once running)
    timer_error          one of the scheduler's timers raised (recorded once per timer)
    startup              the cluster did not form within cluster.startup_timeout_s
    no_steps             the run stopped before any worker took a training step

`{role}` is `shard` for a ps, else the node's role (`worker`, `spare`, `evaluator`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

Kind = Literal[
    "worker_dead",
    "shard_dead",
    "spare_dead",
    "evaluator_dead",
    "worker_error",
    "shard_error",
    "spare_error",
    "evaluator_error",
    "shard_restarted",
    "shard_failover",
    "startup_failed",
    "checkpoint_damaged",
    "config",
    "timer_error",
    "startup",
    "no_steps",
]
KINDS: frozenset[str] = frozenset(get_args(Kind))

# the fields each kind writes after `kind`, in order: summary.json's shape of each kind
# (a `{role}_dead` / `{role}_error` kind by its suffix)
FIELDS: dict[str, tuple[str, ...]] = {
    "dead": ("node", "node_id", "t", "silent_s"),
    "error": ("node", "node_id", "t", "error", "refused"),
    "shard_restarted": ("node", "t", "was_dead"),
    "shard_failover": ("node", "node_id", "t", "plan_id", "served_by", "backups"),
    "startup_failed": ("node", "host", "error", "t", "reason"),
    "checkpoint_damaged": ("node", "node_id", "t", "file", "error", "restored_version"),
    "config": ("node", "t", "error"),
    "timer_error": ("timer", "error", "t"),
    "startup": ("missing", "refused_nodes"),
    "no_steps": ("t", "error"),
}
# a field whose JSON key is another name: `startup`'s refused nodes share the key `refused`
# with `{role}_error`'s refused status
JSON_KEY = {"refused_nodes": "refused"}


@dataclass(frozen=True)
class Failure:
    """One failure of a run. `kind` says which fields it holds (FIELDS); the others stay None.
    Raises ValueError for an unknown kind."""

    kind: Kind
    node: str | None = None  # the node's name, e.g. "worker1", "ps0"
    node_id: int | None = None
    t: float | None = None  # seconds of the run (the scheduler's clock) when it was recorded
    host: str | None = None  # startup_failed: the host the node reported
    error: str | None = None  # what the node, the timer or the check said (no_steps: why)
    reason: str | None = None  # startup_failed: the run's stop reason, one line
    silent_s: float | None = None  # {role}_dead: seconds since it was last heard from
    refused: int | None = None  # {role}_error: the Status its pushes were refused with (0: none)
    was_dead: bool | None = None  # shard_restarted: it had been declared dead first
    plan_id: int | None = None  # shard_failover: the failover plan
    served_by: dict[str, int] | None = None  # shard_failover: plan.served_by
    backups: dict[str, int] | None = None  # shard_failover: plan.backups
    file: str | None = None  # checkpoint_damaged: the file passed over
    restored_version: int | None = None  # checkpoint_damaged: the version restored instead
    timer: str | None = None  # timer_error: the timer's name
    missing: dict[str, int] | None = None  # startup: role -> nodes still missing
    refused_nodes: list[dict] | None = None  # startup: the nodes refused ({node, host, reason, t})

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown failure kind {self.kind!r}; one of {sorted(KINDS)}")

    @classmethod
    def of_node(cls, role: str, rank: int, node_id: int, what: str, t: float, **more) -> Failure:
        """A node's `{role}_{what}` failure (`what`: dead or error), e.g. `worker_dead`."""
        kind = f"{'shard' if role == 'ps' else role}_{what}"
        return cls(kind, node=f"{role}{rank}", node_id=node_id, t=t, **more)  # type: ignore[arg-type]

    def to_json(self) -> dict[str, Any]:
        """The record as summary.json and the state file hold it: `kind`, then its fields."""
        return {
            "kind": self.kind,
            **{JSON_KEY.get(f, f): getattr(self, f) for f in _fields(self.kind)},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Failure:
        """The record `to_json` wrote (a key missing: None). Raises ValueError for an unknown
        kind, KeyError without one."""
        kind = data["kind"]
        if kind not in KINDS:
            raise ValueError(f"unknown failure kind {kind!r}; one of {sorted(KINDS)}")
        return cls(kind, **{f: data.get(JSON_KEY.get(f, f)) for f in _fields(kind)})


def _fields(kind: str) -> tuple[str, ...]:
    return FIELDS.get(kind) or FIELDS[kind.rpartition("_")[2]]


def declared_dead(failures: list[dict[str, Any]]) -> set[str]:
    """The nodes a run's failures (summary.json `failures`, oldest first) leave declared dead:
    a `{role}_dead` record not followed by the node's `shard_restarted`."""
    dead: set[str] = set()
    for f in failures:
        node, kind = f.get("node"), str(f.get("kind", ""))
        if not isinstance(node, str):
            continue
        if kind.endswith("_dead"):
            dead.add(node)
        elif kind == "shard_restarted":
            dead.discard(node)
    return dead
