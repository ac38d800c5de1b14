"""Where the seconds of a local run's start and stop went: the `startup`
section of summary.json and the line `hetps run` prints.

Times are seconds after `hetps run` started (its process start), read from
the launcher's own wall-clock marks and from metrics.jsonl: `register`
records (their `t` counts from the scheduler's start, and they carry each
node's own phases: imports, config, build, profile), the first `plan`
record (`wall`: when training's clock started) and the first `step`.
`stop_s` is from the scheduler's stop decision to the last process gone.
"""

from __future__ import annotations

import json
from pathlib import Path

PHASES = ("imports", "config", "build", "profile")


def _records(run_dir: Path) -> list[dict]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut short by a kill
            continue
    return out


def this_run(recs: list[dict], launch: float) -> tuple[list[dict], dict | None]:
    """The records of the run started at `launch` (a resumed run's metrics.jsonl
    holds the earlier runs' first) and its first plan record (None: no plan yet)."""
    first = next(
        (i for i, r in enumerate(recs) if r.get("kind") == "plan" and r.get("wall", 0.0) >= launch),
        None,
    )
    end = first if first is not None else len(recs)
    begin = max((i + 1 for i, r in enumerate(recs[:end]) if r.get("kind") == "stop"), default=0)
    return recs[begin:], (recs[first] if first is not None else None)


def startup_section(run_dir: Path, timeline: dict[str, float]) -> dict:
    """The `startup` section: seconds after launch of each mark, the slowest
    node's time in each of its own phases per role, and the stop time.
    Marks that did not happen (a run that never trained) are left out."""
    launch = timeline["launch"]
    out = {
        k + "_s": round(v - launch, 3) for k, v in timeline.items() if k not in ("launch", "exited")
    }
    recs, plan = this_run(_records(run_dir), launch)
    phases: dict[str, dict[str, float]] = {}
    registered = []
    for r in (r for r in recs if r.get("kind") == "register"):
        role = str(r.get("node", "")).rstrip("0123456789")
        for name, s in (r.get("startup") or {}).items():
            phases.setdefault(role, {})[name] = max(phases.get(role, {}).get(name, 0.0), s)
        if "scheduler_up" in timeline:
            # its clock starts when it binds
            registered.append(timeline["scheduler_up"] + r.get("t", 0.0))
    if phases:
        out["node_phases_s"] = phases
    if registered:
        out["registered_s"] = round(max(registered) - launch, 3)
    if plan is None:
        return out
    t0 = plan["wall"] - plan.get("t", 0.0)
    out["plan_s"] = round(plan["wall"] - launch, 3)
    after = recs[recs.index(plan) :]
    step = next((r for r in after if r.get("kind") == "step"), None)
    if step is not None:
        out["first_step_s"] = round(t0 + step["t"] - launch, 3)
    stop = next((r for r in after if r.get("kind") == "stop"), None)
    if stop is not None and "exited" in timeline:
        out["stop_s"] = round(timeline["exited"] - (t0 + stop["t"]), 3)
    return out


def startup_line(section: dict) -> str:
    """One line for the terminal, e.g. `start-up: first step at 7.1s (...); stop 0.8s`."""
    first = section.get("first_step_s")
    head = f"start-up: first step at {first:.1f}s" if first is not None else "start-up: no step"
    marks = [
        f"{k[:-2].replace('_', ' ')} {section[k]:.1f}s"
        for k in ("scheduler_up_s", "fork_server_s", "checked_s", "registered_s", "plan_s")
        if k in section
    ]
    slowest = {
        name: max(
            (p.get(name, 0.0) for p in section.get("node_phases_s", {}).values()), default=0.0
        )
        for name in PHASES
    }
    nodes = ", ".join(f"{k} {v:.1f}s" for k, v in slowest.items() if v)
    stop = f"; stop {section['stop_s']:.1f}s" if "stop_s" in section else ""
    return f"{head} ({', '.join(marks)}; slowest node: {nodes or 'n/a'}){stop}"
