"""The scheduler's state on disk (RUN_DIR/scheduler-state.json), so a
restarted scheduler carries on where the old one stopped: the run id, the
plan, the model's tensor list, the nodes and their ids, the evaluation track,
the failures, the divergence guard's counts and, once decided, the stop (its
reason, the node failure or divergence verdict behind it). Written whole
(temporary file + rename) after every plan and registration, the moment a
stop is decided (before any node can hear of it), and every SAVE_EVERY_S
while training.

Nodes restored from it count as alive from the moment of the restart; the
ones that do not come back are declared dead after cluster.dead_after_s as
usual. A restarted scheduler that finds a stop carries that stop on: the
nodes are told to stop, and the ones it never hears from (they heard the stop
from the old scheduler and left) count as left after cluster.dead_after_s.

The run's clock survives a restart: the state holds when training began on
the wall clock (`started_unix`), so evaluation times, `time_to_target_s` and
`wall_s` go on counting through the restart and the time the scheduler was
down, never back (a wall clock stepped back by NTP cannot make them go below
the `elapsed_s` last saved). A resumed run's earlier segments (`earlier`,
segments.py) are saved too: a restart mid-segment goes on counting from them,
and the next resume adds this segment to them.

The file's format lives here (`write`, `read`, `load`); what goes into it and
when is the coordinator's (Coordinator.save_state, Coordinator.restore).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hetps.proto.plan import ClusterPlan, TensorSpec
from hetps.runtime.failures import Failure

from .nodes import EvalTrack, Node
from .runlog import write_json_atomic
from .segments import Earlier

STATE_FILE = "scheduler-state.json"
SAVE_EVERY_S = 2.0


def read(run_dir: Path | None) -> dict | None:
    """The saved state in `run_dir`, None if there is none."""
    path = run_dir / STATE_FILE if run_dir else None
    if path is None or not path.exists():
        return None
    return json.loads(path.read_text())


def write(
    run_dir: Path,
    *,
    run_id: str,
    finished: bool,
    elapsed: float | None,
    plan: ClusterPlan | None,
    specs: list[TensorSpec] | None,
    schema: str,
    nodes: Iterable[Node],
    evals: EvalTrack,
    failures: list[Failure],
    stop: dict | None = None,
    guard: dict | None = None,
    earlier: dict | None = None,
) -> None:
    """Write a scheduler's state into `run_dir` (Coordinator.save_state).
    `finished`: the run ended, a later scheduler must not carry it on;
    `elapsed`: seconds since training began, None before the first plan;
    `stop`: the stop decided, {"reason", "failed": a Failure or None} (None: training goes on);
    `guard`: the divergence guard's counts and verdict (DivergenceGuard.saved);
    `earlier`: a resumed run's earlier segments (Earlier.to_dict)."""
    write_json_atomic(
        run_dir / STATE_FILE,
        {
            "run_id": run_id,
            "finished": finished,
            "elapsed_s": elapsed,
            "started_unix": time.time() - elapsed if elapsed is not None else None,
            "plan": plan.to_dict() if plan else None,
            "specs": [s.to_wire() for s in specs] if specs else None,
            "schema": schema,
            "nodes": [
                {
                    **{
                        k: v
                        for k, v in dataclasses.asdict(n).items()
                        if k not in ("stats", "last_seen")
                    },
                    "stats": numbers(n.stats),
                }
                for n in nodes
            ],
            "evals": dataclasses.asdict(evals),
            "failures": [f.to_json() for f in failures],
            "stop": {**stop, "failed": _json(stop.get("failed"))} if stop else None,
            "guard": guard or {},
            "earlier": earlier or {},
        },
    )


def numbers(stats) -> dict:
    """The numeric entries of a node's stats (steps, bytes, ...): what the summary counts."""
    return {
        k: v
        for k, v in stats.as_dict().items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


@dataclass
class Saved:
    """A saved state as a restarted scheduler takes it over (Coordinator.restore)."""

    run_id: str
    specs: list[TensorSpec] | None
    schema: str
    plan: ClusterPlan | None
    nodes: dict[int, Node]  # alive from now on (`last_seen`)
    started: float | None  # training began (this process's monotonic clock); None: not yet
    measured: dict  # the evaluation track's measured fields (not target and patience)
    failures: list[Failure]
    stop: dict | None  # the stop decided: {"reason", "failed": a Failure or None}; None: going on
    guard: dict  # the divergence guard's counts and verdict (DivergenceGuard.restore)
    earlier: Earlier  # a resumed run's earlier segments (segments.py)


def load(data: dict, now: float | None = None) -> Saved:
    """`data` (from `read`) as of `now` on the restarted scheduler's clock
    (None: time.monotonic())."""
    now = time.monotonic() if now is None else now
    started = None
    if data["elapsed_s"] is not None:
        since_start = time.time() - data.get("started_unix", time.time() - data["elapsed_s"])
        started = now - max(data["elapsed_s"], since_start)
    # what was measured comes from the file; the target and patience from this scheduler's config
    return Saved(
        run_id=data["run_id"],
        specs=[TensorSpec.from_wire(s) for s in data["specs"]] if data["specs"] else None,
        schema=data["schema"],
        plan=ClusterPlan.from_dict(data["plan"]) if data["plan"] else None,
        nodes={n["node_id"]: Node(**n, last_seen=now) for n in data["nodes"]},
        started=started,
        measured={k: v for k, v in data["evals"].items() if k not in ("target", "patience")},
        failures=[Failure.from_json(f) for f in data["failures"]],
        # absent from the files of older schedulers
        stop=_stop(data.get("stop")),
        guard=data.get("guard") or {},
        earlier=Earlier.from_dict(data.get("earlier")),
    )


def _json(failure: Failure | None) -> dict | None:
    return failure.to_json() if failure is not None else None


def _stop(saved: dict | None) -> dict | None:
    """The saved stop with its failure (`failed`) read back as a Failure."""
    if not saved:
        return saved
    failed = saved.get("failed")
    return {**saved, "failed": Failure.from_json(failed) if failed else None}
