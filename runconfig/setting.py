"""One configuration setting: `setting(default, help=...)` is a dataclass
field whose description sits in its metadata, where the generated reference
(reference.py, docs/configuration.md) reads it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")

HELP = "help"  # the metadata key of a field's description


@overload
def setting(default: T, *, help: str) -> T: ...
@overload
def setting(*, default_factory: Callable[[], T], help: str) -> T: ...
@overload
def setting(*, help: str) -> Any: ...
def setting(default=dataclasses.MISSING, *, default_factory=dataclasses.MISSING, help: str):
    """`dataclasses.field(default=... | default_factory=...)` described by `help`;
    with neither, the field is required."""
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={HELP: help}
    )
