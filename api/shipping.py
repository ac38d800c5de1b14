"""Python objects handed to `hetps.run` (a task, a model or dataset factory) as the names
the config gives every process: each daemon is its own process and builds them again.

A class or function is named by reference (`module:name`): the daemons import it. A task
object (an instance) is pickled into the run directory and `task.name` names `unpickled`
below, which each daemon calls with the file's path; its class is imported by reference
too. What is defined in `__main__` (the script or notebook that calls `hetps.run`) cannot be
imported by another process: it is refused, naming the fix (move it into a module).
"""

from __future__ import annotations

import pickle
import pickletools
import sys
from pathlib import Path
from typing import Any

from hetps.proto.errors import ConfigError
from hetps.runconfig.factories import FactoryError, load_factory

TASK_FILE = "task.pkl"


def move_it(what: str, name: str) -> str:
    return (
        f"hetps.run: {what} {name} is defined in __main__ (this script or notebook), which the "
        f"worker processes cannot import: move it into a module of its own (a .py file beside "
        f"the script) and import it from there, or name it as 'package.module:factory'"
    )


def reference(obj: Any, what: str) -> str:
    """`module:name` for a class or function importable by that name in another process.
    Raises ConfigError naming why it is not (defined in __main__, in a function, nested)."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if not isinstance(qualname, str) or not isinstance(module, str):
        raise ConfigError(
            f"hetps.run: {what} {obj!r} has no importable name: pass a class or a function "
            "defined at the top level of a module, or 'package.module:factory'"
        )
    if module == "__main__":
        raise ConfigError(move_it(what, qualname))
    if "." in qualname:  # `f.<locals>.g`, `Outer.Inner`, `<lambda>` inside anything
        raise ConfigError(
            f"hetps.run: {what} {module}.{qualname} is not at the top level of its module; "
            "define it there so that the worker processes can import it"
        )
    try:
        found = load_factory(f"{module}:{qualname}", what)
    except FactoryError as exc:
        raise ConfigError(
            f"hetps.run: {what} {module}:{qualname} cannot be imported ({exc.reason})"
        ) from None
    if found is not obj:
        raise ConfigError(
            f"hetps.run: {what} {module}:{qualname} names another object than the one passed "
            "(redefined after import?)"
        )
    return f"{module}:{qualname}"


def as_name(obj: Any, what: str) -> str:
    """A config name for `obj`: a string as it is, a class or function by reference."""
    return obj if isinstance(obj, str) else reference(obj, what)


def task_setting(task: Any, run_dir: Path) -> dict:
    """The config's `task` section for `task`: a name, a factory (class or function,
    by reference) or a task object (pickled to RUN_DIR/task.pkl). Raises ConfigError."""
    if isinstance(task, str) or isinstance(task, type) or callable(task) and not _is_task(task):
        return {"name": as_name(task, "the task"), "kwargs": {}}
    cls = type(task)
    if cls.__module__ == "__main__":
        raise ConfigError(move_it("the task's class", cls.__qualname__))
    try:
        data = pickle.dumps(task)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"hetps.run: the task object ({cls.__qualname__}) cannot be pickled for the worker "
            f"processes ({exc}); pass its factory instead (a class or function at the top level "
            "of a module, or 'package.module:factory' with task.kwargs)"
        ) from None
    if names := main_references(data):
        raise ConfigError(move_it("what the task object holds:", ", ".join(names)))
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / TASK_FILE
    path.write_bytes(data)
    return {"name": f"{__name__}:unpickled", "kwargs": {"path": str(path.absolute())}}


def _is_task(obj: Any) -> bool:
    """A task object rather than a factory: it has a `loss` (a factory is called to make one)."""
    return callable(getattr(obj, "loss", None))


def main_references(data: bytes) -> list[str]:
    """The names in `__main__` a pickle refers to (another process cannot load them)."""
    names: list[str] = []
    memo: dict[int, Any] = {}
    pushed: list[Any] = []  # what each op pushed: a string, or None for anything else
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL" and str(arg).startswith("__main__ "):
            names.append(str(arg).split(" ", 1)[1])
        elif op.name == "STACK_GLOBAL" and len(pushed) >= 2 and pushed[-2] == "__main__":
            names.append(str(pushed[-1]))
        if op.name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = pushed[-1] if pushed else None
        elif op.name in ("GET", "BINGET", "LONG_BINGET"):
            pushed.append(memo.get(arg))  # a string used before: the module or the name again
        elif op.name not in ("FRAME", "PROTO", "STOP"):
            pushed.append(arg if isinstance(arg, str) and "UNICODE" in op.name else None)
    return names


def unpickled(path: str) -> Any:
    """The task object `hetps.run` pickled (the factory every daemon calls: task.name)."""
    with open(path, "rb") as f:
        return pickle.load(f)


def import_roots(names: list[str]) -> list[str]:
    """The sys.path entries the modules of `module:factory` names were imported from, for
    processes started by exec (they get PYTHONPATH, not this process's sys.path)."""
    roots = []
    for name in names:
        module = sys.modules.get(name.partition(":")[0]) if ":" in name else None
        file = getattr(module, "__file__", None)
        if not file:
            continue
        root = Path(file).resolve().parent
        for _ in range(module.__name__.count(".") + (Path(file).name == "__init__.py")):
            root = root.parent
        if str(root) not in roots:
            roots.append(str(root))
    return roots
