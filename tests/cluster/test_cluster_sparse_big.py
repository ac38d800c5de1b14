"""A 10^7 x 32 float32 table (1.28 GB) served sparse trains on one machine: 2
shards, 4 async workers, the DLRM-like model of bench/sparse_model.py. The loss
falls, and while the workers train each one's resident memory stays under 1 GB
above a worker of the same model with a 1000-row table, measured in the same
test: a worker holds the rows a step touches, never the table.

The model factory builds the table on the meta device (`meta: true`), as
docs/sparse.md advises for a table larger than a worker: no process but the
shards ever holds it, so the bound holds for each worker's peak (VmHWM) too.
No checkpoints during the run and no evaluator (an evaluator keeping the best
model copies the whole table at each new best): the workers' step losses are
what shows training. Marked `exclusive`: it is not a timing test, but the two
runs need several GB (the shards 2 x (640 MB rows + 640 MB adagrad state),
twice that while they write their last checkpoint; `hetps run` then exports
the whole model from the checkpoints), more than should run beside another
cluster on a 2-core, 24 GB machine."""

from __future__ import annotations

import statistics
import sys
import threading
from pathlib import Path

import pytest
from cluster_util import REPO, background_run, log_tails, processes_mentioning, records

SPARSE_MODEL = str(REPO / "bench")  # sparse_model.py: the daemons import it by name
sys.path.insert(0, SPARSE_MODEL)
from sparse_model import status_kb  # noqa: E402 (bench/ is not a package)

GB = 1 << 30
STEPS_PER_WORKER = 60
CONFIG = """\
name: sparse-big
seed: 0
model: {name: "sparse_model:dlrm", kwargs: {rows: ROWS, dim: 32, meta: true}}
data: {dataset: "sparse_model:clicks", kwargs: {rows: ROWS}, batch_size: 256}
optimizer: {name: sgd, lr: 0.05, momentum: 0.9}
algorithm: {name: async}
cluster: {shards: 2, workers: 4}
sparse: {tables: [table], optimizer: {name: adagrad, lr: 0.1}}
stop: {max_steps: MAX_STEPS, max_seconds: 300}
eval: {enabled: false, keep_best: false}
checkpoint: {every_s: 0, every_updates: 0}
"""


def worker_pids(run_dir: Path) -> list[int]:
    """The training workers of `hetps run` in `run_dir` (not the check, not an evaluator)."""
    pids = []
    for pid in processes_mentioning(str(run_dir)):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"hetps.worker " in cmdline + b" " and b"--evaluator" not in cmdline:
            pids.append(pid)
    return pids


def train(base: Path, rows: int) -> dict:
    """One run with a table of `rows` x 32; returns its step losses, each worker's
    resident memory sampled while steps were being recorded (kB), and each
    worker's peak (VmHWM, kB, last seen)."""
    base.mkdir(exist_ok=True)
    run_dir, config = base / f"run-{rows}", base / f"sparse-{rows}.yaml"
    text = CONFIG.replace("MAX_STEPS", str(4 * STEPS_PER_WORKER)).replace("ROWS", str(rows))
    config.write_text(text)
    training: dict[int, list[int]] = {}
    peaks: dict[int, int] = {}
    done = threading.Event()

    def sample() -> None:
        # a worker's memory while it trains: from its first step record to the run's end
        while not done.wait(0.1):
            stepping = (run_dir / "metrics.jsonl").exists() and bool(records(run_dir, "step"))
            for pid in worker_pids(run_dir):
                rss, hwm = status_kb(pid, "VmRSS"), status_kb(pid, "VmHWM")
                if rss is None or hwm is None:
                    continue
                peaks[pid] = max(peaks.get(pid, 0), hwm)
                if stepping and not (run_dir / "summary.json").exists():
                    training.setdefault(pid, []).append(rss)

    sampler = threading.Thread(target=sample, daemon=True)
    with background_run(
        [str(config), "--out", str(run_dir), "--quiet"], env={"PYTHONPATH": SPARSE_MODEL}
    ) as proc:
        sampler.start()
        try:
            _, err = proc.communicate(timeout=540)
        finally:
            done.set()
            sampler.join(timeout=10)
    assert proc.returncode == 0, f"{err[-3000:]}\n{log_tails(run_dir)}"
    steps = sorted(records(run_dir, "step"), key=lambda r: r["t"])
    return {"losses": [r["loss"] for r in steps], "training": training, "peaks": peaks}


@pytest.mark.exclusive
@pytest.mark.timeout(900)
def test_a_ten_million_row_table_trains_with_workers_under_1gb_above_a_small_table(run_dir):
    small = train(run_dir, 1000)
    big = train(run_dir, 10_000_000)

    # the loss falls: first 20 steps against the last 20 (0.61 -> 0.50 measured at 30 steps each)
    losses = big["losses"]
    assert len(losses) >= 4 * STEPS_PER_WORKER, len(losses)
    first, last = statistics.mean(losses[:20]), statistics.mean(losses[-20:])
    assert last < first - 0.04, (first, last)

    # every worker was sampled while training, several times
    for run in (small, big):
        assert len(run["training"]) == 4 and all(len(s) >= 3 for s in run["training"].values()), {
            pid: len(s) for pid, s in run["training"].items()
        }
    baseline_kb = max(max(s) for s in small["training"].values())
    held = {pid: max(s) for pid, s in big["training"].items()}
    report = (
        f"loss {first:.3f} -> {last:.3f}; baseline worker {baseline_kb >> 10} MB; "
        f"10^7-row workers while training {sorted(v >> 10 for v in held.values())} MB, "
        f"peaks (build included) {sorted(v >> 10 for v in big['peaks'].values())} MB"
    )
    print(report)
    for pid, kb in held.items():
        assert (kb - baseline_kb) * 1024 < GB, report
    baseline_peak = max(small["peaks"].values())
    for pid, kb in big["peaks"].items():
        assert (kb - baseline_peak) * 1024 < GB, report
