"""Loading a run's configuration: YAML file, `key=value` overrides, typed
building and every check, in one call.

`load_config(path, overrides)` reads YAML, applies `key=value` overrides
(dotted paths, list indices allowed: `cluster.workers.0.slowdown=3`), and
builds the frozen dataclasses of schema.py. Unknown keys, wrong types, unknown
names and numbers out of range (checks.py) raise one `ConfigError` listing
every problem, each naming the key path and the allowed values or range.
`dump_config` writes the resolved config back (a run directory's config.yaml).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import yaml

from hetps.proto.errors import ConfigError

from .algorithms import ALGORITHM_PARAMS
from .build import BAD, Problems, build_dataclass, fail, unknown_key
from .checks import check_targets, check_values, factory_task_metrics
from .factories import FACTORY
from .node_spec import node_list
from .schema import AlgorithmConfig, ClusterConfig, RunConfig
from .targets import resolve_targets, settle_factory_task

# ------------------------------------------------------------ typed building


def _algorithm_fields(name: str) -> list[str]:
    return [f.name for f in dataclasses.fields(ALGORITHM_PARAMS[name])]


def _build_algorithm(value: Any, problems: Problems) -> AlgorithmConfig:
    """The algorithm's name and its own parameters. A key that belongs to
    another algorithm says which one."""
    if value is not None and not isinstance(value, dict):
        problems.add("algorithm", f"expected a mapping, got {type(value).__name__} {value!r}")
        return AlgorithmConfig()
    value = dict(value or {})
    name = value.pop("name", "sync")
    if not isinstance(name, str) or name not in ALGORITHM_PARAMS:
        problems.add(
            "algorithm.name", f"unknown value {name!r}; allowed: {', '.join(ALGORITHM_PARAMS)}"
        )
        return AlgorithmConfig()
    own = _algorithm_fields(name)
    for key in [k for k in value if k not in own]:
        owners = [a for a in ALGORITHM_PARAMS if key in _algorithm_fields(a)]
        where = (
            f"belongs to {' or '.join(owners)}, not to {name} (algorithm.name={owners[0]} takes it)"
            if owners
            else unknown_key(key, own)
        )
        problems.add(f"algorithm.{key}", f"{where}; allowed: {', '.join(own) or '(none)'}")
        del value[key]
    params = build_dataclass(ALGORITHM_PARAMS[name], value, "algorithm", problems)
    return AlgorithmConfig(name=name, params=ALGORITHM_PARAMS[name]() if params is BAD else params)


def _resolve_algorithm(cfg: RunConfig, problems: Problems) -> RunConfig:
    """Parameters whose default depends on the rest of the config (a params
    class with `resolve(cfg)`, e.g. balanced's global batch) take their value
    here, so the plan carries the number every node uses."""
    resolve = getattr(cfg.algorithm.params, "resolve", None)
    if resolve is None or problems:
        return cfg
    try:
        return dataclasses.replace(
            cfg, algorithm=dataclasses.replace(cfg.algorithm, params=resolve(cfg))
        )
    except ConfigError as exc:
        problems.extend(exc.errors)
        return cfg


def config_from_dict(raw: dict, import_targets: bool = False) -> RunConfig:
    """Build and check a RunConfig from plain data. Raises ConfigError listing
    every problem found. `import_targets`: also import `pkg.module:factory`
    model and dataset names (where they will be built: `hetps run`, workers)."""
    return _config_from_dict(raw, import_targets, Problems())


def _config_from_dict(raw: Any, import_targets: bool, problems: Problems) -> RunConfig:
    if not isinstance(raw, dict):
        fail("", "the config file must hold a mapping")
    raw = dict(raw)
    resolve_targets(raw, problems)  # stop.target / target_accuracy / eval.metric, as written
    task_shorthand(raw)
    algorithm = _build_algorithm(raw.pop("algorithm", None), problems)
    cluster = raw.get("cluster")
    if isinstance(cluster, dict):
        cluster = dict(cluster)
        for kind in ("shards", "workers"):
            if kind in cluster:
                try:
                    cluster[kind] = node_list(cluster[kind], f"cluster.{kind}")
                except ConfigError as exc:
                    problems.extend(exc.errors)
                    del cluster[kind]
        raw["cluster"] = cluster
    cfg = dataclasses.replace(build_dataclass(RunConfig, raw, "", problems), algorithm=algorithm)
    problems.extend(check_values(cfg))
    cfg = _resolve_algorithm(cfg, problems)
    # a config with other errors is not worth importing code for
    if import_targets and not problems:
        problems.extend(check_targets(cfg))
    if import_targets and not problems and FACTORY.fullmatch(cfg.task.name):
        metrics, made = factory_task_metrics(cfg)  # the task is made: its metrics are known
        problems.extend(made)
        if metrics:
            cfg = settle_factory_task(cfg, metrics, problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def task_shorthand(raw: dict) -> None:
    """In place: `task: NAME` (the shorthand) becomes `task: {name: NAME}`."""
    if isinstance(raw.get("task"), str):
        raw["task"] = {"name": raw["task"]}


# ------------------------------------------------------------ overrides and files


def apply_override(raw: dict, assignment: str, keep_algorithm_keys: set[str] | None = None) -> None:
    """Apply one `dotted.key=value` (value parsed as YAML) to the raw mapping, in place.
    With `keep_algorithm_keys` (a set), `algorithm.name=X` first drops the
    previous algorithm's keys that X does not take, except those."""
    if "=" not in assignment:
        fail(assignment, "override must look like key=value")
    key, text = assignment.split("=", 1)
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError as exc:
        fail(key.strip(), f"value is not valid YAML ({str(exc).splitlines()[0]}): {text!r}")
    if keep_algorithm_keys is not None and key.strip() == "algorithm.name":
        switch_algorithm(raw, value, keep_algorithm_keys)
    parts = key.strip().split(".")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        here = ".".join(parts[: i + 1])
        if isinstance(node, list):
            node = node[_list_index(node, part, here)]
        elif isinstance(node, dict):
            child = node.get(part)
            if here in ("cluster.workers", "cluster.shards"):
                default = len(getattr(ClusterConfig(), part))
                child = node_list(default if child is None else child, here)
            node[part] = child = {} if child is None else child
            node = child
        else:
            fail(here, f"cannot set a key inside {type(node).__name__}")
    last = parts[-1]
    if isinstance(node, list):
        node[_list_index(node, last, key)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        fail(key, f"cannot set a key inside {type(node).__name__}")


def _list_index(node: list, part: str, path: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        fail(path, f"index must be 0..{len(node) - 1}")
    return int(part)


def load_raw(path: str | Path) -> dict:
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:  # missing, a directory, not UTF-8 text
        raise ConfigError(
            f"{path}: cannot read ({getattr(exc, 'strerror', None) or 'not UTF-8 text'})"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    # an empty file: the defaults; any other non-mapping is refused
    return {} if raw is None else raw


def load_config(
    path: str | Path | dict | None, overrides: list[str] = (), import_targets: bool = False
) -> RunConfig:
    """Load a YAML file (None: all defaults; a dict: the file's content, not changed), apply
    overrides, validate.

    `algorithm.name=X` among the overrides drops the keys of the previous
    algorithm that X does not take (unless an override set them).
    `import_targets`: see `config_from_dict`. Raises ConfigError listing every
    problem found (an unreadable file: only that)."""
    raw = copy.deepcopy(path) if isinstance(path, dict) else load_raw(path) if path else {}
    problems = Problems()
    typed: set[str] = set()  # algorithm keys the command line set: never dropped
    for assignment in overrides:
        key = assignment.split("=", 1)[0].strip()
        if isinstance(raw, dict):
            task_shorthand(raw)  # so that a `task.kwargs=...` override finds a mapping
        try:
            apply_override(raw, assignment, typed if key == "algorithm.name" else None)
        except ConfigError as exc:
            problems.extend(exc.errors)
        if key.startswith("algorithm."):
            typed.add(key.split(".", 1)[1])
    try:
        return _config_from_dict(raw, import_targets, problems)
    except ConfigError as exc:
        raise ConfigError(list(dict.fromkeys(exc.errors))) from None


def switch_algorithm(raw: dict, name: Any, keep: set[str] = frozenset()) -> None:
    """In place: the raw config's algorithm becomes `name`; the keys of the
    previous algorithm that `name` does not take are dropped (except `keep`).
    An unknown `name` changes nothing here (it is reported when building)."""
    algorithm = raw.get("algorithm")
    if (
        not isinstance(algorithm, dict)
        or not isinstance(name, str)
        or name not in ALGORITHM_PARAMS
        or algorithm.get("name", "sync") == name
    ):
        return
    own = set(_algorithm_fields(name)) | set(keep) | {"name"}
    raw["algorithm"] = {k: v for k, v in algorithm.items() if k in own}


def config_to_dict(cfg: RunConfig) -> dict:
    """Plain data for the resolved config; algorithm params are flattened next to the name."""
    data = dataclasses.asdict(cfg)
    data["algorithm"] = {"name": cfg.algorithm.name, **dataclasses.asdict(cfg.algorithm.params)}
    return data


def dump_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
