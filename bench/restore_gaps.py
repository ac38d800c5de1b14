"""Step gaps around a real kill and restart of a sync shard.

    .venv/bin/python bench/restore_gaps.py [--repeats 20] [--config configs/sync.yaml]
                                           [--seconds 8] [--out DIR] [key=value ...]

Each repeat runs `hetps run CONFIG` with checkpoints after every update and
`cluster.kill` SIGKILLing shard ps1 at a time spread over 1.0-2.5 s of
training, restarting it 1 s later at the same address (it restores its
newest checkpoint). From the run's step records (metrics.jsonl, every
worker's steps on the scheduler's clock) it takes the longest gap between
consecutive steps from 1 s before the kill to the end, and compares it with
2 x cluster.dead_after_s (the bound the recovery must keep) and with the
longest gap before the kill in the same run (the baseline). A run passes
when steps resumed after the restart and the gap is within the bound. It
also reports when the restarted shard registered again and how soon after
that the first step came: the restarted process's own start-up (python,
torch) is part of the gap, and on a loaded machine it can dominate it.
Prints one row per run and a summary; writes DIR/restore_gaps.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
FIRST_KILL_S, LAST_KILL_S = 1.0, 2.5
RESTART_AFTER_S = 1.0


def kill_times(repeats: int) -> list[float]:
    """Kill times spread evenly over [FIRST_KILL_S, LAST_KILL_S]."""
    if repeats == 1:
        return [FIRST_KILL_S]
    return [
        round(FIRST_KILL_S + i * (LAST_KILL_S - FIRST_KILL_S) / (repeats - 1), 3)
        for i in range(repeats)
    ]


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def measure(run_dir: Path, dead_after_s: float) -> dict:
    """Gaps between consecutive step records before and after the kill."""
    faults = lines(run_dir / "faults.jsonl")
    kill_t = next(f["t"] for f in faults if f["action"] == "kill")
    records = lines(run_dir / "metrics.jsonl")
    steps = sorted(r["t"] for r in records if r["kind"] == "step")
    stop_t = min(
        (r["t"] for r in records if r["kind"] == "stop"), default=steps[-1] if steps else 0.0
    )
    before = [t for t in steps if t < kill_t - 1.0]
    # no step until the stop is a gap too
    around = [t for t in steps if kill_t - 1.0 <= t <= stop_t] + [stop_t]
    gaps = [b - a for a, b in zip(around, around[1:])]
    summary = json.loads((run_dir / "summary.json").read_text())
    restored = summary["shard_stats"].get("ps1", {}).get("restored_version")
    # when the restarted shard registered again: the process start before it is the machine's, not hetps's
    back_t = next((f["t"] for f in summary["failures"] if f["kind"] == "shard_restarted"), None)
    after = [t for t in steps if back_t is not None and t >= back_t]
    resumed = bool(after)
    gap = max(gaps, default=float("inf"))
    return {
        "kill_t": kill_t,
        "restored_version": restored,
        "steps": len(steps),
        "resumed": resumed,
        "registered_again_t": back_t,
        "first_step_after_registering_s": round(after[0] - back_t, 3) if after else None,
        "longest_gap_after_registering_s": round(
            max((b - a for a, b in zip(after, after[1:])), default=0.0), 3
        ),
        "longest_gap_s": round(gap, 3),
        "baseline_gap_s": round(max((b - a for a, b in zip(before, before[1:])), default=0.0), 3),
        "bound_s": 2 * dead_after_s,
        "ok": resumed and gap <= 2 * dead_after_s,
    }


def run_once(config: str, kill_at: float, seconds: float, out: Path, overrides: list[str]) -> dict:
    run_dir = out / f"kill-{kill_at:.3f}"
    cmd = [
        sys.executable,
        "-m",
        "hetps.frontend.cli",
        "run",
        config,
        "--out",
        str(run_dir),
        "--quiet",
        "checkpoint.every_updates=1",
        "cluster.retry_s=0.5",
        "stop.target_accuracy=null",
        f"stop.max_seconds={seconds}",
        f"cluster.kill=[{{node: ps1, at_s: {kill_at}, restart_after_s: {RESTART_AFTER_S}}}]",
        *overrides,
    ]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=seconds + 180)
    if proc.returncode != 0:
        return {"kill_at": kill_at, "ok": False, "error": proc.stderr[-2000:]}
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    dead_after_s = float(cfg.get("cluster", {}).get("dead_after_s", 5.0))
    return {
        "kill_at": kill_at,
        "wall_s": round(time.monotonic() - started, 1),
        **measure(run_dir, dead_after_s),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--config", default="configs/sync.yaml")
    parser.add_argument("--seconds", type=float, default=8.0, help="stop.max_seconds of each run")
    parser.add_argument("--out", default="runs/restore-gaps")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"machine: {platform.processor() or platform.machine()}, {platform.python_version()}; "
        f"{args.repeats} runs of {args.config}"
    )
    results = []
    for kill_at in kill_times(args.repeats):
        r = run_once(args.config, kill_at, args.seconds, out, args.overrides)
        results.append(r)
        if "error" in r:
            print(f"kill at {kill_at:.2f}s: hetps run failed\n{r['error']}")
            continue
        print(
            f"kill at {kill_at:.2f}s (t={r['kill_t']:.2f}): restored v{r['restored_version']}, "
            f"back at t={r['registered_again_t']}, first step {r['first_step_after_registering_s']}s after, "
            f"longest gap after {r['longest_gap_after_registering_s']}s; longest gap "
            f"{r['longest_gap_s']:.2f}s (baseline before the kill {r['baseline_gap_s']:.2f}s; "
            f"bound {r['bound_s']:.1f}s) {'ok' if r['ok'] else 'FAILED'}"
        )
    ok = sum(r["ok"] for r in results)
    gaps = [r["longest_gap_s"] for r in results if "longest_gap_s" in r]
    print(
        f"{ok} of {len(results)} runs within the bound; longest gap {max(gaps, default=float('nan')):.2f}s"
    )
    (out / "restore_gaps.json").write_text(
        json.dumps({"command": sys.argv, "results": results}, indent=2)
    )
    return 0 if ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
