"""`cluster.kill` by step (`at_step`): `hetps run`'s fault injector kills a
(real, here `sleep`) child once the workers' step records in metrics.jsonl
number at least N, counting only the records of this launch, and restarts it."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

from hetps.frontend.faults import FaultInjector
from hetps.runconfig.schema import KillFault


@dataclass
class Child:  # what the launcher's children look like to the injector
    name: str
    popen: subprocess.Popen


@pytest.fixture
def sleeper():
    procs = []

    def start(name: str) -> Child:
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        return Child(name, procs[-1])

    yield start
    for p in procs:
        p.kill()
        p.wait(timeout=10)


def append(run_dir, records: list[dict], partial: str = "") -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records) + partial)


def steps(worker: int, first: int, n: int) -> list[dict]:
    return [
        {"kind": "step", "t": 0.1, "worker": worker, "step": s} for s in range(first, first + n)
    ]


def test_a_kill_by_step_fires_once_the_workers_recorded_that_many_steps(tmp_path, sleeper):
    run_dir = tmp_path
    # a resumed run's directory: the stopped run's 500 steps do not count
    append(run_dir, steps(0, 0, 500))
    restarted = []
    faults = FaultInjector(
        [KillFault(node="worker1", at_step=40, restart_after_s=0.0)],
        run_dir,
        None,
        lambda name, address: restarted.append(name),
    )
    child = sleeper("worker1")
    faults.fire([child])  # no plan yet: nothing counts
    (run_dir / "plan.json").write_text(json.dumps({"shards": []}))
    append(run_dir, [{"kind": "plan", "t": 0.0, "plan_id": 1}] + steps(0, 0, 19) + steps(1, 0, 19))
    faults.fire([child])
    assert child.popen.poll() is None and faults.steps == 38
    # the 40th step record is still being written: not counted yet
    append(run_dir, steps(0, 19, 1), partial='{"kind": "step", "t": 0.2, "wor')
    faults.fire([child])
    assert child.popen.poll() is None and faults.steps == 39
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('ker": 1, "step": 19}\n')
    faults.fire([child])
    assert child.popen.wait(timeout=10) is not None  # killed at step 40
    assert faults.steps == 40 and restarted == ["worker1"]  # and restarted (after 0 s)
    kill, restart = [
        json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()
    ]
    assert (kill["action"], kill["node"], kill["steps"]) == ("kill", "worker1", 40)
    assert restart["action"] == "restart"
    append(run_dir, steps(0, 20, 100))
    faults.fire([sleeper("worker1")])  # fired once: the restarted process is left alone
    assert len((run_dir / "faults.jsonl").read_text().splitlines()) == 2
