"""What `hetps run` prints while a run goes and when it ends: a live progress
line that follows metrics.jsonl as it grows (`hetps.run(progress=True)` prints the
same line at each evaluation), and the closing summary."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from hetps.scheduler.runlog import fits, parse_record, plan_fits

from .watch import ACCURACY, number, row_value, summary_metric

# the file hetps.load_model(RUN_DIR) loads when the run wrote it (api/models.py)
LOADED = ": hetps.load_model's"
STALL_FRESH_S = 3.0  # an open stall's record older than this (run seconds) is not shown


@dataclass
class Progress:
    """Follows metrics.jsonl as it grows and renders one status line: while
    the cluster forms, who registered and who it still waits for; then the
    training line with the target, the limits, the groups and, while the
    scheduler's latest `stall` records name one, whom training waits for.
    A resumed run's `segment` record starts the line afresh: the cluster forms
    again, while the time and steps go on from the earlier segments'; the time
    limit (`stop.max_seconds`) counts the segment, the step limit the run."""

    path: Path
    # node names the run starts, e.g. ps0, worker3, evaluator
    expected: list = field(default_factory=list)
    target: float | None = None  # a value of the watched metric (stop.target's / target_accuracy)
    max_seconds: float = 0.0
    max_steps: int = 0
    registered: list = field(default_factory=list)
    planned: bool = False
    launched: float = field(default_factory=time.monotonic)
    offset: int = 0
    steps: dict = field(default_factory=dict)  # worker index -> latest step
    # the watched metric: the config's (watch.py configured_metric) until an eval row names it;
    # None: not known before the first evaluation
    metric: str | None = ACCURACY
    value: float | None = None  # its latest value
    lr: float | None = None  # the shards' lr at the latest evaluation (its row's `lr`)
    t: float = 0.0
    rate: float = 0.0
    plan: tuple = (0, 0)  # (plan id, number of groups) of the latest plan
    groups: list = field(default_factory=list)  # the latest plan's groups (node ids)
    stalls: dict = field(default_factory=dict)  # node -> its latest `stall` record
    _samples: list = field(default_factory=list)  # (t, total steps) over the last few seconds
    # comm.aggregate: groups of this many members or more reduce before the shards (0: none)
    reduced_from: int = 0
    segment: int = 1  # a resumed run's segment (from its `segment` record)
    segment_t: float = 0.0  # the run's time when this segment began

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
        elif kind == "eval" and (watched := row_value(rec)) is not None:
            self.metric, self.value = watched
            self.lr = rec["lr"] if fits(rec, lr=float) else self.lr
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
        elif kind == "segment" and fits(rec, segment=int, t=float):
            self._new_segment(rec)

    def _new_segment(self, rec: dict) -> None:
        """A resumed run began a segment: what the line shows of the earlier one is dropped,
        but each worker's steps so far (the run's steps go on from them)."""
        workers = rec.get("workers") if isinstance(rec.get("workers"), dict) else {}
        self.steps = {
            int(w): n for w, n in workers.items() if str(w).isdigit() and fits({"n": n}, n=int)
        }
        self.segment, self.segment_t, self.t = rec["segment"], rec["t"], rec["t"]
        self.registered, self.planned, self.plan, self.groups = [], False, (0, 0), []
        self.stalls, self._samples, self.rate = {}, [], 0.0

    def line(self) -> str:
        if not self.planned:
            return self.startup_line()
        acc = number(self.value) if self.value is not None else "  -   "
        # "test acc" as ever for classification; any other metric by its name
        name = "acc" if self.metric == ACCURACY else self.metric or "metric"
        target = f" (target {self.target})" if self.target is not None else ""
        target += f"  lr {self.lr:.3g}" if self.lr is not None else ""
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
        reduced = [g for g in self.groups if self.reduced_from and len(g) >= self.reduced_from]
        if reduced:  # say so: their pushes reach the shards once per group-round
            groups += (
                " reduced" if len(reduced) == len(self.groups) else f" ({len(reduced)} reduced)"
            )
        plan = f"  plan {self.plan[0]}{groups}" if self.planned else ""
        # a resumed run: the run's time, and this segment's against the time limit
        clock = (
            f"[{self.t:7.1f}s/{self.max_seconds:g}s]"
            if self.segment == 1
            else f"[{self.t:7.1f}s, segment {self.segment}: "
            f"{self.t - self.segment_t:.1f}s/{self.max_seconds:g}s]"
        )
        return (
            f"{clock} steps {sum(self.steps.values()):7d}{steps}  "
            f"test {name} {acc}{target}  {self.rate:7.1f} steps/s{plan}{self.blocked_by()}"
        )

    @property
    def accuracy(self) -> float | None:
        """The latest test accuracy, when accuracy is the watched metric."""
        return self.value if self.metric == ACCURACY else None

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
    """The closing summary, e.g. `sync: completed, final accuracy 0.9554 (model.safetensors),
    best 0.9612 (best.safetensors: hetps.load_model's), time to target 3.1s, ...`: the watched
    metric by its name, rounded like the progress line, and the file in `run_dir` that holds
    each model (none named where the run wrote none)."""
    watched = summary_metric(summary)
    ttt = summary.get("time_to_target_s")
    final, best = watched["final"], watched["best"]
    return (
        f"{summary.get('algorithm')}: {summary.get('status', 'completed')}, final "
        f"{watched['name']} {final if final is None else number(final)}"
        f"{held_in(run_dir, 'model.safetensors')}, best "
        f"{best if best is None else number(best)}{held_in(run_dir, 'best.safetensors')}"
        ", time to target "
        f"{'not reached' if ttt is None else f'{ttt:.1f}s'}, {summary.get('global_steps', 0)} steps in "
        f"{summary.get('wall_s', 0.0):.1f}s ({summary.get('stop_reason')})\nrun directory: {run_dir}"
    )


def held_in(run_dir: Path, name: str) -> str:
    """` (NAME)` when run_dir holds that model file, else empty; ` (NAME: hetps.load_model's)`
    for the one `hetps.load_model(run_dir)` loads (api/models.py model_file: the best model
    when the run wrote one)."""
    if not (run_dir / name).exists():
        return ""
    loaded = "best.safetensors" if (run_dir / "best.safetensors").exists() else "model.safetensors"
    return f" ({name}{LOADED if name == loaded else ''})"
