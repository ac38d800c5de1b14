"""`package.module:factory` names: the one place a config's name of user code is imported.

A model, dataset, task or lr schedule can be named as `package.module:factory`; every
process that builds it imports the module and takes the callable by name. `load_factory`
does that for all of them and raises one error, `FactoryError`, that names the config key,
the module and the attribute (and a close name when there is one), so each caller only
words the error its own way.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
import re
import sys
from typing import Any, Callable

FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")  # package.module:factory


class FactoryError(ValueError):
    """A `package.module:factory` name that cannot be loaded. `str()` is `key: reason`;
    `reason` alone reads as a sentence after the caller's own prefix."""

    def __init__(self, key: str, spec: str, module: str, attr: str, reason: str):
        super().__init__(f"{key}: {reason}")
        self.key, self.spec, self.module, self.attr, self.reason = key, spec, module, attr, reason


def load_factory(spec: str, key: str) -> Callable[..., Any]:
    """The callable `spec` (`package.module:factory`) names; `key` is the config key that
    gave it (`model.name`), for the message. Imports the module (running its top level).
    Raises FactoryError: a malformed name, a module that does not import (whatever it
    raised), or no callable of that name."""
    module_name, _, attr = spec.partition(":")
    if not FACTORY.fullmatch(spec):
        raise FactoryError(
            key, spec, module_name, attr, f"{spec!r} is not a package.module:factory name"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module may raise anything while importing
        reason = (
            f"cannot import {module_name!r} ({type(exc).__name__}: {exc}){_module_hint(exc)}; "
            "the module must be importable on every host that builds it (the hetps commands "
            "look beside the config and in the current directory; else PYTHONPATH or an "
            "installed package)"
        )
        raise FactoryError(key, spec, module_name, attr, reason) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        reason = f"module {module_name!r} has no callable {attr!r}{_attr_hint(module, attr)}"
        raise FactoryError(key, spec, module_name, attr, reason)
    return factory


def _attr_hint(module: Any, attr: str) -> str:
    """`; did you mean 'make'?` for a callable of `module` named close to `attr`; else the
    callables the module itself defines (`; its own callables: Net, make`), those it imported
    left out; else ''."""
    names = [n for n, v in vars(module).items() if not n.startswith("_") and callable(v)]
    close = closest(attr, names)
    if close:
        return f"; did you mean {close!r}?"
    own = [n for n in names if getattr(vars(module)[n], "__module__", None) == module.__name__]
    return f"; its own callables: {', '.join(own)}" if own else ""


def _module_hint(exc: Exception) -> str:
    """`; did you mean 'pkg.model'?` when the last part of a dotted module name is not found
    but its package imported and holds a module named close to it, else ''."""
    missing = getattr(exc, "name", None)
    if not isinstance(exc, ModuleNotFoundError) or not missing or "." not in missing:
        return ""
    parent, _, leaf = missing.rpartition(".")
    path = getattr(sys.modules.get(parent), "__path__", None)
    close = closest(leaf, [m.name for m in pkgutil.iter_modules(path)]) if path else None
    return f"; did you mean {parent + '.' + close!r}?" if close else ""


def closest(word: str, names: list[str]) -> str | None:
    """The one of `names` a mistyped `word` most likely meant, or None: the closest spelling
    (difflib), else the closest ignoring case (`conv1` -> `Conv1DNet`), else the only name
    that holds `word` as a whole part (`f1` -> `macro_f1`)."""
    close = difflib.get_close_matches(word, names, n=1)
    if close:
        return close[0]
    lower = {n.lower(): n for n in names}
    close = difflib.get_close_matches(word.lower(), list(lower), n=1)
    if close:
        return lower[close[0]]
    parts = re.compile(rf"(^|[\W_]){re.escape(word.lower())}($|[\W_])")
    holding = [n for n in names if parts.search(n.lower())]
    return holding[0] if len(holding) == 1 else None
