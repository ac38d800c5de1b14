"""What `hetps run` prints while a run goes and when it ends: a live progress
line that follows metrics.jsonl as it grows, and the closing summary."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from hetps.scheduler.runlog import fits, parse_record, plan_fits

STALL_FRESH_S = 3.0  # an open stall's record older than this (run seconds) is not shown


@dataclass
class Progress:
    """Follows metrics.jsonl as it grows and renders one status line: while
    the cluster forms, who registered and who it still waits for; then the
    training line with the target, the limits, the groups and, while the
    scheduler's latest `stall` records name one, whom training waits for."""

    path: Path
    # node names the run starts, e.g. ps0, worker3, evaluator
    expected: list = field(default_factory=list)
    target: float | None = None
    max_seconds: float = 0.0
    max_steps: int = 0
    registered: list = field(default_factory=list)
    planned: bool = False
    launched: float = field(default_factory=time.monotonic)
    offset: int = 0
    steps: dict = field(default_factory=dict)  # worker index -> latest step
    accuracy: float | None = None
    t: float = 0.0
    rate: float = 0.0
    plan: tuple = (0, 0)  # (plan id, number of groups) of the latest plan
    groups: list = field(default_factory=list)  # the latest plan's groups (node ids)
    stalls: dict = field(default_factory=dict)  # node -> its latest `stall` record
    _samples: list = field(default_factory=list)  # (t, total steps) over the last few seconds

    def poll(self) -> None:
        """Read the lines added since the last poll (a torn last one waits for the next); a line
        that is no record, or a record without the fields this line shows, is skipped."""
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        for rec in map(parse_record, complete.splitlines()):
            if rec is not None:
                self._take(rec)
        total = sum(self.steps.values())
        self._samples = [s for s in self._samples if s[0] >= self.t - 3.0] + [(self.t, total)]
        t0, total0 = self._samples[0]
        if self.t - t0 >= 0.5:  # steps/s over the last ~3 s of the run
            self.rate = (total - total0) / (self.t - t0)

    def _take(self, rec: dict) -> None:
        kind = rec["kind"]
        # a register record's t counts from the scheduler's start, not training's
        if kind != "register" and fits(rec, t=float):
            self.t = max(self.t, rec["t"])
        if kind == "step" and fits(rec, worker=int, step=int):
            self.steps[rec["worker"]] = max(self.steps.get(rec["worker"], 0), rec["step"])
        elif kind == "eval" and fits(rec, accuracy=float):
            self.accuracy = rec["accuracy"]
        elif kind == "register" and fits(rec, node=str):
            # the scheduler's evaluator0 is hetps run's evaluator
            node = "evaluator" if rec["node"].startswith("evaluator") else rec["node"]
            if node not in self.registered:
                self.registered.append(node)
        elif plan_fits(rec):
            self.planned = True
            self.plan = (rec["plan_id"], len(rec["groups"]))
            self.groups = rec["groups"]
        elif kind == "stall" and fits(rec, node=str, t=float, for_s=float):
            self.stalls[rec["node"]] = rec

    def line(self) -> str:
        if not self.planned:
            return self.startup_line()
        acc = f"{self.accuracy:.4f}" if self.accuracy is not None else "  -   "
        target = f" (target {self.target})" if self.target is not None else ""
        steps = f"/{self.max_steps}" if self.max_steps else ""
        # async and ssp: one per worker
        several = len(self.groups) > 1 and max(map(len, self.groups)) > 1
        groups = (
            f": groups {'+'.join(str(len(g)) for g in self.groups)}"
            if several
            else ": 1 group"
            if len(self.groups) == 1
            else ""
        )
        plan = f"  plan {self.plan[0]}{groups}" if self.planned else ""
        return (
            f"[{self.t:7.1f}s/{self.max_seconds:g}s] steps {sum(self.steps.values()):7d}{steps}  "
            f"test acc {acc}{target}  {self.rate:7.1f} steps/s{plan}{self.blocked_by()}"
        )

    def blocked_by(self) -> str:
        """E.g. ` — waiting 3.2 s for worker4 (compute) — 5 workers idle`; empty
        when no open stall was recorded in the last STALL_FRESH_S of the run."""
        open_ = [
            r
            for r in self.stalls.values()
            if not r.get("ended") and r.get("t", 0.0) >= self.t - STALL_FRESH_S
        ]
        if not open_:
            return ""
        top = max(open_, key=lambda r: r.get("for_s", 0.0))
        more = f" and {len(open_) - 1} more" if len(open_) > 1 else ""
        idle = top.get("waiting", 0)
        return (
            f" — waiting {top.get('for_s', 0.0):.1f} s for {top['node']} ({top.get('reason')}){more}"
            f" — {idle} worker{'' if idle == 1 else 's'} idle"
        )

    def startup_line(self) -> str:
        """E.g. `registered 5/7 — waiting for ps1, worker3 (loading data, profiling)`."""
        clock = f"[{time.monotonic() - self.launched:7.1f}s]"
        waiting = [n for n in self.expected if n not in self.registered]
        if not self.registered:
            return f"{clock} starting {len(self.expected)} processes (loading data, building the model, profiling)"
        if not waiting:
            return f"{clock} registered {len(self.registered)}/{len(self.expected)} — planning"
        names = ", ".join(waiting[:6]) + (
            f" and {len(waiting) - 6} more" if len(waiting) > 6 else ""
        )
        return (
            f"{clock} registered {len(self.registered)}/{len(self.expected)} — waiting for {names} "
            "(loading data, profiling)"
        )


def format_summary(summary: dict, run_dir: Path) -> str:
    acc = summary.get("final_accuracy")
    ttt = summary.get("time_to_target_s")
    return (
        f"{summary.get('algorithm')}: {summary.get('status', 'completed')}, final accuracy "
        f"{acc if acc is None else round(acc, 4)}, best {summary.get('best_accuracy')}, time to target "
        f"{'not reached' if ttt is None else f'{ttt:.1f}s'}, {summary.get('global_steps', 0)} steps in "
        f"{summary.get('wall_s', 0.0):.1f}s ({summary.get('stop_reason')})\nrun directory: {run_dir}"
    )
