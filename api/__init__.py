"""hetps from Python: build a configuration, run a local cluster, load the trained model.

    import hetps

    cfg = hetps.config("configs/charlm.yaml", algorithm="grouping", stop__max_seconds=60)
    result = hetps.run(cfg, on_eval=lambda row: print(row["t"], row[row["watch"]]))
    print(result.status, result.metrics, result.time_to_target_s)
    model = hetps.load_model(result.run_dir)

`config` (hetps.make_config) builds a checked RunConfig from a YAML file, a dict or
another config, with changes; `run` (hetps.running) runs it exactly as
`hetps run` does and returns a `Result`, raising `RunFailed` naming the cause
when the run could not start or a process failed; `load_model`
(hetps.models) gives back the trained torch module; a bad config raises
`ConfigError` listing every problem. `Task` and `Metric` are
the task contract (hetps.training.task) for a task of your own.

Every daemon imports this package (it is the parent of hetps.worker, ...):
the names above are imported on first use, so that `import hetps.proto`
costs nothing more. Type checkers and IDEs read them from the imports under
`TYPE_CHECKING` below (never run), which name the same objects as `_EXPORTS`;
the package ships `py.typed` (PEP 561), so mypy checks a call of `hetps.run`
against its signature.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetps.make_config import config
    from hetps.models import load_model
    from hetps.proto.errors import ConfigError
    from hetps.running import Result, RunFailed, load_result, run
    from hetps.training.task import Metric, Task

# public name -> the module that defines it
_EXPORTS = {
    "config": "hetps.make_config",
    "run": "hetps.running",
    "Result": "hetps.running",
    "RunFailed": "hetps.running",
    "load_result": "hetps.running",
    "load_model": "hetps.models",
    "ConfigError": "hetps.proto.errors",
    "Task": "hetps.training.task",
    "Metric": "hetps.training.task",
}
# spelled out (not list(_EXPORTS)): type checkers read a literal __all__ as the public names
__all__ = [
    "config",
    "run",
    "Result",
    "RunFailed",
    "load_result",
    "load_model",
    "ConfigError",
    "Task",
    "Metric",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hetps' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
