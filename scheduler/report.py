"""Reading a run directory back: metrics, a live progress line, and the
accuracy/loss-versus-wall-clock plot."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    """All complete JSON lines of a metrics file (a torn last line is skipped)."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


@dataclass
class Progress:
    """Follows metrics.jsonl as it grows and renders one status line: while
    the cluster forms, who registered and who it still waits for; then the
    training line with the target and the limits."""

    path: Path
    expected: list = field(default_factory=list)  # node names the run starts, e.g. ps0, worker3, evaluator
    target: float | None = None
    max_seconds: float = 0.0
    max_steps: int = 0
    registered: list = field(default_factory=list)
    planned: bool = False
    launched: float = field(default_factory=time.monotonic)
    offset: int = 0
    steps: dict = field(default_factory=dict)   # worker index -> latest step
    accuracy: float | None = None
    t: float = 0.0
    rate: float = 0.0
    _samples: list = field(default_factory=list)  # (t, total steps) over the last few seconds

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self.offset += len(complete.encode())
        for line in complete.splitlines():
            rec = json.loads(line)
            if rec["kind"] != "register":  # its t counts from the scheduler's start, not training's
                self.t = max(self.t, rec.get("t", 0.0))
            if rec["kind"] == "step":
                self.steps[rec["worker"]] = max(self.steps.get(rec["worker"], 0), rec["step"])
            elif rec["kind"] == "eval":
                self.accuracy = rec["accuracy"]
            elif rec["kind"] == "register":
                node = "evaluator" if str(rec.get("node")).startswith("evaluator") else rec.get("node")
                if node not in self.registered:  # (the scheduler's evaluator0 is hetps run's evaluator)
                    self.registered.append(node)
            elif rec["kind"] == "plan":
                self.planned = True
        total = sum(self.steps.values())
        self._samples = [s for s in self._samples if s[0] >= self.t - 3.0] + [(self.t, total)]
        t0, total0 = self._samples[0]
        if self.t - t0 >= 0.5:  # steps/s over the last ~3 s of the run
            self.rate = (total - total0) / (self.t - t0)

    def line(self) -> str:
        if not self.planned:
            return self.startup_line()
        acc = f"{self.accuracy:.4f}" if self.accuracy is not None else "  -   "
        target = f" (target {self.target})" if self.target is not None else ""
        steps = f"/{self.max_steps}" if self.max_steps else ""
        return (f"[{self.t:7.1f}s/{self.max_seconds:g}s] steps {sum(self.steps.values()):7d}{steps}  "
                f"test acc {acc}{target}  {self.rate:7.1f} steps/s")

    def startup_line(self) -> str:
        """E.g. `registered 5/7 — waiting for ps1, worker3 (loading data, profiling)`."""
        clock = f"[{time.monotonic() - self.launched:7.1f}s]"
        waiting = [n for n in self.expected if n not in self.registered]
        if not self.registered:
            return f"{clock} starting {len(self.expected)} processes (loading data, building the model, profiling)"
        if not waiting:
            return f"{clock} registered {len(self.registered)}/{len(self.expected)} — planning"
        names = ", ".join(waiting[:6]) + (f" and {len(waiting) - 6} more" if len(waiting) > 6 else "")
        return (f"{clock} registered {len(self.registered)}/{len(self.expected)} — waiting for {names} "
                "(loading data, profiling)")


def plot_run(run_dir: Path, title: str = "") -> Path:
    """Write RUN_DIR/accuracy_vs_time.png from metrics.jsonl; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [r for r in records if r["kind"] == "eval"]
    steps = sorted((r for r in records if r["kind"] == "step"), key=lambda r: r["t"])
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
    ax_acc.plot([r["t"] for r in evals], [r["accuracy"] for r in evals], marker=".")
    ax_acc.set(xlabel="wall-clock time (s)", ylabel="test accuracy", title="test accuracy")
    ax_acc.grid(alpha=0.3)
    ax_loss.plot([r["t"] for r in evals], [r["loss"] for r in evals], marker=".", label="test loss")
    if steps:
        window = max(1, len(steps) // 50)
        smoothed = [sum(r["loss"] for r in steps[i:i + window]) / len(steps[i:i + window])
                    for i in range(0, len(steps), window)]
        ax_loss.plot([steps[i]["t"] for i in range(0, len(steps), window)], smoothed,
                     alpha=0.7, label="train loss (mean)")
    ax_loss.set(xlabel="wall-clock time (s)", ylabel="cross-entropy", title="loss")
    ax_loss.set_yscale("log")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out = run_dir / "accuracy_vs_time.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def format_summary(summary: dict, run_dir: Path) -> str:
    acc = summary.get("final_accuracy")
    ttt = summary.get("time_to_target_s")
    return (f"{summary.get('algorithm')}: {summary.get('status', 'completed')}, final accuracy "
            f"{acc if acc is None else round(acc, 4)}, best {summary.get('best_accuracy')}, time to target "
            f"{'not reached' if ttt is None else f'{ttt:.1f}s'}, {summary.get('global_steps', 0)} steps in "
            f"{summary.get('wall_s', 0.0):.1f}s ({summary.get('stop_reason')})\nrun directory: {run_dir}")
