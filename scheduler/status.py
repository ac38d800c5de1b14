"""What the scheduler reports about a run: the summary written to
summary.json at the end and the numbers of the operator's /metrics endpoint.
Both are read-only views of a `Coordinator` (they take it whole: a report
reads most of its state) and change nothing.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .efficiency import run_efficiency
from .nodes import ROLES, EvalTrack
from .outcome import environment, no_steps_failure, run_status
from .placement import placement_shares
from .segments import COUNTED, segment_summary

if TYPE_CHECKING:
    from .coordinator import Coordinator


def count(stats: dict, key: str) -> int:
    """A count from a node's stats (a records.NodeStats); 0 when absent or
    not a finite number."""
    value = stats.get(key, 0)
    return int(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0


AGGREGATION_STATS = (
    "aggregate",
    "group_size",
    "collective_s",
    "collective_group_rounds",
    "collective_pushes_saved",
    "collective_failures",
    "collective_partial_rounds",
)


def aggregation_summary(workers) -> dict:
    """comm.aggregate: per worker, its group's size, whether it reduced with it, the seconds
    in collectives, rounds reduced, pushes it left to another member, collectives failed and
    partial rounds (its slices pushed, another member's maybe not: docs/failure-model.md);
    with the totals of the last three. Empty when no worker reduces in a group."""
    per = {
        f"worker{n.rank}": {k: n.stats.extra[k] for k in AGGREGATION_STATS if k in n.stats.extra}
        for n in sorted(workers, key=lambda n: n.rank)
        if "aggregate" in n.stats.extra
    }
    if not per:
        return {}
    totals = {
        k: sum(v.get(f"collective_{k}", 0) for v in per.values())
        for k in ("group_rounds", "failures", "partial_rounds")
    }
    return {**totals, "workers": per}


def run_summary(coord: Coordinator) -> dict:
    """summary.json: results, traffic, shard statistics, failures."""
    workers = sorted(coord.members("worker", "evaluator"), key=lambda n: (n.role, n.rank))
    # this segment's counts; a resumed run's totals add the earlier segments' (segments.py)
    own = {f"{n.role}{n.rank}": {k: count(n.stats, k) for k in COUNTED} for n in workers}
    earlier = coord.earlier
    totals = {
        name: {k: earlier.count(name, k) + own.get(name, {}).get(k, 0) for k in COUNTED}
        for name in [*own, *sorted(set(earlier.counts) - set(own))]
    }
    per_node = {
        name: {
            "sent": c["bytes_sent"],
            "received": c["bytes_received"],
            **{k: c[k] for k in COUNTED if not k.startswith("bytes_")},
        }
        for name, c in totals.items()
    }
    own_evals = coord.evals.count - int(earlier.evals.get("count", 0))
    stragglers = [f"{n.role}{n.rank}" for n in coord.nodes.values() if not n.gone]
    steps = earlier.total("steps") + coord.global_steps()
    # a run that trained nothing failed, whatever stopped it (computed: a view changes nothing)
    no_steps = no_steps_failure(coord.stop_reason, steps, round(coord.elapsed(), 3))
    failed = (
        coord.failed
        or next((f for f in coord.failures if f.kind in ("startup", "startup_failed")), None)
        or no_steps
    )
    failures = [*coord.failures, no_steps] if no_steps and failed is no_steps else coord.failures
    return {
        "status": run_status(coord.stop_reason, failed is not None),
        "failed_node": failed.node if failed else None,
        "detail": failed.error or coord.stop_reason if failed else coord.guard.verdict,
        "name": coord.cfg.name,
        "algorithm": coord.cfg.algorithm.name,
        **metric_summary(coord.evals),
        "target_patience": coord.evals.patience,
        "time_to_target_s": coord.evals.time_to_target_s,
        # the whole run: a resumed run's earlier segments included (`segments` says what each did)
        "wall_s": round(earlier.t + coord.elapsed(), 3),
        "global_steps": steps,
        "bytes_sent": sum(v["sent"] for v in per_node.values()),
        "bytes_received": sum(v["received"] for v in per_node.values()),
        "per_node": per_node,
        "evals": coord.evals.count,
        "efficiency": run_efficiency(coord),
        "compression": compression_summary(coord.cfg.comm, per_node.values()),
        "aggregation": aggregation_summary(coord.members("worker")),
        "shard_versions": {f"ps{n.rank}": count(n.stats, "version") for n in coord.members("ps")},
        "communication_rounds": max(
            (count(n.stats, "rounds") or count(n.stats, "version") for n in coord.members("ps")),
            default=0,
        ),
        "shard_stats": {f"ps{n.rank}": n.stats.as_dict() for n in coord.members("ps")},
        # per shard: its share of the model's bytes beside its share of the shards' speed
        "placement": placement_shares(coord.plan) if coord.plan else {},
        **(
            {"spare_stats": {f"spare{n.rank}": n.stats.as_dict() for n in coord.members("spare")}}
            if coord.members("spare")
            else {}
        ),
        "plan_id": coord.plan.plan_id if coord.plan else 0,
        "stop_reason": coord.stop_reason,
        "segments": [
            *earlier.segments,
            segment_summary(
                earlier.segment,
                earlier.t,
                coord.elapsed(),
                own,
                own_evals,
                coord.evals.final if own_evals > 0 else None,
                coord.evals.metric or "accuracy",
                coord.stop_reason,
            ),
        ],
        # worker -> its non-finite training losses (under cluster.nonfinite skip/clip: no verdict)
        "nonfinite_losses": dict(sorted(coord.guard.nonfinite_losses.items())),
        "failures": [f.to_json() for f in failures],
        "not_left": stragglers,
        "hosts": {
            f"{n.role}{n.rank}": n.host
            for n in sorted(coord.nodes.values(), key=lambda n: n.node_id)
        },
        "stalls": stall_summary(coord),
        "environment": environment(),
    }


def metric_summary(ev: EvalTrack) -> dict:
    """summary.json's evaluation results: the classification fields as ever
    (`final_accuracy`, `best_accuracy`, `target_accuracy`: None for a task without
    accuracy), and for any task the watched metric (`metric`: name and direction),
    every metric of the last evaluation (`final_metrics`), the watched metric's best
    value (`best`) and the stop target (`target`: metric and value, or None)."""
    # a scheduler state saved before metrics were named, or a resumed run not evaluated yet
    watching_accuracy = ev.metric in (None, "accuracy")
    best_accuracy = ev.best_accuracy
    if best_accuracy is None and watching_accuracy and ev.count:
        best_accuracy = ev.best
    name = ev.metric or (ev.target_metric if ev.target is not None else None)
    return {
        "final_accuracy": ev.final_metrics.get("accuracy", ev.final if watching_accuracy else None),
        "final_loss": ev.final_loss,
        "best_accuracy": best_accuracy,
        "target_accuracy": ev.target if ev.target_metric == "accuracy" else None,
        "metric": {"name": name, "higher_is_better": ev.higher_is_better} if name else None,
        "final_metrics": dict(ev.final_metrics),
        "best": ev.best if ev.count else None,
        "target": (
            {"metric": ev.target_metric, "value": ev.target} if ev.target is not None else None
        ),
    }


def saved_summary(saved: dict) -> dict:
    """What a scheduler that died for good had saved in its state file
    (scheduler-state.json, state.py), in summary.json's shape: the workers'
    steps and samples as last heard, the evaluations, the failures and the
    training time so far, marked `from_state: true`. Plain data read back from
    a file: a field it lacks is left out."""
    workers = [n for n in saved.get("nodes") or [] if n.get("role") == "worker"]
    out: dict = {
        "from_state": True,
        "run_id": saved.get("run_id"),
        "global_steps": sum(count(n.get("stats") or {}, "steps") for n in workers),
        "global_samples": sum(count(n.get("stats") or {}, "samples") for n in workers),
        "failures": list(saved.get("failures") or []),
    }
    if isinstance(saved.get("elapsed_s"), (int, float)):
        out["wall_s"] = round(saved["elapsed_s"], 3)
    try:
        ev = EvalTrack(**saved["evals"])
    except (KeyError, TypeError):
        return out
    return {**out, "evals": ev.count, **metric_summary(ev)}


def stall_summary(coord: Coordinator) -> dict:
    """summary.json `stalls`: per node, the seconds it held others up (stalls.py)."""
    names = {n.node_id: f"{n.role}{n.rank}" for n in coord.nodes.values()}
    measured = [
        (names.get(h.node, f"node{h.node}"), h.seconds)
        for shard in coord.members("ps")
        for h in shard.stats.held or ()
    ]
    return coord.stalls.summary(measured)


def compression_summary(comm, nodes) -> dict:
    """Gradient bytes the workers' compression saved (`comm.compression`)."""
    dense = sum(v["grad_dense_bytes"] for v in nodes)
    sent = sum(v["grad_sent_bytes"] for v in nodes)
    return {
        "kind": comm.compression,
        "topk_ratio": comm.topk_ratio,
        "grad_dense_bytes": dense,
        "grad_sent_bytes": sent,
        "grad_bytes_saved": dense - sent,
    }


def operator_metrics(coord: Coordinator) -> dict:
    """Numbers for the operator's /metrics endpoint. Called from the
    metrics thread: reads a snapshot of the nodes, writes nothing."""
    nodes = list(coord.nodes.values())
    states = {role: {"alive": 0, "left": 0, "dead": 0} for role in ROLES}
    for n in nodes:
        states[n.role]["left" if n.left else "dead" if n.dead else "alive"] += 1
    ev = coord.evals
    return {
        "nodes": states,
        "plan_id": coord.plan.plan_id if coord.plan else 0,
        "global_steps": sum(count(n.stats, "steps") for n in nodes if n.role == "worker"),
        **_watched_metrics(ev),
        "evals": ev.count,
        "elapsed_s": coord.elapsed(),
        "stopping": int(coord.stop_reason is not None),
        "stall_s": coord.stalls.gauges(),
        "stall_held_s": {n: v["held_s"] for n, v in coord.stalls.summary().items()},
    }


def _watched_metrics(ev: EvalTrack) -> dict:
    """/metrics' evaluation gauges: accuracy, best accuracy and loss as ever (absent
    for a task without them), and the watched metric under its name (`metric`)."""
    fields = metric_summary(ev)
    return {
        "accuracy": fields["final_accuracy"],
        "loss": ev.final_loss,
        "best_accuracy": fields["best_accuracy"],
        "metric": {ev.metric: ev.final} if ev.metric is not None else {},
        "best_metric": {ev.metric: fields["best"]} if ev.metric is not None else {},
    }
