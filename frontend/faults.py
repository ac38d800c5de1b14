"""`cluster.kill` for `hetps run`: SIGKILL named processes at given seconds
after training began (`at_s`: when plan.json appeared) or once the workers'
steps recorded in RUN_DIR/metrics.jsonl number at least `at_step` (summed
over the workers, counting this launch's records only), and start them again
after `restart_after_s` at the same address, to test failure handling by a
setting. A step trigger fires at a point of training, not of the clock, so
it falls after the same checkpoints however loaded the machine is.

Every action is appended to RUN_DIR/faults.jsonl; a killed shard's line
names the newest checkpoint version it had on disk, the one its restart must
resume from, and the steps recorded by then.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

from hetps.runconfig.schema import KillFault
from hetps.runtime import checkpoint


class FaultInjector:
    def __init__(
        self,
        kills: list[KillFault],
        run_dir: Path,
        checkpoint_root: Path | None,
        respawn: Callable[[str, str], None],
    ):
        self.pending = sorted((k for k in kills if k.at_s is not None), key=lambda k: k.at_s)
        self.by_step = sorted((k for k in kills if k.at_step is not None), key=lambda k: k.at_step)
        self.restarts: list[tuple[float, str, str]] = []  # (when, name, address)
        self.run_dir = run_dir
        self.steps = 0  # workers' step records this launch appended to metrics.jsonl
        metrics = run_dir / "metrics.jsonl"
        # a resumed run appends to the stopped run's records: only the new ones count
        self.offset = metrics.stat().st_size if metrics.exists() else 0
        self.checkpoint_root = checkpoint_root
        self.respawn = respawn
        self.killed: set[str] = set()  # names whose exit was ours
        self.started: float | None = None

    def _plan(self) -> dict | None:
        path = self.run_dir / "plan.json"
        return json.loads(path.read_text()) if path.exists() else None

    def fire(self, children: list) -> None:
        if not self.pending and not self.by_step and not self.restarts:
            return
        if self.started is None:
            if not (self.run_dir / "plan.json").exists():
                return
            self.started = time.monotonic()
        elapsed = time.monotonic() - self.started
        while self.pending and elapsed >= self.pending[0].at_s:
            self._kill(self.pending.pop(0), children, elapsed)
        if self.by_step:
            self._count_steps()
        while self.by_step and self.steps >= self.by_step[0].at_step:
            self._kill(self.by_step.pop(0), children, elapsed)
        due = [r for r in self.restarts if r[0] <= elapsed]
        self.restarts = [r for r in self.restarts if r[0] > elapsed]
        for _, name, address in due:
            self.killed.discard(name)
            self._record(action="restart", node=name, t=round(elapsed, 3), address=address)
            print(f"\nhetps run: fault injection: restarting {name} at {address}", file=sys.stderr)
            self.respawn(name, address)

    def _count_steps(self) -> None:
        """Count the step records appended to metrics.jsonl since the last call."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        with open(path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written is read next time
        self.offset += len(complete)
        for line in complete.splitlines():
            if json.loads(line).get("kind") == "step":
                self.steps += 1

    def restarting(self, name: str) -> bool:
        """True while `name` was killed and its restart is still due."""
        return any(r[1] == name for r in self.restarts)

    def _kill(self, fault: KillFault, children: list, elapsed: float) -> None:
        child = next((c for c in children if c.name == fault.node and c.popen.poll() is None), None)
        if child is None:
            return
        when = f"{fault.at_s}s" if fault.at_step is None else f"step {self.steps}"
        print(f"\nhetps run: fault injection: killing {child.name} at {when}", file=sys.stderr)
        address = self._address(fault.node)
        child.popen.kill()
        child.popen.wait(timeout=10)
        self.killed.add(child.name)
        self._record(
            action="kill",
            node=fault.node,
            t=round(elapsed, 3),
            steps=self.steps,
            checkpoint_version=self._checkpoint_version(fault.node),
        )
        if fault.restart_after_s is not None:
            self.restarts.append((elapsed + fault.restart_after_s, fault.node, address))

    def _address(self, name: str) -> str:
        if name == "scheduler":
            return (self.run_dir / "scheduler.addr").read_text().strip()
        plan = self._plan() or {}
        if name.startswith("ps"):
            for shard in plan.get("shards", []):
                if f"ps{shard['rank']}" == name:
                    return shard["address"]
        return ""

    def _checkpoint_version(self, name: str) -> int | None:
        plan = self._plan()
        if not name.startswith("ps") or self.checkpoint_root is None or plan is None:
            return None
        folder = checkpoint.shard_dir(self.checkpoint_root, plan.get("run_id", ""), int(name[2:]))
        found = checkpoint.checkpoints(folder)
        return found[-1][0] if found else None

    def _record(self, **values) -> None:
        with open(self.run_dir / "faults.jsonl", "a") as f:
            f.write(json.dumps(values) + "\n")
