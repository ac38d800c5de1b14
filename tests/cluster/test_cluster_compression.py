"""Gradient compression (`comm.compression`) in a real cluster: trained with topk,
the bytes saved reported (the compressors and the codec:
tests/inproc/test_compression.py)."""

from __future__ import annotations

from cluster_util import log_tails, run_hetps, summary


def test_cluster_trains_with_topk_and_reports_the_bytes_saved(run_dir):
    result = run_hetps(
        [
            "run",
            "configs/sync.yaml",
            "comm.compression=topk",
            "comm.topk_ratio=0.05",
            "stop.target_accuracy=0.9",
            "stop.max_steps=6000",
            "stop.max_seconds=150",
            "eval.every_s=1.0",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=240,
    )
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    s = summary(run_dir)
    assert s["time_to_target_s"] is not None and s["best_accuracy"] >= 0.9, s
    c = s["compression"]
    assert c["kind"] == "topk" and c["grad_dense_bytes"] > 0
    assert c["grad_sent_bytes"] <= 0.15 * c["grad_dense_bytes"], c  # ~5% of entries at 8 bytes each
    assert c["grad_bytes_saved"] == c["grad_dense_bytes"] - c["grad_sent_bytes"]
    assert all(v["grad_sent_bytes"] > 0 for k, v in s["per_node"].items() if k.startswith("worker"))
