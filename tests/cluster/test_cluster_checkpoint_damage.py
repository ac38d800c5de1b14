"""A damaged checkpoint through real processes: a stopped run's newest
checkpoint of one shard has a few bytes of tensor data overwritten (its zip
still well-formed, so torch.load alone would serve the damaged values);
`hetps run --resume` passes over it for every shard alike, the run trains on
from the newest version both shards have valid, and the summary names the
damaged file."""

from __future__ import annotations

import pytest
import torch
from cluster_util import log_tails, run_hetps, summary

from hetps.runtime import checkpoint

pytestmark = pytest.mark.cluster


def overwrite_tensor_bytes(path) -> None:
    """64 bytes of the file's largest tensor become 16 float32 1e4s; nothing else changes."""
    tensors = checkpoint.load(path)["tensors"]
    largest = max(tensors.values(), key=lambda t: t.numel())
    data = bytearray(path.read_bytes())
    at = data.find(largest.contiguous().numpy().tobytes())
    assert at >= 0, "the tensor's bytes are not in the file"
    data[at : at + 64] = torch.full((16,), 1e4).numpy().tobytes()
    path.write_bytes(bytes(data))


def test_resume_passes_over_a_damaged_newest_checkpoint_and_the_summary_names_it(run_dir):
    first = run_hetps(
        [
            "run",
            "configs/sync.yaml",
            "--out",
            str(run_dir),
            "--quiet",
            "checkpoint.every_updates=20",
            "checkpoint.every_s=0",  # by count only: both shards write the same versions
            "checkpoint.keep=3",
            "stop.target_accuracy=null",
            "stop.max_steps=200",
            "stop.max_seconds=120",
        ],
        timeout_s=200,
    )
    assert first.returncode == 0, first.stderr + log_tails(run_dir)
    folders = {rank: next(run_dir.glob(f"checkpoints/*/ps{rank}")) for rank in (0, 1)}  # one run id
    versions = {rank: [v for v, _ in checkpoint.checkpoints(f)] for rank, f in folders.items()}
    assert versions[0] == versions[1] and len(versions[0]) == 3, versions  # e.g. 20, 40, 50
    older, newest = versions[0][-2], versions[0][-1]
    damaged = checkpoint.latest(folders[1], newest)
    overwrite_tensor_bytes(damaged)

    resumed = run_hetps(
        # max_steps counts the whole run: 100 more steps
        ["run", "--resume", str(run_dir), "stop.max_steps=300", "stop.target_accuracy=null"],
        timeout_s=200,
    )
    assert resumed.returncode == 0, resumed.stderr + log_tails(run_dir)
    s = summary(run_dir)
    for name in ("ps0", "ps1"):  # both went back to the newest version valid on both
        assert s["shard_stats"][name]["restored_version"] == older, s["shard_stats"][name]
        assert s["shard_versions"][name] > older  # and trained on from it
    (entry,) = [f for f in s["failures"] if f["kind"] == "checkpoint_damaged"]
    assert (entry["node"], entry["file"]) == ("ps1", str(damaged)), entry
    assert "checksum mismatch" in entry["error"] and entry["restored_version"] == older
    # trained on from good values (served 1e4s diverge, or stay near chance: 0.1)
    assert s["status"] == "completed" and s["final_accuracy"] >= 0.5, s
    ps1_log = (run_dir / "logs" / "ps1.log").read_text()
    assert f"checkpoint {damaged} is damaged: checksum mismatch" in ps1_log
    # kept for a look under another name, never restored again
    assert damaged.with_name(damaged.name + ".damaged").exists()
