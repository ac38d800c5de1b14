"""What a shard builds from the config (the optimizer and its lr schedule) is checked before
training: a schedule factory given keywords it does not take is a config error naming
optimizer.schedule.kwargs when the config loads (`hetps run` exits 2 before it starts a
process), and one that cannot build the schedule fails the dry step
(`python -m hetps.training.preflight`) as a config error. On real processes:
tests/cluster/test_cluster_untrained.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hetps.frontend.cli import main as hetps_main
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ConfigError
from hetps.training import preflight

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "sync.yaml")

SCHEDULES = """
import torch

def cosine(optimizer, t_max):
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=t_max)

def refusing(optimizer, t_max):
    raise ValueError(f"t_max must be at least 10, got {t_max}")
"""


@pytest.fixture
def schedules(tmp_path, monkeypatch):
    """A user's schedule module beside the config (on PYTHONPATH, as `hetps run` is told)."""
    (tmp_path / "tests_schedules.py").write_text(textwrap.dedent(SCHEDULES))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def errors(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as got:
        load_config(CONFIG, list(overrides), import_targets=True)
    return got.value.errors


def test_a_keyword_the_factory_does_not_take_names_the_key_and_the_close_name(schedules):
    named = ["optimizer.schedule.name=tests_schedules:cosine"]
    assert errors(*named, "optimizer.schedule.kwargs={tmax: 5}") == [
        "optimizer.schedule.kwargs: tests_schedules:cosine(optimizer, t_max) takes no keyword "
        "'tmax'; did you mean 't_max'?"
    ]
    (missing,) = errors(*named)
    assert missing.startswith("optimizer.schedule.kwargs: tests_schedules:cosine(optimizer, t_max)")
    assert "missing a required argument: 't_max'" in missing
    cfg = load_config(CONFIG, [*named, "optimizer.schedule.kwargs={t_max: 5}"], import_targets=True)
    assert cfg.optimizer.schedule.kwargs == {"t_max": 5}
    # a torch scheduler class named directly: its own keywords
    torch_named = "optimizer.schedule.name=torch.optim.lr_scheduler:StepLR"
    assert errors(torch_named, "optimizer.schedule.kwargs={step: 5}")[0].startswith(
        "optimizer.schedule.kwargs: torch.optim.lr_scheduler:StepLR"
    )
    load_config(CONFIG, [torch_named, "optimizer.schedule.kwargs={step_size: 5}"], True)


def test_hetps_run_refuses_it_in_one_line_before_starting_anything(
    schedules, tmp_path, capfd, monkeypatch
):
    """`hetps run`'s entry point in this process (the module on the import path, as
    PYTHONPATH would put it); the path and environment it extends are restored after."""
    run_dir = tmp_path / "run"
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("PYTHONPATH", raising=False)  # restored after: the command extends it
    capfd.readouterr()
    try:
        code = hetps_main(
            [
                *("run", CONFIG),
                "optimizer.schedule.name=tests_schedules:cosine",
                "optimizer.schedule.kwargs={tmax: 5}",
                *("--out", str(run_dir), "--quiet"),
            ]
        )
    except SystemExit as exc:  # the config error (runtime/daemon.py load_or_exit)
        code = exc.code
    finally:
        sys.modules.pop("tests_schedules", None)
    result = subprocess.CompletedProcess("hetps run", code, *capfd.readouterr())
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "hetps: config error: optimizer.schedule.kwargs: tests_schedules:cosine(optimizer, t_max) "
        "takes no keyword 'tmax'; did you mean 't_max'?"
    ]
    assert not run_dir.exists()  # no process started


def test_the_dry_step_builds_the_schedule_a_shard_builds(schedules, capsys):
    args = ["--config", CONFIG, "optimizer.schedule.name=tests_schedules:refusing"]
    assert preflight.main([*args, "optimizer.schedule.kwargs={t_max: 5}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "hetps: config error: optimizer.schedule.name 'tests_schedules:refusing': ValueError: "
        "t_max must be at least 10, got 5"
    ]
    good = ["--config", CONFIG, "optimizer.schedule.name=tests_schedules:cosine"]
    assert preflight.main([*good, "optimizer.schedule.kwargs={t_max: 5}"]) == 0
