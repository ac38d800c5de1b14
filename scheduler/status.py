"""What the scheduler reports about a run: the summary written to
summary.json at the end and the numbers of the operator's /metrics endpoint.
Both are read-only views of a `Coordinator` (they take it whole: a report
reads most of its state) and change nothing.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .efficiency import run_efficiency
from .outcome import environment, run_status

if TYPE_CHECKING:
    from .coordinator import Coordinator

ROLES = ("ps", "spare", "worker", "evaluator")


def count(stats: dict, key: str) -> int:
    """A count from a node's stats (a records.NodeStats); 0 when absent or
    not a finite number."""
    value = stats.get(key, 0)
    return int(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0


def run_summary(coord: Coordinator) -> dict:
    """summary.json: results, traffic, shard statistics, failures."""
    workers = sorted(coord.members("worker", "evaluator"), key=lambda n: (n.role, n.rank))
    per_node = {
        f"{n.role}{n.rank}": {
            "sent": count(n.stats, "bytes_sent"),
            "received": count(n.stats, "bytes_received"),
            "steps": count(n.stats, "steps"),
            "samples": count(n.stats, "samples"),
            **{
                k: count(n.stats, k)
                for k in ("resent", "dropped", "delayed", "grad_dense_bytes", "grad_sent_bytes")
            },
        }
        for n in workers
    }
    stragglers = [f"{n.role}{n.rank}" for n in coord.nodes.values() if not n.gone]
    failed = coord.failed or next(
        (f for f in coord.failures if f["kind"] in ("startup", "startup_failed")), None
    )
    return {
        "status": run_status(coord.stop_reason, failed is not None),
        "failed_node": failed.get("node") if failed else None,
        "detail": failed.get("error") or coord.stop_reason if failed else coord.guard.verdict,
        "name": coord.cfg.name,
        "algorithm": coord.cfg.algorithm.name,
        "final_accuracy": coord.evals.final,
        "final_loss": coord.evals.final_loss,
        "best_accuracy": coord.evals.best if coord.evals.count else None,
        "target_accuracy": coord.evals.target,
        "target_patience": coord.evals.patience,
        "time_to_target_s": coord.evals.time_to_target_s,
        "wall_s": round(coord.elapsed(), 3),
        "global_steps": coord.global_steps(),
        "bytes_sent": sum(v["sent"] for v in per_node.values()),
        "bytes_received": sum(v["received"] for v in per_node.values()),
        "per_node": per_node,
        "evals": coord.evals.count,
        "efficiency": run_efficiency(coord),
        "compression": compression_summary(coord.cfg.comm, per_node.values()),
        "shard_versions": {f"ps{n.rank}": count(n.stats, "version") for n in coord.members("ps")},
        "communication_rounds": max(
            (count(n.stats, "rounds") or count(n.stats, "version") for n in coord.members("ps")),
            default=0,
        ),
        "shard_stats": {f"ps{n.rank}": n.stats.as_dict() for n in coord.members("ps")},
        **(
            {"spare_stats": {f"spare{n.rank}": n.stats.as_dict() for n in coord.members("spare")}}
            if coord.members("spare")
            else {}
        ),
        "plan_id": coord.plan.plan_id if coord.plan else 0,
        "stop_reason": coord.stop_reason,
        # worker -> its non-finite training losses (under cluster.nonfinite skip/clip: no verdict)
        "nonfinite_losses": dict(sorted(coord.guard.nonfinite_losses.items())),
        "failures": coord.failures,
        "not_left": stragglers,
        "hosts": {
            f"{n.role}{n.rank}": n.host
            for n in sorted(coord.nodes.values(), key=lambda n: n.node_id)
        },
        "stalls": stall_summary(coord),
        "environment": environment(),
    }


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
        "accuracy": ev.final,
        "loss": ev.final_loss,
        "best_accuracy": ev.best if ev.count else None,
        "evals": ev.count,
        "elapsed_s": coord.elapsed(),
        "stopping": int(coord.stop_reason is not None),
        "stall_s": coord.stalls.gauges(),
        "stall_held_s": {n: v["held_s"] for n, v in coord.stalls.summary().items()},
    }
