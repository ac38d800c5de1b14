"""Where the commands find a user's own modules: `model.name: mytask:Net` in a config
with mytask.py beside it imports with no PYTHONPATH to set.

`hetps config/run/compare/simulate CONFIG` and the daemons (`hetps worker --config CONFIG`,
runtime/daemon.py `load_or_exit`) put the config file's folder and the current
directory first on sys.path (as `python script.py` puts the script's folder) and on
PYTHONPATH, so that every process the command starts imports the module as the command
did: the forked daemons take the command's sys.path, those started by exec (the scheduler,
`HETPS_SPAWN=exec`, the model export) its environment. `hetps.run` does the same for the
modules its factories came from (api/running.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def user_roots(config: str | Path | None) -> list[str]:
    """The folders a command imports the user's modules from: the config file's, then the
    current directory's (absolute, without repeats)."""
    roots = [Path(config).expanduser().absolute().parent] if config else []
    roots.append(Path.cwd())
    return list(dict.fromkeys(str(r) for r in roots))


def with_pythonpath(env: dict[str, str], roots: list[str]) -> dict[str, str]:
    """`env` with `roots` first on PYTHONPATH (those not on it already)."""
    have = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    add = [r for r in roots if r not in have]
    return {**env, "PYTHONPATH": os.pathsep.join(add + have)} if add else dict(env)


def import_beside(config: str | Path | None) -> None:
    """For the rest of this process and the processes it starts: `user_roots(config)` first
    on sys.path and on PYTHONPATH."""
    roots = user_roots(config)
    sys.path[:0] = [r for r in roots if r not in sys.path]
    os.environ.update(with_pythonpath(dict(os.environ), roots))
