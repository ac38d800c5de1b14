"""A hetps entry point called in the test process as its command would run it: from a folder,
with an import path of the caller's choosing, its output captured; afterwards the directory, the
import path, the environment and the modules imported from outside the repository and the
standard library (the user's) are as before, so the next call imports them anew. For tests whose
point is what the command does, not the process (one test keeps the console script for that)."""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from cluster_util import REPO


def run_entry_point(
    main: Callable[[list[str]], int | None],
    args: list[str],
    cwd: Path,
    import_path: list[str],
    drop_env: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """`hetps ARGS` as `main(ARGS)` from `cwd` with `sys.path` set to `import_path` and the
    variables `drop_env` unset; SystemExit (argparse, a config error) is its exit code."""
    before, path, env, modules = os.getcwd(), list(sys.path), dict(os.environ), set(sys.modules)
    # files, not StringIO: a worker registers its stack dump on SIGUSR1 with stderr's fd
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    try:
        os.chdir(cwd)
        for name in drop_env:
            os.environ.pop(name, None)
        sys.path[:] = import_path
        importlib.invalidate_caches()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(["hetps", *args], code, out.read(), err.read())
    finally:
        out.close(), err.close()
        os.chdir(before)
        sys.path[:] = path
        os.environ.clear()
        os.environ.update(env)
        for name in set(sys.modules) - modules:
            file = getattr(sys.modules[name], "__file__", None) or ""
            if not file.startswith((str(REPO), sys.base_prefix)):
                del sys.modules[name]
