"""`hetps compare` for real: a comparison of two algorithms writing its three
files, one row per algorithm (the table arithmetic: tests/unit/test_compare.py)."""

from __future__ import annotations

import json

from cluster_util import log_tails, run_hetps, summary


def test_compare_writes_its_three_files_with_one_row_per_algorithm(run_dir):
    out = run_dir  # the fixture kills anything left mentioning it
    result = run_hetps(
        [
            "compare",
            "configs/sync.yaml",
            "--algorithms",
            "sync,async",
            "--repeats",
            "1",
            # as configs/async.yaml:
            "--out",
            str(out),
            "--with",
            "async",
            "optimizer.momentum=0.5",
            # sync's momentum 0.9 at sync's lr can diverge async
            "cluster.workers=2",
            "stop.target_accuracy=0.8",
            "stop.max_seconds=60",
            "eval.every_s=0.5",
        ],
        timeout_s=300,
    )
    assert result.returncode == 0, (
        result.stderr[-3000:] + log_tails(out / "sync-0") + log_tails(out / "async-0")
    )
    assert (
        "hetps compare: sync run 1/1" in result.stderr
        and "hetps compare: async run 1/1" in result.stderr
    )
    rows = json.loads((out / "compare.json").read_text())
    assert [r["algorithm"] for r in rows] == ["sync", "async"]
    for r in rows:
        s = summary(out / f"{r['algorithm']}-0")
        assert s["algorithm"] == r["algorithm"]
        assert r["final_accuracy"] == s["final_accuracy"] and r["reached"] == 1
        assert r["time_to_target_s"] == s["time_to_target_s"] is not None
        assert r["bytes"] == s["bytes_sent"] + s["bytes_received"] > 0
    table = [
        line
        for line in (out / "compare.md").read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| algorithm")
    ]
    assert [line.split(" | ")[0] for line in table] == ["| sync", "| async"]
    png = (out / "compare.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
