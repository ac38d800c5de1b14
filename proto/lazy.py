"""Import a heavy module on first use (importlib's LazyLoader), so that a
process that never touches tensors -- the scheduler -- never pays for torch
(1.5 s of CPU, several seconds of wall time on a loaded machine), while the
modules it shares with the shards and workers still name `torch` at the top.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from types import ModuleType

_lock = threading.Lock()


def lazy_module(name: str) -> ModuleType:
    """`name` itself when already imported, else a module object that runs
    the import on its first attribute access. Raises ImportError when `name`
    is not installed (at once: only the execution is deferred)."""
    with _lock:
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            raise ImportError(f"No module named {name!r}", name=name)
        loader = importlib.util.LazyLoader(spec.loader)
        spec.loader = loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        loader.exec_module(module)
        return module
