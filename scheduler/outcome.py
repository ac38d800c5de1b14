"""How a run ended, in words a user acts on: the divergence guard, the
run's status and exit code, and the software it ran on.

Statuses (summary.json `status`) and the exit codes of `hetps run`:

    completed    0    target accuracy, time or step limit reached, or a STOP request
    failed       1    a node failed (at start-up: the summary names it and quotes its error),
                      or the run stopped (not interrupted) before any training step
    diverged     3    non-finite test loss or training loss (under cluster.nonfinite skip/clip:
                      every live worker's), NaN/Inf pushes refused from every worker, or for
                      stop.diverged_after evaluations in a row a test loss over LOSS_FACTOR x
                      the first evaluation's, or (tasks with classes) accuracy at chance level
    interrupted  130  Ctrl-C / SIGINT or SIGTERM

(2, a bad config or command line, happens before any run exists.)
"""

from __future__ import annotations

import math
import platform
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from hetps.runtime.failures import Failure

from .nodes import ROLES

EXIT_CODES = {"completed": 0, "failed": 1, "diverged": 3, "interrupted": 130}
INTERRUPTED = "interrupted"
DIVERGED = "diverged"
# accuracy below this multiple of 1/num_classes counts as chance level: a model that
# predicts one class scores about 1/num_classes; one that learns anything climbs well past 1.5x
CHANCE_FACTOR = 1.5
# a test loss above this multiple of the first evaluation's (the barely trained model's) counts
# as exploded: training that goes wrong climbs far past where it started, one that learns
# does not come back up anywhere near 10x
LOSS_FACTOR = 10.0


@dataclass
class DivergenceGuard:
    """Decides that training diverged: a non-finite loss (at once), or, once
    `warmup_s` seconds of training have passed, `after` evaluations in a row
    with a test loss over LOSS_FACTOR x the first evaluation's (`early_loss`,
    when positive) or, for a task with classes, with accuracy below chance
    level. `after` = 0 turns both rules off.

    A worker's training loss depends on `nonfinite` (cluster.nonfinite).
    Under `reject` a non-finite one is a verdict at once: the shards refuse
    NaN/Inf pushes, so one that reached the scheduler came with gradients the
    model took. Under `skip` and `clip`, whose purpose is to keep one bad
    worker's gradients out of the model, it is counted (`nonfinite_losses`)
    and the model is judged instead: the evaluator's test loss, and the
    latest training loss of every live worker (all non-finite: a verdict).
    Pure: fed values and times (seconds of training), no clock of its own."""

    after: int
    warmup_s: float
    lr: float
    nonfinite: str = "reject"  # cluster.nonfinite
    at_chance: int = 0
    early_loss: float | None = None  # the first evaluation's test loss (finite)
    exploded: int = 0  # evaluations in a row with a test loss over LOSS_FACTOR x early_loss
    verdict: str | None = None  # set once: why the run diverged
    # worker name -> its non-finite training losses so far (summary.json `nonfinite_losses`)
    nonfinite_losses: dict[str, int] = field(default_factory=dict)
    # the workers whose latest training loss was not finite
    latest_nonfinite: set[str] = field(default_factory=set)

    def loss(self, value, source: str) -> str | None:
        """A training or test loss from `source` (e.g. 'worker2 at step 14');
        returns the verdict when it is not finite."""
        if self.verdict is None and isinstance(value, (int, float)) and not math.isfinite(value):
            self.verdict = f"loss {value} from {source}; {self.hint()}"
        return self.verdict

    def worker_loss(
        self, value, worker: str, where: str, live: Callable[[], Iterable[str]]
    ) -> str | None:
        """Worker `worker`'s training loss (`where`: e.g. 'worker2 at step 14');
        returns the verdict once diverged. Not finite: counted; then under
        `reject` a verdict, under `skip`/`clip` one only when every worker
        `live()` names (asked only then) has a non-finite latest loss."""
        if not isinstance(value, (int, float)):
            return self.verdict
        if math.isfinite(value):
            self.latest_nonfinite.discard(worker)
            return self.verdict
        self.nonfinite_losses[worker] = self.nonfinite_losses.get(worker, 0) + 1
        self.latest_nonfinite.add(worker)
        if self.nonfinite == "reject":
            return self.loss(value, where)
        names = set(live())
        if self.verdict is None and names and names <= self.latest_nonfinite:
            self.verdict = (
                f"loss {value} from every live worker ({', '.join(sorted(names))}; the last: "
                f"{where}), not only from one whose NaN/Inf gradients cluster.nonfinite="
                f"{self.nonfinite} keeps out of the model; {self.hint()}"
            )
        return self.verdict

    def saved(self) -> dict:
        """What a restarted scheduler needs of this guard (scheduler-state.json `guard`)."""
        return {
            "verdict": self.verdict,
            "at_chance": self.at_chance,
            "early_loss": self.early_loss,
            "exploded": self.exploded,
            "nonfinite_losses": dict(self.nonfinite_losses),
            "latest_nonfinite": sorted(self.latest_nonfinite),
        }

    def restore(self, saved: dict) -> None:
        """Take over `saved` (from `saved()`; {} from an older scheduler's file: nothing)."""
        self.verdict = saved.get("verdict", self.verdict)
        self.at_chance = saved.get("at_chance", self.at_chance)
        self.early_loss = saved.get("early_loss", self.early_loss)
        self.exploded = saved.get("exploded", self.exploded)
        self.nonfinite_losses = dict(saved.get("nonfinite_losses", {}))
        self.latest_nonfinite = set(saved.get("latest_nonfinite", []))

    def evaluation(self, accuracy: float, num_classes: int | None, t: float) -> str | None:
        """One evaluation at `t` seconds of training; returns the verdict once diverged."""
        if self.verdict is not None or not self.after or not num_classes or t < self.warmup_s:
            return self.verdict
        chance = 1.0 / num_classes
        self.at_chance = self.at_chance + 1 if accuracy < CHANCE_FACTOR * chance else 0
        if self.at_chance >= self.after:
            self.verdict = (
                f"test accuracy at chance level ({accuracy:.4f}, chance {chance:.4f}) for "
                f"{self.at_chance} evaluations in a row (stop.diverged_after); {self.hint()}"
            )
        return self.verdict

    def test_loss(self, loss: float | None, t: float) -> str | None:
        """One evaluation's test loss at `t` seconds of training (None: the task reports
        none); returns the verdict once diverged. Non-finite: at once (`loss`). The first
        finite one is the yardstick; from `warmup_s` on, `after` in a row above LOSS_FACTOR
        times it (a positive one) are a verdict."""
        if loss is None or self.loss(loss, "the evaluator (test loss)"):
            return self.verdict
        if self.early_loss is None:
            self.early_loss = loss
            return None
        if not self.after or t < self.warmup_s or self.early_loss <= 0:
            return None
        self.exploded = self.exploded + 1 if loss > LOSS_FACTOR * self.early_loss else 0
        if self.exploded >= self.after:
            self.verdict = (
                f"test loss exploded: {loss:.4g}, over {LOSS_FACTOR:g}x the first evaluation's "
                f"{self.early_loss:.4g}, for {self.exploded} evaluations in a row "
                f"(stop.diverged_after); {self.hint()}"
            )
        return self.verdict

    def nonfinite_pushes(self, source: str) -> str | None:
        """Every live worker left because the shards refused its NaN/Inf
        pushes (the last was `source`); returns the verdict."""
        if self.verdict is None:
            self.verdict = (
                f"NaN/Inf gradients: the shards refused the pushes of every worker (the last to "
                f"leave: {source}); {self.hint()}"
            )
        return self.verdict

    def hint(self) -> str:
        return (
            f"the learning rate is likely too large: lower optimizer.lr (now {self.lr:g}), "
            "e.g. 10x, or the momentum"
        )


def startup_failure(msg, t: float) -> Failure:
    """The `startup_failed` failure of a FAILED message (raises ProtocolError MALFORMED for
    an unknown role)."""
    from hetps.proto.codec import ProtocolError
    from hetps.proto.messages import Status

    if msg.role not in ROLES:
        raise ProtocolError(Status.MALFORMED, f"role {msg.role!r} not in {ROLES}")
    name = f"{msg.role}{msg.rank}"
    last_line = (msg.error.strip().splitlines() or [""])[-1]
    return Failure(
        "startup_failed",
        node=name,
        host=msg.host,
        error=msg.error,
        t=t,
        reason=f"{name}{f' on {msg.host}' if msg.host else ''} failed at start-up: {last_line}",
    )


def checkpoint_failures(node, failures: list[Failure], t: float) -> list[Failure]:
    """`checkpoint_damaged` failures for the damaged checkpoints `node`'s
    stats name (`checkpoints_damaged`: files a starting shard passed over, see
    ps/serving.py) that `failures` does not hold yet. Not a failed run: the
    shard restored an older valid checkpoint and serves on."""
    reported = node.stats.get("checkpoints_damaged")
    if not isinstance(reported, list):
        return []
    name = f"{node.role}{node.rank}"
    known = {(f.node, f.file) for f in failures if f.kind == "checkpoint_damaged"}
    new = []
    for entry in reported:
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
            continue  # plain data from a peer (checked at decode), not necessarily this shape
        if (name, entry["file"]) in known:
            continue
        known.add((name, entry["file"]))
        new.append(
            Failure(
                "checkpoint_damaged",
                node=name,
                node_id=node.node_id,
                t=t,
                file=entry["file"],
                error=str(entry.get("error", "")),
                restored_version=entry.get("restored_version"),
            )
        )
    return new


def no_steps_failure(stop_reason: str | None, steps: int, t: float) -> Failure | None:
    """The `no_steps` failure of a run that stopped (`stop_reason`, neither interrupted nor
    diverged) after `steps` = 0 training steps of its workers, whatever stopped it: such a
    run trained nothing and is never `completed`. None while it runs, or once it stepped."""
    if stop_reason is None or stop_reason in (INTERRUPTED, DIVERGED) or steps > 0:
        return None
    return Failure(
        "no_steps", t=t, error=f"no training step was taken before the run stopped ({stop_reason})"
    )


def run_status(stop_reason: str | None, failed: bool) -> str:
    """summary.json `status` for a run that stopped for `stop_reason`."""
    if failed:
        return "failed"
    if stop_reason in (INTERRUPTED, DIVERGED):
        return stop_reason
    return "completed"


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def git_commit(path: Path) -> str | None:
    """The commit checked out where hetps' code lives (an editable install), else None."""
    try:
        out = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def environment() -> dict:
    """What this run ran on (recorded in summary.json): versions, commit, scheduler host."""
    return {
        "hetps": package_version("hetps"),
        "torch": package_version("torch"),
        "python": platform.python_version(),
        "git_commit": git_commit(Path(__file__).resolve().parent),
        "scheduler_host": platform.node(),
    }
