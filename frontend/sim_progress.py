"""`hetps simulate`'s progress line: `hetps run`'s (report.py `Progress`, which
follows metrics.jsonl as it grows) on the virtual clock, with the real
seconds the simulation has taken, e.g.

    [    1.5s/240s] steps     912  test acc 0.8731 (target 0.95)    608.0 steps/s  plan 1: groups 2+2  (41 s real)

The time, the limit and steps/s are virtual. Printed to stderr as the run's
line is: redrawn every 0.5 real seconds on a terminal, a line every 5 s
otherwise, and once more at the end.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

from hetps.runconfig.algorithms import min_aggregated_group
from hetps.runconfig.schema import RunConfig
from hetps.runconfig.targets import stop_target

from .report import Progress


class SimProgress:
    """Called by the simulator after every event (sim/engine.py `progress`): most
    calls only read the wall clock. Not thread-safe (the simulator's loop is one thread)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, stream: TextIO | None = None):
        """`stream`: default sys.stderr (as it is when this is made)."""
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.every_s = 0.5 if self.live else 5.0  # as hetps run's (launcher.py `watch`)
        self.started = time.monotonic()
        self.last_print = self.started  # the first line after every_s: start-up printed its own
        self.progress = Progress(
            run_dir / "metrics.jsonl",
            target=(stop_target(cfg.stop) or (None, None))[1],
            max_seconds=cfg.stop.max_seconds,
            max_steps=cfg.stop.max_steps,
            reduced_from=min_aggregated_group(cfg),
        )

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self.last_print >= self.every_s:
            self.last_print = now
            self._print("\r" if self.live else "\n")

    def close(self) -> None:
        """The last line, as the run ended."""
        self._print("\n")

    def _print(self, end: str) -> None:
        self.progress.poll()
        real = time.monotonic() - self.started
        print(f"{self.progress.line()}  ({real:.0f} s real)", end=end, file=self.stream, flush=True)
