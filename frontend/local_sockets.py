"""Where the servers of a one-host `hetps run` bind, and which shard ranks
share a process.

With comm.local_transport: ipc (the default) the scheduler and every shard
bind a unix-domain socket (`ipc://`) in RUN_DIR/sockets: no TCP stack
between processes on one host. A unix socket's path holds about 100 bytes
(108 on Linux, 104 on macOS, with the closing NUL), so when RUN_DIR is too
deep the sockets go to a fresh directory under /tmp instead, removed when
the run ends. With `tcp` every server binds a random loopback port, as a
multi-host deployment's daemons do.

cluster.shard_processes: N > 0 packs the shard ranks into N processes
(contiguous ranks, the first processes taking one more when they do not
divide evenly); each process serves its ranks on their own sockets.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hetps.runconfig.schema import RunConfig

UNIX_PATH_MAX = 100  # bytes of a unix socket's path, with room to spare below sun_path's 104-108
LONGEST_NAME = 16  # "scheduler", "ps12", "ps{rank}" and their separator fit


class LocalSockets:
    """The bind addresses of one local run. Not thread-safe; `close` removes
    a directory it made under /tmp (never RUN_DIR's own files)."""

    def __init__(self, cfg: RunConfig, run_dir: Path):
        self.folder: Path | None = None
        self.own_folder = False
        if cfg.comm.local_transport == "ipc":
            folder = (run_dir / "sockets").resolve()
            if len(str(folder)) + LONGEST_NAME > UNIX_PATH_MAX:
                folder, self.own_folder = (
                    Path(tempfile.mkdtemp(prefix="hetps-", dir=short_tmp())),
                    True,
                )
            folder.mkdir(parents=True, exist_ok=True)
            self.folder = folder

    def bind_args(self, name: str) -> tuple[str, ...]:
        """`--bind ADDRESS` for the server `name` (scheduler, ps0, or a template
        with `{rank}`), or () to keep the daemon's tcp default."""
        return () if self.folder is None else ("--bind", f"ipc://{self.folder / name}")

    def close(self) -> None:
        if self.own_folder and self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def short_tmp() -> str | None:
    """/tmp where there is one ($TMPDIR may be a long path), else the default temporary directory."""
    return "/tmp" if Path("/tmp").is_dir() else None


def shard_groups(cfg: RunConfig) -> list[list[int]]:
    """The shard ranks each shard process serves, in rank order: one rank
    each unless cluster.shard_processes packs them into fewer processes."""
    ranks = list(range(len(cfg.cluster.shards)))
    n = cfg.cluster.shard_processes or len(ranks)
    size, extra = divmod(len(ranks), n)
    groups, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        groups.append(ranks[start:end])
        start = end
    return groups


def process_name(ranks: list[int]) -> str:
    """The launcher's name of the process serving `ranks`: ps3, or ps0-2 for ranks 0, 1, 2."""
    return f"ps{ranks[0]}" if len(ranks) == 1 else f"ps{ranks[0]}-{ranks[-1]}"


def shard_process(
    ranks: list[int], sockets: LocalSockets, versions: dict[int, int] | None = None
) -> tuple[str, tuple[str, ...]]:
    """(launcher name, `hetps ps` arguments) of the process serving `ranks`:
    --rank or --ranks, its --bind, and with `versions` (each rank's checkpoint
    version, by rank: a resumed run) --resume --restore-version."""
    name = process_name(ranks)
    if len(ranks) == 1:
        args = ("--rank", str(ranks[0]), *sockets.bind_args(name))
    else:
        args = ("--ranks", ",".join(map(str, ranks)), *sockets.bind_args("ps{rank}"))
    if versions is not None:
        args += ("--resume", "--restore-version", ",".join(str(versions[r]) for r in ranks))
    return name, args
