"""`hetps compare`: the table arithmetic (medians, speedups, repeats that
missed the target) and the arguments refused before any run (a real comparison:
tests/cluster/test_cluster_compare.py)."""

from __future__ import annotations

import pytest
from cluster_util import REPO

from hetps.frontend.compare import aggregate, markdown


def fake_summary(ttt, acc, steps=100, sent=1_000_000, versions=None, rounds=None) -> dict:
    s = {
        "time_to_target_s": ttt,
        "final_accuracy": acc,
        "bytes_sent": sent,
        "bytes_received": sent,
        "shard_versions": versions or {"ps0": 50, "ps1": 50},
        "global_steps": steps,
        "run_dir": "x",
    }
    if rounds is not None:
        s["communication_rounds"] = rounds
    return s


def test_aggregate_takes_medians_and_counts_repeats_that_reached_the_target():
    row = aggregate(
        "sync", [fake_summary(4.0, 0.95), fake_summary(2.0, 0.97), fake_summary(3.0, 0.96)]
    )
    assert row["time_to_target_s"] == 3.0 and row["final_accuracy"] == 0.96
    assert row["reached"] == 3 and row["repeats"] == 3
    assert row["bytes"] == 2_000_000 and row["rounds"] == 50
    missed = aggregate("async", [fake_summary(1.0, 0.95), fake_summary(None, 0.80)])
    assert missed["time_to_target_s"] is None and missed["reached"] == 1  # no median over a miss
    assert aggregate("cpsgd", [fake_summary(1.0, 0.9, rounds=7)])["rounds"] == 7


def test_markdown_has_one_row_per_algorithm_with_speedup_over_the_first():
    rows = [
        aggregate("sync", [fake_summary(4.0, 0.95)]),
        aggregate("async", [fake_summary(2.0, 0.96)]),
        aggregate("ssp", [fake_summary(None, 0.90)]),
    ]
    lines = markdown(rows, "configs/sync.yaml").splitlines()
    table = [line for line in lines if line.startswith("| ") and not line.startswith("| algorithm")]
    assert [line.split(" | ")[0] for line in table] == ["| sync", "| async", "| ssp"]
    assert "| 1.00x |" in table[0] and "| 2.00x |" in table[1]
    assert "| - | - |" in table[2] and "| 0/1 |" in table[2]


@pytest.mark.parametrize(
    "args, named",
    [
        (
            ["--algorithms", "sync,async", "--with", "asnyc", "optimizer.lr=0.01"],
            "--with asnyc: not an entry",
        ),
        (["--algorithms", "sync", "--repeats", "0"], "--repeats: must be >= 1"),
        (["--algorithms", ","], "--algorithms: name at least one"),
        (["--algorithms", "sync,sync"], "names an entry twice"),
        (["--algorithms", "sync", "seed=abc"], "config error: seed"),
    ],
)
def test_bad_compare_arguments_exit_2_before_any_run(tmp_path, capsys, args, named):
    from hetps.frontend.compare import compare_command

    out = tmp_path / "cmp"
    assert compare_command([str(REPO / "configs" / "sync.yaml"), *args, "--out", str(out)]) == 2
    assert named in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("text", [b"[]\n", b"0\n", b"name: caf\xe9\n"])
def test_a_config_file_that_is_no_mapping_or_not_utf8_names_the_file(tmp_path, text):
    from hetps.runconfig.load import load_config
    from hetps.runconfig.schema import ConfigError

    path = tmp_path / "bad.yaml"
    path.write_bytes(text)
    with pytest.raises(ConfigError) as bad:
        load_config(path)
    assert "must hold a mapping" in str(
        bad.value
    ) or f"{path}: cannot read (not UTF-8 text)" in str(bad.value)
