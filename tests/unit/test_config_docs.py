"""docs/configuration.md is generated from the config dataclasses
(runconfig/reference.py) and must match them: this fails when a config field
changes and the file was not regenerated."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hetps.runconfig import schema as config
from hetps.runconfig.algorithms import ALGORITHM_PARAMS
from hetps.runconfig.reference import REGENERATE, render

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_reference_is_up_to_date():
    assert DOCS.exists(), f"docs/configuration.md is missing: run `{REGENERATE}`"
    assert DOCS.read_text() == render(), f"docs/configuration.md is out of date: run `{REGENERATE}`"


def test_every_key_is_listed_with_a_description():
    text = render()
    rows = {
        line.split("`")[1]: line.rsplit("|", 2)[1].strip()
        for line in text.splitlines()
        if line.startswith("| `")
    }
    for key in (
        "optimizer.lr",
        "cluster.retry_s",
        "cluster.workers.N.slowdown",
        "cluster.kill[].restart_after_s",
        "cluster.faults.drop",
        "comm.fuse_pull",
        "checkpoint.keep",
        "security.keys_dir",
    ):
        assert key in rows, key
    for name, cls in ALGORITHM_PARAMS.items():
        for f in dataclasses.fields(cls):
            assert f"algorithm.{f.name}" in rows, (name, f.name)
    undocumented = [k for k, meaning in rows.items() if not meaning]
    assert not undocumented, (
        f"give the field a help text, setting(default, help=...), in runconfig/schema.py: {undocumented}"
    )
    assert rows["comm.compression"].endswith("(one of: `none`, `fp16`, `topk`)")
    assert f"`{config.ClusterConfig().retry_s}`" in next(
        line for line in text.splitlines() if "`cluster.retry_s`" in line
    )
