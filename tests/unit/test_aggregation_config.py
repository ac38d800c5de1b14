"""comm.aggregate's settings: which runs reduce inside their groups (auto: groups of
comm.aggregate_min_group or more; on: every group of two or more; off: none), and the
config errors that name the key when it cannot apply."""

from __future__ import annotations

import pytest

from hetps.runconfig.algorithms import aggregation_off_because, min_aggregated_group
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ConfigError


def cfg(*overrides: str):
    return load_config(None, list(overrides))


@pytest.mark.parametrize("name", ["sync", "balanced", "grouping"])
def test_synchronous_groups_reduce_from_auto_s_smallest_group_and_on_from_two(name):
    assert min_aggregated_group(cfg(f"algorithm.name={name}")) == 8
    assert min_aggregated_group(cfg(f"algorithm.name={name}", "comm.aggregate_min_group=3")) == 3
    assert min_aggregated_group(cfg(f"algorithm.name={name}", "comm.aggregate=on")) == 2
    assert min_aggregated_group(cfg(f"algorithm.name={name}", "comm.aggregate=off")) == 0


@pytest.mark.parametrize("name", ["async", "ssp", "eager", "cpsgd", "diloco"])
def test_algorithms_without_rounds_of_whole_groups_never_reduce(name):
    assert min_aggregated_group(cfg(f"algorithm.name={name}")) == 0
    assert "has no rounds of whole groups" in aggregation_off_because(cfg(f"algorithm.name={name}"))


def test_yaml_s_bare_on_and_off_are_the_settings_not_booleans(tmp_path):
    path = tmp_path / "c.yaml"
    for text, want in (("on", "on"), ("off", "off"), ("auto", "auto")):
        path.write_text(f"comm:\n  aggregate: {text}\n")
        assert load_config(str(path)).comm.aggregate == want


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.name=async", "comm.aggregate=on"], "comm.aggregate: on needs"),
        (["comm.overlap=true", "comm.aggregate=on"], "comm.overlap: true pushes each layer"),
        (
            ["security.curve=true", "comm.aggregate=on"],
            "comm.collective_trusted: false (gloo is not CurveZMQ)",
        ),
        (["comm.aggregate=maybe"], "comm.aggregate"),
        (["comm.aggregate_min_group=1"], "comm.aggregate_min_group: must be >= 2"),
        (["comm.collective_timeout_s=0"], "comm.collective_timeout_s: must be > 0"),
        (["comm.collective_port=70000"], "comm.collective_port: must be 0-65535"),
    ],
)
def test_a_setting_that_cannot_apply_is_a_config_error_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg(*overrides)


def test_curve_turns_auto_off_unless_the_collective_network_is_trusted():
    assert "gloo is not CurveZMQ" in aggregation_off_because(cfg("security.curve=true"))
    assert min_aggregated_group(cfg("security.curve=true")) == 0
    trusted = cfg("security.curve=true", "comm.collective_trusted=true", "comm.aggregate=on")
    assert aggregation_off_because(trusted) == "" and min_aggregated_group(trusted) == 2
