"""docs/own-model.md's walk through the custom-task example names what exists: every file of
the checkout it names, and its YAML is configs/sines.yaml's own (abridged, not changed).
The run directory's files it names, and its loading snippet, are checked against a real
run in tests/cluster/test_example_sines.py."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "own-model.md"
HEADING = "## A task of your own, end to end: the sines example"
# a checkout's path as the walk writes it; the installed package's hetps/ is the checkout's
# folders (pyproject's package-dir)
PATH = re.compile(r"`((?:examples|configs|tests|docs|hetps)/[\w./-]+)`")


def walk() -> str:
    text = DOC.read_text()
    assert HEADING in text
    return text.split(HEADING, 1)[1].split("\n## ", 1)[0]


def blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, re.S)


def test_every_file_the_walk_names_exists():
    named = set(PATH.findall(walk()))
    assert {"examples/sines.py", "configs/sines.yaml"} <= named, named
    assert "tests/cluster/test_example_sines.py" in named
    for path in named:
        in_checkout = re.sub(r"^hetps/", "", path)
        assert (REPO / in_checkout).exists(), path


def subset(part, whole, where=""):
    if isinstance(part, dict):
        assert isinstance(whole, dict), where
        for key, value in part.items():
            assert key in whole, f"{where}.{key}"
            subset(value, whole[key], f"{where}.{key}")
    else:
        assert part == whole, (where, part, whole)


def test_the_walks_yaml_is_the_shipped_configs():
    (shown,) = blocks(walk(), "yaml")
    subset(yaml.safe_load(shown), yaml.safe_load((REPO / "configs" / "sines.yaml").read_text()))


def test_the_factories_the_walk_names_are_the_modules():
    from hetps.examples import sines

    section = walk()
    for name in ("datasets", "cnn", "task", "warmup_cosine"):
        assert f"`{name}(" in section and callable(getattr(sines, name)), name
