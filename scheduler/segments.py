"""A resumed run's segments: one run, trained in several stretches.

`hetps run --resume` (the scheduler's `--resume`) starts a new segment of a
stopped run. Its clock and counts go on from the earlier segments' totals
(`Earlier`), so that the run reads as one: every record in metrics.jsonl (and
TensorBoard) carries the run's time, global steps, samples and bytes
(`Earlier.shift`, applied by RunLog), summary.json counts the whole run and
lists what each segment did, and `stop.max_steps` counts the whole run.
`stop.max_seconds` counts the new segment: it is the wall-clock budget of
this allocation. The time between segments (the run stopped) is not counted.

The totals are read from the stopped segment's scheduler-state.json (its
nodes' last stats, its clock, its evaluation track) plus the earlier
segments it carried itself (saved there as `earlier`), so resuming needs no
summary.json: a segment killed before it wrote one still counts as far as
its last saved state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# a node's stats that count work done; summed over segments per node
COUNTED = (
    "steps",
    "samples",
    "bytes_sent",
    "bytes_received",
    "resent",
    "dropped",
    "delayed",
    "grad_dense_bytes",
    "grad_sent_bytes",
)
# the evaluation track's fields that do not go on over segments: the target and its patience
# are the new segment's config, and its streak starts again (a resumed run's target must be
# held by its own evaluations); every other field (count, best, final, time to target...) does
NOT_CARRIED_EVALS = frozenset({"target", "patience", "streak", "target_metric"})


@dataclass
class Earlier:
    """What the run's earlier segments did; all zero for a run's first segment."""

    t: float = 0.0  # seconds of training (plan to stop) of all earlier segments
    # node name as in summary.json's per_node (worker0, evaluator0) -> COUNTED stat -> total
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    # the evaluation track as it ended, but NOT_CARRIED_EVALS
    evals: dict = field(default_factory=dict)
    segments: list[dict] = field(default_factory=list)  # per earlier segment: `segment_summary`

    @property
    def segment(self) -> int:
        """This segment's number, from 1."""
        return len(self.segments) + 1

    def count(self, node: str, key: str) -> int:
        return self.counts.get(node, {}).get(key, 0)

    def total(self, key: str, role: str = "worker") -> int:
        """`key` summed over the earlier segments' nodes of `role`."""
        return sum(c.get(key, 0) for n, c in self.counts.items() if n.startswith(role))

    def worker_steps(self) -> dict[int, int]:
        """Worker rank -> its steps in the earlier segments."""
        return {
            int(n[len("worker") :]): c.get("steps", 0)
            for n, c in self.counts.items()
            if n.startswith("worker") and n[len("worker") :].isdigit()
        }

    def shift(self, kind: str, values: dict) -> dict:
        """A record of this segment (RunLog.record's kind and values) in the run's terms: its
        time after the earlier segments' (not a `register` record's: its t counts from this
        scheduler's start), its global steps, samples and bytes on top of theirs, a worker's
        step after that worker's earlier steps."""
        if not self.segments:
            return values
        out = dict(values)

        def add(key: str, amount: float) -> None:
            if isinstance(out.get(key), (int, float)) and not isinstance(out[key], bool):
                out[key] = out[key] + amount

        if kind != "register":
            add("t", self.t)
        add("global_steps", self.total("steps"))
        add("global_samples", self.total("samples"))
        add("bytes", self.total("bytes_sent") + self.total("bytes_received"))
        if kind == "step" and isinstance(out.get("worker"), int):
            add("step", self.count(f"worker{out['worker']}", "steps"))
        if isinstance(out.get("t"), float):
            out["t"] = round(out["t"], 4)
        return out

    def to_dict(self) -> dict:
        return {"t": self.t, "counts": self.counts, "evals": self.evals, "segments": self.segments}

    @classmethod
    def from_dict(cls, data: dict | None) -> Earlier:
        data = data or {}
        return cls(
            t=float(data.get("t", 0.0)),
            counts={n: dict(c) for n, c in (data.get("counts") or {}).items()},
            evals=dict(data.get("evals") or {}),
            segments=list(data.get("segments") or []),
        )


def node_counts(stats: dict) -> dict[str, int]:
    """The COUNTED entries of a node's stats (a saved state's numbers, or NodeStats.as_dict())."""
    out = {}
    for key in COUNTED:
        value = stats.get(key, 0)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
            out[key] = int(value)
    return out


def segment_summary(
    segment: int,
    started_at_s: float,
    wall_s: float,
    counts: dict[str, dict[str, int]],
    evals: int,
    final: float | None,
    metric: str | None,
    stop_reason: str | None,
) -> dict:
    """What one segment did (summary.json `segments`): when it began on the run's clock, how
    long it trained, its own steps, samples, bytes and evaluations, its last evaluation of the
    watched `metric` (`final`), how it ended."""
    workers = [c for n, c in counts.items() if n.startswith("worker")]
    return {
        "segment": segment,
        "started_at_s": round(started_at_s, 3),
        "wall_s": round(wall_s, 3),
        "global_steps": sum(c.get("steps", 0) for c in workers),
        "samples": sum(c.get("samples", 0) for c in workers),
        "bytes_sent": sum(c.get("bytes_sent", 0) for c in counts.values()),
        "bytes_received": sum(c.get("bytes_received", 0) for c in counts.values()),
        "evals": evals,
        "metric": metric,
        "final": final,
        "stop_reason": stop_reason,
    }


def after(saved: dict) -> Earlier:
    """The earlier segments of a run resumed from the stopped segment's state (state.read):
    the ones that segment carried, and itself."""
    before = Earlier.from_dict(saved.get("earlier"))
    wall = float(saved.get("elapsed_s") or 0.0)
    own = {}
    for n in saved.get("nodes") or []:
        if n.get("role") in ("worker", "evaluator"):
            own[f"{n['role']}{n['rank']}"] = node_counts(n.get("stats") or {})
    counts = {name: dict(c) for name, c in before.counts.items()}
    for name, c in own.items():
        mine = counts.setdefault(name, {})
        for key, value in c.items():
            mine[key] = mine.get(key, 0) + value
    evals = {k: v for k, v in (saved.get("evals") or {}).items() if k not in NOT_CARRIED_EVALS}
    own_evals = int(evals.get("count", 0)) - int(before.evals.get("count", 0))
    stop = saved.get("stop") or {}
    return Earlier(
        t=before.t + wall,
        counts=counts,
        evals=evals,
        segments=[
            *before.segments,
            segment_summary(
                before.segment,
                before.t,
                wall,
                own,
                max(0, own_evals),
                evals.get("final") if own_evals > 0 else None,
                evals.get("metric") or "accuracy",
                stop.get("reason"),
            ),
        ],
    )
