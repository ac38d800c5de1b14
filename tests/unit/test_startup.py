"""Start-up: the processes that need no tensors load no torch; nodes report
their start-up phases in REGISTER (checked at decode like every field);
summary.json's `startup` section is computed from the launcher's marks and
metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hetps.frontend.startup_report import startup_line, startup_section
from hetps.proto.codec import decode, encode
from hetps.proto.errors import ProtocolError
from hetps.proto.messages import Register
from hetps.runtime.startup import Phases


@pytest.mark.parametrize(
    "module", ["hetps.scheduler.__main__", "hetps.frontend.launcher", "hetps.scheduler.coordinator"]
)
def test_the_scheduler_and_the_launcher_do_not_load_torch(module):
    # a fresh interpreter: this one has torch loaded already
    code = (
        f"import sys, {module}; t = sys.modules.get('torch'); "
        "print('loaded' if t is not None and type(t).__name__ == 'module' else 'not loaded')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "not loaded"


def test_register_carries_startup_phases_through_the_codec():
    msg = Register(role="worker", rank=1, startup={"imports": 1.5, "build": 0.25})
    env = decode(encode(msg, req_id=3, src=0))
    assert env.msg.startup == {"imports": 1.5, "build": 0.25}


@pytest.mark.parametrize(
    "bad",
    [
        {"imports": -1.0},
        {"imports": float("nan")},
        {"": 1.0},
        {"x": "1"},
        {f"p{i}": 1.0 for i in range(17)},
        [1.0],
    ],
)
def test_bad_startup_phases_are_refused(bad):
    frames = encode(Register(role="ps", rank=0, startup=bad))  # a sender's value travels as it is
    with pytest.raises(ProtocolError, match="startup"):
        decode(frames)


def test_phases_accumulate_consecutive_marks():
    phases = Phases(imports_s=1.23456)
    phases.mark("config")
    phases.mark("build")
    d = phases.as_dict()
    assert list(d) == ["imports", "config", "build"] and d["imports"] == 1.235
    assert all(v >= 0 for v in d.values())


def test_startup_section_from_marks_and_records(tmp_path):
    launch = 1000.0
    records = [
        {"kind": "register", "t": 1.0, "node": "ps0", "startup": {"imports": 2.0, "profile": 0.5}},
        {
            "kind": "register",
            "t": 3.0,
            "node": "worker0",
            "startup": {"imports": 2.5, "build": 0.4},
        },
        {
            "kind": "register",
            "t": 3.5,
            "node": "worker1",
            "startup": {"imports": 2.2, "build": 0.9},
        },
        {"kind": "plan", "t": 0.0, "plan_id": 1, "wall": launch + 5.0},
        {"kind": "step", "t": 0.5, "worker": 0, "step": 1},
        {"kind": "stop", "t": 10.0, "reason": "step limit"},
    ]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records) + '{"kind": "cut'
    )
    timeline = {
        "launch": launch,
        "scheduler_up": launch + 1.0,
        "checked": launch + 4.0,
        "exited": launch + 16.0,
    }
    s = startup_section(tmp_path, timeline)
    assert s["scheduler_up_s"] == 1.0 and s["checked_s"] == 4.0
    # the scheduler was up at 1.0; the last registration at its t = 3.5
    assert s["registered_s"] == 4.5
    assert s["plan_s"] == 5.0 and s["first_step_s"] == 5.5 and s["stop_s"] == 1.0
    assert s["node_phases_s"] == {
        "ps": {"imports": 2.0, "profile": 0.5},
        "worker": {"imports": 2.5, "build": 0.9},
    }
    line = startup_line(s)
    assert (
        line.startswith("start-up: first step at 5.5s")
        and "imports 2.5s" in line
        and line.endswith("stop 1.0s")
    )


def test_startup_section_of_a_resumed_run_reads_its_own_records(tmp_path):
    old = [
        {"kind": "register", "t": 9.0, "node": "ps0", "startup": {"imports": 30.0}},
        {"kind": "plan", "t": 0.0, "plan_id": 1, "wall": 500.0},
        {"kind": "step", "t": 0.1, "worker": 0},
        {"kind": "stop", "t": 4.0, "reason": "interrupted"},
    ]
    new = [
        {"kind": "register", "t": 2.0, "node": "ps0", "startup": {"imports": 1.0}},
        {"kind": "plan", "t": 0.0, "plan_id": 2, "wall": 1003.0},
        {"kind": "step", "t": 0.5, "worker": 0},
        {"kind": "stop", "t": 6.0, "reason": "step limit"},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old + new))
    s = startup_section(tmp_path, {"launch": 1000.0, "scheduler_up": 1000.5, "exited": 1010.0})
    assert s["node_phases_s"] == {"ps": {"imports": 1.0}} and s["registered_s"] == 2.5
    assert s["plan_s"] == 3.0 and s["first_step_s"] == 3.5 and s["stop_s"] == 1.0


def test_startup_section_of_a_run_that_never_planned(tmp_path):
    s = startup_section(tmp_path, {"launch": 5.0, "scheduler_up": 6.0})
    assert s == {"scheduler_up_s": 1.0}
    assert startup_line(s).startswith("start-up: no step")


def test_local_gpu_count_agrees_with_torch(monkeypatch):
    import torch

    from hetps.runtime.devices import local_gpu_count

    assert local_gpu_count() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert local_gpu_count() == 0


def test_lazy_module_loads_on_first_use_and_refuses_what_is_missing(monkeypatch):
    from hetps.proto.lazy import lazy_module

    assert lazy_module("json") is sys.modules["json"]  # already imported: itself
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    colorsys = lazy_module("colorsys")
    assert type(colorsys).__name__ != "module"  # not run yet
    assert colorsys.rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0)
    assert type(colorsys).__name__ == "module"  # ran on first use
    with pytest.raises(ImportError, match="no_such_module_xyz"):
        lazy_module("no_such_module_xyz")
