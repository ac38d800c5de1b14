"""A full or failing checkpoint disk, for real: a 1 MiB tmpfs filled up (where
this process may mount one: root, as in CI), a checkpoint folder that turns
into a file, and a file-size limit (RLIMIT_FSIZE) in a child process (runs
anywhere). The shard keeps serving: every push is applied and acknowledged,
each failed write is counted (`checkpoint_errors`), each kind of error is
logged once, no temporary file is left behind, and checkpoints resume once
the disk has room again."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from metrics_scrape import scrape, value
from shard_harness import grads, tiny_model, values_of
from torch import nn

from hetps.proto.messages import Ack
from hetps.ps.serving import setup_checkpoints
from hetps.runtime import checkpoint
from hetps.runtime.metrics import serve_metrics, stop_metrics

A = 11
SUPPORT = Path(__file__).parents[1] / "support"


def model() -> nn.Module:
    """About 40 KB of checkpoint (weights and momentum): more than a file's
    write buffer, so a full disk fails a write inside torch.save."""
    return tiny_model(widths=(64, 64, 10), batchnorm=False)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs mounted at tmp_path/disk; the test is skipped where mounting is refused."""
    where = tmp_path / "disk"
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def fill(disk: Path, leave: int) -> Path:
    """Fill `disk` with a file, but for `leave` bytes; the file. With a few KB
    left, a checkpoint write fails part-way, where torch's zip writer turns
    the ENOSPC into `RuntimeError: ... unexpected pos`."""
    st = os.statvfs(disk)
    filler = disk / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * (st.f_bavail * st.f_frsize - leave))
    return filler


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_a_full_disk_costs_no_update_nor_answer_and_each_error_kind_is_logged_once(
    harnesses, tiny_disk, caplog
):
    m = model()
    h = harnesses(
        m,
        ["checkpoint.every_updates=2", "checkpoint.keep=2", "optimizer.momentum=0.9"],
        workers=(A,),
        algorithm="async",
    )
    shard = h.shards[0]
    setup_checkpoints(shard, str(tiny_disk), 0, None)
    folder = shard.checkpointer.folder
    h.init(values_of(m))  # its checkpoint, v0, still fits
    assert [v for v, _ in checkpoint.checkpoints(folder)] == [0]
    caplog.set_level(logging.INFO, logger="hetps.runtime.checkpoint")
    filler = fill(tiny_disk, leave=8192)

    for clock in range(6):  # checkpoints due at versions 2, 4, 6: every one fails
        (ack,) = h.push(A, clock, grads(m, clock))
        assert isinstance(ack, Ack) and ack.version == clock + 1  # applied and answered
    assert shard.stats()["checkpoint_errors"] == 3
    assert shard.checkpointer.errors == {"OSError ENOSPC": 3}
    assert leftovers(folder) == []  # each failed write's temporary file is gone
    assert [v for v, _ in checkpoint.checkpoints(folder)] == [0]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors  # once for the kind, not once per write
    assert "checkpoint v2 not written" in errors[0] and "No space left on device" in errors[0]

    # room again: the next due checkpoint is written, and the log says writes recovered
    filler.unlink()
    for clock in range(6, 8):
        h.push(A, clock, grads(m, clock))
    assert [v for v, _ in checkpoint.checkpoints(folder)] == [0, 8]
    assert checkpoint.load(checkpoint.latest(folder))["version"] == 8
    assert "checkpoint v8 written, after 3 failed writes" in caplog.text

    # another kind of failure: the checkpoint folder became a file
    os.rename(folder, tiny_disk / "moved")
    folder.write_bytes(b"")
    for clock in range(8, 12):
        (ack,) = h.push(A, clock, grads(m, clock))
        assert isinstance(ack, Ack) and ack.version == clock + 1
    assert shard.checkpointer.errors == {"OSError ENOSPC": 3, "FileExistsError EEXIST": 2}
    assert shard.stats()["checkpoint_errors"] == 5
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2 and "checkpoint v10 not written" in errors[1], errors


def test_write_errors_are_counted_on_the_metrics_endpoint_and_in_the_stats(harnesses, tmp_path):
    """The checkpoint folder turns into a file (a disk that fails differently):
    every push is answered, and `checkpoint_errors` reaches /metrics."""
    m = model()
    h = harnesses(m, ["checkpoint.every_updates=1"], workers=(A,), algorithm="async")
    shard = h.shards[0]
    setup_checkpoints(shard, str(tmp_path / "ckpt"), 0, None)
    h.init(values_of(m))
    folder = shard.checkpointer.folder
    shutil.rmtree(folder)
    folder.write_bytes(b"")
    for clock in range(3):
        (ack,) = h.push(A, clock, grads(m, clock))
        assert isinstance(ack, Ack) and ack.version == clock + 1
    assert shard.stats()["checkpoint_errors"] == 3
    url = serve_metrics(0, "127.0.0.1", "ps", 0, shard.stats)
    try:
        assert value(scrape(url), "hetps_checkpoint_errors_total", role="ps", rank="0") == 3
    finally:
        stop_metrics(url)


CHILD = textwrap.dedent(
    """
    import json, logging, resource, signal, sys
    sys.path.insert(0, sys.argv[2])
    import torch
    from shard_harness import ShardHarness, grads, tiny_model, values_of
    from hetps.ps.serving import setup_checkpoints

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    torch.set_num_threads(1)
    m = tiny_model(widths=(64, 64, 10), batchnorm=False)  # the test module's model()
    h = ShardHarness(
        m, ["checkpoint.every_updates=1", "optimizer.momentum=0.9"], (11,), 1, "async"
    )
    shard = h.shards[0]
    setup_checkpoints(shard, sys.argv[1], 0, None)
    h.init(values_of(m))  # v0 written before the limit
    # no file of this process may grow past 16 KB from here: writes fail with EFBIG
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16384, resource.RLIM_INFINITY))
    acks = [type(h.push(11, c, grads(m, c))[0]).__name__ for c in range(4)]
    folder = shard.checkpointer.folder
    print(json.dumps({
        "acks": acks,
        "version": shard.store.version,
        "checkpoint_errors": shard.stats()["checkpoint_errors"],
        "errors": shard.checkpointer.errors,
        "files": sorted(p.name for p in folder.iterdir()),
    }))
    h.close()
    """
)


def test_a_file_size_limit_fails_every_write_and_the_shard_serves_on(tmp_path):
    """RLIMIT_FSIZE (set in a child process: it binds the whole process) makes
    every checkpoint write fail with EFBIG part-way through torch.save."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "ckpt"), str(SUPPORT)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["acks"] == ["Ack"] * 4 and result["version"] == 4
    assert result["checkpoint_errors"] == 4 and result["errors"] == {"OSError EFBIG": 4}
    assert result["files"] == ["v000000000000.pt"]  # no temporary file left
    logged = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
    assert len(logged) == 1 and "File too large" in logged[0], done.stderr[-3000:]
