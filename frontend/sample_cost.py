"""A simulated worker's compute: `sim.sample_s`, the seconds per training
sample of a slowdown-1 worker (sim/workers.py `base_step_s`), for the user's model.

The schema's figure, 0.0002, is LeNet-5's on one CPU core. When a config
does not set `sim.sample_s` (neither its file nor an override),
`hetps simulate` measures the configured model on this machine instead: the
check before training (training/preflight.py `build_checked`: the model
built on its data, one dry step of the task), then the speed profile a real
worker registers with (worker/trainer.py `profile_speed`:
`cluster.profile_steps` forward+backward passes of `data.batch_size`
samples after one warm-up pass, one torch thread, on the CPU the simulator
computes on). A number in the config is used as it is; when every worker
has its own `step_s` (`--replay`), `sim.sample_s` is not used and nothing
is measured. `hetps simulate` prints one line saying which it is; `hetps compare
--simulate` measures once per model and data setting (`SampleCosts`), so
its entries run with one figure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from hetps.runconfig.load import apply_override, load_raw, task_shorthand
from hetps.runconfig.schema import NodeConfig, RunConfig, SimConfig
from hetps.runtime.emulation import Slowdown
from hetps.training.data import Datasets
from hetps.training.preflight import build_checked
from hetps.training.state import ModelState
from hetps.training.step import task_for

LENET5_SAMPLE_S = SimConfig().sample_s  # the schema's default: LeNet-5 on one CPU core

# where a run's sample_s came from (summary.json simulation.sample_s_from)
MEASURED, CONFIG, UNUSED = "measured", "config", "unused"


@dataclass(frozen=True)
class SampleCost:
    """The `sim.sample_s` a simulation runs with (seconds per sample) and where it came
    from: MEASURED (on this machine), CONFIG (the file or an override), UNUSED (every
    worker has its `step_s`)."""

    sample_s: float
    source: str

    def line(self, cfg: RunConfig) -> str:
        """What `hetps simulate` says about it, e.g. `sim.sample_s 6.1e-05 s per sample,
        measured on this machine: ...`."""
        if self.source == UNUSED:
            return "sim.sample_s not used: every worker's compute is its cluster.workers step_s"
        if self.source == CONFIG:
            lenet = " (LeNet-5's figure)" if self.sample_s == LENET5_SAMPLE_S else ""
            return f"sim.sample_s {self.sample_s:.4g} s per sample{lenet}, from the config"
        return (
            f"sim.sample_s {self.sample_s:.4g} s per sample, measured on this machine's CPU: "
            f"model {cfg.model.name!r}, {cfg.cluster.profile_steps} steps of "
            f"{cfg.data.batch_size} samples, one torch thread (the default, LeNet-5's, is "
            f"{LENET5_SAMPLE_S:g}; set sim.sample_s for a fixed figure)"
        )


def sample_s_given(path: str | Path | None, overrides: list[str]) -> bool:
    """Whether the config file or one of `overrides` sets `sim.sample_s` (the loaded
    config cannot tell a value written as the default from the default). The config
    must already have loaded without errors (runtime/daemon.py `load_or_exit`)."""
    raw = load_raw(path) if path else {}
    for assignment in overrides:
        task_shorthand(raw)  # as load_config applies them: `task: NAME` takes task.kwargs=...
        apply_override(raw, assignment)
    sim = raw.get("sim") if isinstance(raw, dict) else None
    return isinstance(sim, dict) and "sample_s" in sim


def measure_sample_s(cfg: RunConfig) -> tuple[float, Datasets]:
    """Seconds per training sample of the configured model on this machine's CPU, one
    torch thread (see the module doc), and the datasets loaded for it. Blocking: the
    datasets' load and `cluster.profile_steps` + 1 steps. Raises PreflightError (the
    check before training's one line)."""
    # the real worker's profile, not a copy (here, not in sim/: the simulator's workers run
    # training's step core and never import worker's)
    from hetps.worker.trainer import profile_speed

    torch.set_num_threads(1)  # as the simulation computes (sim/engine.py `simulate`)
    data, model = build_checked(cfg, "cpu", sparse=True)  # as a worker builds it
    speed = profile_speed(
        ModelState(model, torch.device("cpu")),
        data,
        cfg.data.batch_size,
        cfg.cluster.profile_steps,
        Slowdown(NodeConfig()),  # slowdown 1: each worker's own slowdown applies on top
        cfg.model.autocast,
        task_for(cfg, data.num_classes),
        cfg.data.num_workers,
    )
    return 1.0 / speed, data


def sample_cost(cfg: RunConfig, given: bool) -> tuple[RunConfig, SampleCost, Datasets | None]:
    """`cfg` with the `sim.sample_s` to simulate, where it came from, and the datasets
    when measuring loaded them (None otherwise). `given`: the config sets it
    (`sample_s_given`). Raises PreflightError when the model cannot be measured."""
    if all(node.step_s for node in cfg.cluster.workers):
        return cfg, SampleCost(cfg.sim.sample_s, UNUSED), None
    if given:
        return cfg, SampleCost(cfg.sim.sample_s, CONFIG), None
    sample_s, data = measure_sample_s(cfg)
    sim = dataclasses.replace(cfg.sim, sample_s=float(f"{sample_s:.4g}"))
    return dataclasses.replace(cfg, sim=sim), SampleCost(sim.sample_s, MEASURED), data


class SampleCosts:
    """`sample_cost` for the runs of a comparison (`hetps compare --simulate`): one
    measurement per model and data setting, so entries that differ in their algorithm or
    seed run with one figure. Blocking, as `sample_cost`; not thread-safe."""

    def __init__(self) -> None:
        self.measured: dict[str, SampleCost] = {}

    def __call__(self, cfg: RunConfig, given: bool) -> tuple[RunConfig, SampleCost]:
        """`cfg` with its `sim.sample_s` and where it came from (see `sample_cost`)."""
        key = repr((cfg.model, cfg.data, cfg.cluster.profile_steps))
        if given or all(node.step_s for node in cfg.cluster.workers):
            return sample_cost(cfg, given)[:2]
        if key not in self.measured:
            self.measured[key] = sample_cost(cfg, given)[1]
        cost = self.measured[key]
        return dataclasses.replace(
            cfg, sim=dataclasses.replace(cfg.sim, sample_s=cost.sample_s)
        ), cost
