"""Damaged shard checkpoints, in one process: a file cut short or with a few
bytes of tensor data changed is refused naming it (torch.load itself checks
no checksum), a starting shard falls back to its newest valid checkpoint and
reports the damaged one (shard log, stats, the scheduler's `failures`), and
with none valid it refuses to start naming the folder; `hetps run --resume`
and `hetps export` pass over damaged files consistently."""

from __future__ import annotations

import json
import logging
import threading
import zipfile

import pytest
import torch
from shard_harness import A, B, grads, tiny_model, values_of
from torch import nn

from hetps.proto.codec import Envelope
from hetps.proto.messages import Heartbeat, Register
from hetps.proto.plan import TensorSpec
from hetps.proto.records import NodeStats
from hetps.proto.transport import MemServer
from hetps.ps.serving import setup_checkpoints
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ConfigError
from hetps.runtime import checkpoint
from hetps.runtime.membership import Membership
from hetps.scheduler.coordinator import Coordinator

MOMENTUM = "optimizer.momentum=0.9"  # a momentum buffer in every checkpoint
BIG = 1e4  # what the overwritten bytes decode to: the "values near 1e4" of a served damaged file


def model() -> nn.Module:
    """A model whose "0.weight" holds the 16 floats `overwrite_tensor_bytes` replaces."""
    return tiny_model(widths=(16, 8, 2), batchnorm=False)


def trained_with_checkpoints(harnesses, root, rounds: int = 4):
    """A shard that wrote a checkpoint after INIT and after each of `rounds`
    sync rounds (keep=10): versions 0..rounds in its folder."""
    m = model()
    h = harnesses(
        m, [MOMENTUM, f"checkpoint.dir={root}", "checkpoint.every_updates=1", "checkpoint.keep=10"]
    )
    setup_checkpoints(h.shards[0], str(root), 0, None)
    h.init(values_of(m))
    for clock in range(rounds):
        for node in (A, B):
            h.push(node, clock, grads(m, 10 * clock + node))
    folder = checkpoint.shard_dir(root, h.plan.run_id, 0)
    assert [v for v, _ in checkpoint.checkpoints(folder)] == list(range(rounds + 1))
    return m, h, folder


def truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def overwrite_tensor_bytes(path, tensor: torch.Tensor) -> None:
    """64 bytes of `tensor`'s data in the file become 16 float32 1e4s; the zip's
    structure is untouched (only its CRCs, which torch.load does not check, differ)."""
    data = bytearray(path.read_bytes())
    at = data.find(tensor.detach().contiguous().numpy().tobytes())
    assert at >= 0, "the tensor's bytes are not in the file"
    data[at : at + 64] = torch.full((16,), BIG).numpy().tobytes()
    path.write_bytes(bytes(data))


def zip_part(path) -> zipfile.ZipFile:
    """The torch zip inside a checkpoint (after hetps' header, if the file has one)."""
    import io

    data = path.read_bytes()
    return zipfile.ZipFile(io.BytesIO(data[data.find(b"PK\x03\x04") :]))


# ---------------------------------------------------------------- the integrity check


def test_a_checkpoint_cut_short_is_refused_naming_the_file(harnesses, tmp_path):
    _, _, folder = trained_with_checkpoints(harnesses, tmp_path / "ckpt", rounds=1)
    newest = checkpoint.latest(folder)
    truncate(newest)
    with pytest.raises(checkpoint.CheckpointDamaged, match="cut short") as info:
        checkpoint.load(newest)
    assert str(newest) in str(info.value) and info.value.path == newest
    with pytest.raises(checkpoint.CheckpointDamaged, match="cut short"):
        checkpoint.verify(newest)  # the same verdict without torch
    newest.write_bytes(newest.read_bytes()[:20])  # cut within the header
    with pytest.raises(checkpoint.CheckpointDamaged, match="cut short: 20 bytes"):
        checkpoint.load(newest)


def test_a_few_changed_bytes_of_tensor_data_are_refused_though_the_zip_is_well_formed(
    harnesses, tmp_path
):
    m, h, folder = trained_with_checkpoints(harnesses, tmp_path / "ckpt", rounds=1)
    newest = checkpoint.latest(folder)
    weight = h.shards[0].store.tensors["0.weight"]
    overwrite_tensor_bytes(newest, weight)
    assert "data/0" in " ".join(zip_part(newest).namelist())  # still a readable zip
    with pytest.raises(checkpoint.CheckpointDamaged, match="checksum mismatch") as info:
        checkpoint.load(newest)
    assert info.value.path == newest
    assert checkpoint.damage(newest) is not None
    assert checkpoint.damage(checkpoint.latest(folder, 0)) is None  # the older one is intact


def test_a_checkpoint_without_the_checksum_header_is_refused_clearly(tmp_path):
    """Format 2 and older were bare torch files: nothing to verify them by."""
    path = tmp_path / "v000000000001.pt"
    torch.save({"format": 2, "version": 1}, path)
    with pytest.raises(checkpoint.CheckpointDamaged, match="bare torch file, without the checksum"):
        checkpoint.load(path)
    path.write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointDamaged, match="empty"):
        checkpoint.verify(path)


# ---------------------------------------------------------------- a starting shard


def test_a_starting_shard_falls_back_to_its_newest_valid_checkpoint_and_reports_the_damaged(
    harnesses, tmp_path, caplog
):
    root = tmp_path / "ckpt"
    m, h, folder = trained_with_checkpoints(harnesses, root, rounds=4)
    v4, v3 = checkpoint.latest(folder, 4), checkpoint.latest(folder, 3)
    truncate(v4)
    overwrite_tensor_bytes(v3, checkpoint.load(v3)["tensors"]["0.weight"])
    expected = checkpoint.load(checkpoint.latest(folder, 2))["tensors"]

    # the shard's process, started again
    twin = harnesses(m, [MOMENTUM, f"checkpoint.dir={root}", "checkpoint.every_updates=1"])
    caplog.set_level(logging.INFO, logger="hetps.ps")
    setup_checkpoints(twin.shards[0], str(root), 0, None)
    shard = twin.shards[0]
    assert shard.store.version == 2 and shard.restored_version == 2
    for name, value in expected.items():
        assert torch.equal(shard.store.tensors[name], value), name  # not the 1e4s of v3
    damaged = shard.stats()["checkpoints_damaged"]
    assert [d["file"] for d in damaged] == [str(v4), str(v3)]
    assert "cut short" in damaged[0]["error"] and "checksum mismatch" in damaged[1]["error"]
    assert {d["restored_version"] for d in damaged} == {2}
    # set aside for a look, never to be tried again; the timeline goes on from v2
    assert sorted(p.name for p in folder.iterdir()) == [
        "v000000000000.pt",
        "v000000000001.pt",
        "v000000000002.pt",
        "v000000000003.pt.damaged",
        "v000000000004.pt.damaged",
    ]
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(str(v4) in line and "cut short" in line for line in logged), logged
    assert any(str(v3) in line and "checksum mismatch" in line for line in logged), logged
    assert "restored v000000000002.pt" in caplog.text
    # and it serves on from there: the next round is applied and checkpointed
    for node in (A, B):
        twin.push(node, 2, grads(m, 99 + node))
    assert shard.store.version == 3 and checkpoint.damage(checkpoint.latest(folder, 3)) is None


def test_with_no_valid_checkpoint_the_shard_refuses_to_start_naming_the_folder(harnesses, tmp_path):
    root = tmp_path / "ckpt"
    m, h, folder = trained_with_checkpoints(harnesses, root, rounds=1)
    for _, path in checkpoint.checkpoints(folder):
        truncate(path)
    before = sorted(p.name for p in folder.iterdir())
    twin = harnesses(m, [MOMENTUM, f"checkpoint.dir={root}"])
    with pytest.raises(checkpoint.NoValidCheckpoint) as info:
        setup_checkpoints(twin.shards[0], str(root), 0, None)
    message = str(info.value)
    assert f"no valid checkpoint in {folder}" in message and "\n" not in message
    assert "v000000000001.pt: cut short" in message and "v000000000000.pt: cut short" in message
    assert twin.shards[0].store.version == 0 and twin.shards[0].policy is None  # nothing served
    # nothing renamed: a later start must not find an empty folder and begin from scratch
    assert sorted(p.name for p in folder.iterdir()) == before


def test_restoring_a_given_version_names_damaged_newer_ones_and_refuses_a_damaged_one(
    harnesses, tmp_path
):
    """`hetps run --resume` restores the version it chose (--restore-version)."""
    root = tmp_path / "ckpt"
    m, h, folder = trained_with_checkpoints(harnesses, root, rounds=3)
    truncate(checkpoint.latest(folder, 3))
    twin = harnesses(m, [MOMENTUM, f"checkpoint.dir={root}"])
    setup_checkpoints(twin.shards[0], str(root), 0, 1, resume=True)
    assert twin.shards[0].store.version == 1
    assert [d["file"] for d in twin.shards[0].stats()["checkpoints_damaged"]] == [
        str(folder / "v000000000003.pt")
    ]
    assert sorted(p.name for p in folder.iterdir())[-2:] == [
        "v000000000002.pt.abandoned",
        "v000000000003.pt.damaged",
    ]
    truncate(checkpoint.latest(folder, 1))
    third = harnesses(m, [MOMENTUM, f"checkpoint.dir={root}"])
    with pytest.raises(checkpoint.CheckpointDamaged, match="v000000000001.pt is damaged"):
        setup_checkpoints(third.shards[0], str(root), 0, 1, resume=True)


# ---------------------------------------------------------------- what the scheduler makes of it

SPECS = [TensorSpec("w", "float32", (2, 3))]


def test_the_scheduler_records_each_damaged_checkpoint_once_in_the_failures(tmp_path):
    cfg = load_config(None, ["cluster.workers=1", "cluster.shards=1"])
    server = MemServer("mem://coordinator-damaged-checkpoint")
    try:
        coord = Coordinator(server, cfg, run_dir=tmp_path)
        ps = coord.on_register(
            b"p", Envelope(Register(role="ps", rank=0, address="mem://ps0"), 1, 0)
        ).node_id
        worker = coord.on_register(
            b"w", Envelope(Register(role="worker", rank=0, tensor_specs=SPECS), 2, 0)
        ).node_id
        damaged = {"file": "/c/run/ps0/v000000000040.pt", "error": "cut short: 10 of its 99 bytes"}
        stats = NodeStats.read(
            {"version": 21, "checkpoints_damaged": [{**damaged, "restored_version": 20}]}
        )
        for req in (3, 4):  # every heartbeat repeats it: one entry
            coord.on_heartbeat(b"p", Envelope(Heartbeat(node_id=ps, stats=stats), req, ps))
        (entry,) = [f for f in coord.failures if f.kind == "checkpoint_damaged"]
        assert (entry.node, entry.file, entry.error, entry.restored_version) == (
            "ps0",
            damaged["file"],
            damaged["error"],
            20,
        )
        trained = NodeStats.read({"steps": 5})  # a run that trained nothing would have failed
        coord.on_heartbeat(b"w", Envelope(Heartbeat(node_id=worker, stats=trained), 5, worker))
        coord.begin_stop("test over")
        coord.close()
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["status"] == "completed"  # the run went on: a report, not a failed run
        assert [f["file"] for f in summary["failures"] if f["kind"] == "checkpoint_damaged"] == [
            damaged["file"]
        ]
    finally:
        server.close()


def test_a_shard_without_a_valid_checkpoint_fails_the_run_naming_the_folder(harnesses, tmp_path):
    """The refusal reaches the scheduler as a start-up failure: the run fails
    and summary.json names the shard and the folder."""
    root = tmp_path / "ckpt"
    m, h, folder = trained_with_checkpoints(harnesses, root, rounds=1)
    for _, path in checkpoint.checkpoints(folder):
        truncate(path)
    cfg = load_config(None, ["cluster.workers=1", "cluster.shards=1"])
    server = MemServer("mem://coordinator-no-valid-checkpoint")
    member = Membership("mem://coordinator-no-valid-checkpoint", "ps", 0, cfg.cluster)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    try:
        coord = Coordinator(server, cfg, run_dir=run_dir)
        done = threading.Event()
        loop = threading.Thread(
            target=lambda: [coord.serve_once(0.02) for _ in iter(done.is_set, True)]
        )
        loop.start()  # the scheduler's loop, as in its daemon
        twin = harnesses(m, [MOMENTUM, f"checkpoint.dir={root}"])
        try:
            with pytest.raises(SystemExit) as exit_info:
                with member.starting():  # as ps/serving.py wraps it
                    setup_checkpoints(twin.shards[0], str(root), 0, None)
        finally:
            done.set()
            loop.join(timeout=10)
        assert exit_info.value.code == 1
        coord.close()
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "failed" and summary["failed_node"] == "ps0"
        assert f"NoValidCheckpoint: no valid checkpoint in {folder}" in summary["detail"]
    finally:
        member.close()
        server.close()


# ---------------------------------------------------------------- resume and export


def write_run(tmp_path, versions: dict[int, list[int]]):
    """A stopped run's directory with real checkpoints of shard ranks -> versions."""
    from hetps.scheduler import state

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / state.STATE_FILE).write_text('{"run_id": "abc", "finished": true}')
    folders = {}
    for rank, vs in versions.items():
        folders[rank] = checkpoint.shard_dir(run_dir / "checkpoints", "abc", rank)
        for v in vs:
            checkpoint.write_atomic(
                folders[rank] / f"v{v:012d}.pt",
                {
                    "format": checkpoint.FORMAT,
                    "version": v,
                    "tensors": {f"t{rank}": torch.ones(3) * v},
                },
            )
    return run_dir, folders


def test_resume_passes_over_damaged_checkpoints_to_a_version_every_shard_has_valid(tmp_path):
    from hetps.frontend.resume import resume_point

    run_dir, folders = write_run(tmp_path, {0: [10, 20, 30], 1: [10, 20, 30]})
    assert resume_point(run_dir, 2).versions == {0: 30, 1: 30}
    truncate(folders[1] / f"v{30:012d}.pt")
    point = resume_point(run_dir, 2)
    assert point.versions == {0: 20, 1: 20} and point.consistent  # ps0 goes back with ps1
    assert [d.path.name for d in point.damaged] == ["v000000000030.pt"]
    truncate(folders[0] / f"v{20:012d}.pt")
    assert resume_point(run_dir, 2).versions == {0: 10, 1: 10}
    for v in (10, 20):
        truncate(folders[1] / f"v{v:012d}.pt")
    with pytest.raises(ConfigError, match=f"no valid checkpoint in {folders[1]}"):
        resume_point(run_dir, 2)


def test_resume_without_a_common_valid_version_takes_each_shards_newest_valid(tmp_path):
    from hetps.frontend.resume import resume_point

    run_dir, folders = write_run(tmp_path, {0: [10, 30], 1: [10, 25]})
    truncate(folders[0] / f"v{10:012d}.pt")
    point = resume_point(run_dir, 2)
    assert point.versions == {0: 30, 1: 25} and not point.consistent


def test_export_reads_each_shards_newest_valid_checkpoint(tmp_path):
    """The result is the newest model the shards can give together, as an evaluator's pull is:
    not the newest version they share (every shard shares version 0, the initial model)."""
    from hetps.training.export import newest_tensors

    run_dir, folders = write_run(tmp_path, {0: [0, 10, 20], 1: [0, 10, 25]})
    overwrite_tensor_bytes(folders[0] / f"v{20:012d}.pt", torch.ones(3) * 20)
    tensors, versions = newest_tensors([folders[0], folders[1]])
    assert versions == {"ps0": 10, "ps1": 25}  # ps0's damaged v20 passed over
    assert torch.equal(tensors["t0"], torch.ones(3) * 10)
    assert torch.equal(tensors["t1"], torch.ones(3) * 25)
    # a shard killed before its first periodic checkpoint: the others' newest all the same
    (tmp_path / "killed").mkdir()
    run_dir, folders = write_run(tmp_path / "killed", {0: [0], 1: [0, 693]})
    assert newest_tensors([folders[0], folders[1]])[1] == {"ps0": 0, "ps1": 693}


def test_export_refuses_checkpoints_that_hold_only_the_initial_model(tmp_path):
    import shutil
    from pathlib import Path

    from hetps.training.export import InitialModelOnly, export, main

    run_dir, _ = write_run(tmp_path, {0: [0], 1: [0]})
    config = run_dir / "config.yaml"
    shutil.copy(Path(__file__).parents[2] / "configs" / "default.yaml", config)
    out = tmp_path / "out" / "model.safetensors"
    with pytest.raises(InitialModelOnly, match="only the initial model"):
        export(run_dir, out)
    assert not out.exists()
    assert main([str(run_dir), "--out", str(out)]) == 2  # `hetps export`: one line, exit 2
    assert not out.exists()
