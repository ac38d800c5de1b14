"""The scheduler's state on disk (RUN_DIR/scheduler-state.json), so a
restarted scheduler carries on where the old one stopped: the run id, the
plan, the model's tensor list, the nodes and their ids, the evaluation track
and the failures. Written whole (temporary file + rename) after every plan
and registration and every SAVE_EVERY_S while training.

Nodes restored from it count as alive from the moment of the restart; the
ones that do not come back are declared dead after cluster.dead_after_s as
usual.

The run's clock survives a restart: the state holds when training began on
the wall clock (`started_unix`), so evaluation times, `time_to_target_s` and
`wall_s` go on counting through the restart and the time the scheduler was
down, never back (a wall clock stepped back by NTP cannot make them go below
the `elapsed_s` last saved).
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from hetps.proto.plan import ClusterPlan, TensorSpec

from .runlog import write_json_atomic

STATE_FILE = "scheduler-state.json"
SAVE_EVERY_S = 2.0


def read(run_dir: Path | None) -> dict | None:
    """The saved state in `run_dir`, None if there is none."""
    path = run_dir / STATE_FILE if run_dir else None
    if path is None or not path.exists():
        return None
    return json.loads(path.read_text())


def save(coord, finished: bool = False) -> None:
    """Write the coordinator's state (no-op without a run directory);
    `finished`: the run ended, a later scheduler must not carry it on."""
    if coord.runlog.run_dir is None or not getattr(coord, "keeps_state", True):
        return
    coord.state_saved = coord.clock()
    coord.state_dirty = False
    write_json_atomic(coord.runlog.run_dir / STATE_FILE, {
        "run_id": coord.run_id,
        "finished": finished,
        "elapsed_s": coord.elapsed() if coord.started else None,
        "started_unix": time.time() - coord.elapsed() if coord.started else None,
        "plan": coord.plan.to_dict() if coord.plan else None,
        "specs": [s.to_wire() for s in coord.specs] if coord.specs else None,
        "schema": coord.schema,
        "nodes": [{**{k: v for k, v in dataclasses.asdict(n).items() if k not in ("stats", "last_seen")},
                   "stats": numbers(n.stats)} for n in coord.nodes.values()],
        "evals": dataclasses.asdict(coord.evals),
        "failures": coord.failures,
    })


def numbers(stats) -> dict:
    """The numeric entries of a node's stats (steps, bytes, ...): what the summary counts."""
    return {k: v for k, v in stats.as_dict().items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def restore(coord, data: dict, node_type) -> None:
    """Load `data` (from `read`) into a fresh coordinator."""
    now = time.monotonic()
    coord.run_id = data["run_id"]
    coord.specs = [TensorSpec.from_wire(s) for s in data["specs"]] if data["specs"] else None
    coord.schema = data["schema"]
    coord.plan = ClusterPlan.from_dict(data["plan"]) if data["plan"] else None
    coord.nodes = {n["node_id"]: node_type(**n, last_seen=now) for n in data["nodes"]}
    if data["elapsed_s"] is not None:
        since_start = time.time() - data.get("started_unix", time.time() - data["elapsed_s"])
        coord.started = now - max(data["elapsed_s"], since_start)
    # what was measured comes from the file; the target and patience from this scheduler's config
    measured = {k: v for k, v in data["evals"].items() if k not in ("target", "patience")}
    coord.evals = dataclasses.replace(coord.evals, **measured)
    coord.failures = list(data["failures"])
