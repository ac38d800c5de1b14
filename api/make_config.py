"""`hetps.config`: a run's configuration from Python, checked as `hetps run` checks a file."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hetps.runconfig.load import config_to_dict, load_config
from hetps.runconfig.schema import RunConfig

# sections with a `name`: a plain string for one of them names it (`algorithm="grouping"`)
NAMED = {"task", "model", "optimizer", "algorithm", "optimizer.schedule"}


def config(
    source: str | Path | Mapping | RunConfig | None = None,
    /,
    *overrides: str,
    **keys: Any,
) -> RunConfig:
    """A checked RunConfig: `source` (a YAML file's path, a dict of the same content, or a
    RunConfig; None: every default) with changes, applied in order:

    - `overrides`: strings as on the `hetps run` command line, `"stop.max_steps=200"`;
    - `keys`: a dotted path spelled with `__` (`stop__max_steps=200`) or passed as
      `**{"stop.max_steps": 200}`; a dict sets the keys inside it and keeps the others
      (`stop={"max_steps": 200}` leaves stop.target as it was); a string for a section
      with a name names it (`algorithm="grouping"`, as `algorithm.name=grouping`: the
      previous algorithm's own keys are dropped).

    Raises hetps.proto.errors.ConfigError listing every problem, each naming its key."""
    if isinstance(source, RunConfig):
        source = config_to_dict(source)
    elif source is not None and not isinstance(source, (str, Path, Mapping)):
        raise TypeError(
            f"hetps.config: the source must be a YAML file's path, a dict or a RunConfig, "
            f"got {type(source).__name__}"
        )
    changes = list(overrides)
    for key, value in keys.items():
        changes += assignments(key.replace("__", "."), value)
    raw = dict(source) if isinstance(source, Mapping) else source
    return load_config(raw, changes)


def assignments(key: str, value: Any) -> list[str]:
    """`key=value` override strings for one Python value (a dict: one per key inside it)."""
    # a factory's kwargs are one value, not keys of the schema
    if isinstance(value, Mapping) and not key.endswith("kwargs"):
        if not value:
            return [f"{key}={{}}"]
        return [a for k, v in value.items() for a in assignments(f"{key}.{k}", v)]
    if isinstance(value, str) and key in NAMED:
        key = f"{key}.name"
    # JSON is YAML, which an override's value is read as
    return [f"{key}={json.dumps(value, default=str)}"]
