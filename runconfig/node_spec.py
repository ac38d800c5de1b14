"""The node-list shorthand for many workers (or shards): a mapping that
says how many nodes there are and how their speeds are spread, expanded into
the plain list of node mappings before the config is typed.

    cluster:
      workers: {count: 256, speeds: {lognormal: {sigma: 0.5}}, seed: 0, latency_ms: 1}
      workers: {count: 64, speeds: {classes: [{slowdown: 1, fraction: 0.5}, {slowdown: 4, fraction: 0.5}]}}

`lognormal`: node i's speed is exp(sigma * z_i), z_i standard normal drawn
with numpy's generator seeded by `seed` (default 0); its slowdown is the
fastest node's speed over its own (so the fastest has slowdown 1).
`classes`: consecutive blocks of nodes, each `fraction` of `count` (the
fractions sum to 1; rounding goes to the last class), at that slowdown.
Any other key is a node setting (`link_mbps`, `latency_ms`, `step_s`, ...)
given to every node. Pure data in, data out; raises ConfigError naming the key.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .build import fail, unknown_key
from .schema import NodeConfig

SPEC_KEYS = ("count", "speeds", "seed")
DISTRIBUTIONS = ("lognormal", "classes")


def expand_nodes(spec: dict, path: str, node_fields: list[str]) -> list[dict]:
    """The list of node mappings `spec` stands for (see the module docstring)."""
    unknown = [k for k in spec if k not in SPEC_KEYS and k not in node_fields]
    if unknown:
        fail(
            f"{path}.{unknown[0]}",
            f"{unknown_key(unknown[0], [*SPEC_KEYS, *node_fields])}; "
            f"allowed: {', '.join(SPEC_KEYS + tuple(node_fields))}",
        )
    count, seed = spec.get("count"), spec.get("seed", 0)
    if not _is_int(count) or count < 1:
        fail(f"{path}.count", f"must be an integer >= 1, got {count!r}")
    if not _is_int(seed) or seed < 0:
        fail(f"{path}.seed", f"must be an integer >= 0, got {seed!r}")
    common = {k: v for k, v in spec.items() if k not in SPEC_KEYS}
    speeds = spec.get("speeds")
    if speeds is None:
        slowdowns = [common.get("slowdown", 1.0)] * count
    else:
        slowdowns = _slowdowns(speeds, count, seed, f"{path}.speeds")
        if "slowdown" in common:
            fail(f"{path}.slowdown", "give either slowdown or speeds, not both")
    return [{**common, "slowdown": s} for s in slowdowns]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _slowdowns(speeds: Any, count: int, seed: int, path: str) -> list[float]:
    if not isinstance(speeds, dict) or len(speeds) != 1 or next(iter(speeds)) not in DISTRIBUTIONS:
        fail(
            path,
            f"must be a mapping with one key, one of: {', '.join(DISTRIBUTIONS)}; got {speeds!r}",
        )
    kind, params = next(iter(speeds.items()))
    if kind == "lognormal":
        return _lognormal(params, count, seed, f"{path}.lognormal")
    return _classes(params, count, f"{path}.classes")


def _lognormal(params: Any, count: int, seed: int, path: str) -> list[float]:
    if not isinstance(params, dict) or set(params) - {"sigma"}:
        fail(path, f"must be a mapping with key sigma, got {params!r}")
    sigma = params.get("sigma", 0.5)
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not 0 <= sigma <= 5:
        fail(f"{path}.sigma", f"must be a number in [0, 5], got {sigma!r}")
    speed = np.exp(sigma * np.random.default_rng(seed).standard_normal(count))
    return [round(float(speed.max() / s), 4) for s in speed]


def _classes(params: Any, count: int, path: str) -> list[float]:
    if not isinstance(params, list) or not params:
        fail(path, f"must be a non-empty list of {{slowdown, fraction}}, got {params!r}")
    for i, c in enumerate(params):
        if not isinstance(c, dict) or set(c) != {"slowdown", "fraction"}:
            fail(f"{path}.{i}", f"must be a mapping with exactly slowdown and fraction, got {c!r}")
        for key, low in (("slowdown", 1.0), ("fraction", 0.0)):
            v = c[key]
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or v < low
                or (key == "fraction" and v > 1)
            ):
                fail(
                    f"{path}.{i}.{key}",
                    f"must be a number {'>= 1.0' if key == 'slowdown' else 'in [0, 1]'}, got {v!r}",
                )
    total = sum(c["fraction"] for c in params)
    if abs(total - 1.0) > 1e-6:
        fail(path, f"fractions must sum to 1, got {total:g}")
    sizes = [round(c["fraction"] * count) for c in params[:-1]]
    sizes.append(count - sum(sizes))
    if sizes[-1] < 0:
        fail(path, f"fractions leave no nodes for the last class with count {count}")
    return [float(c["slowdown"]) for c, n in zip(params, sizes) for _ in range(n)]


def node_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(NodeConfig)]


def node_list(value: Any, path: str) -> Any:
    """`workers: 4` is shorthand for four default nodes; a mapping with
    `count` for that many nodes with speeds drawn from a distribution
    (see `expand_nodes`)."""
    if isinstance(value, dict):
        return expand_nodes(value, path, node_fields())
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            fail(path, f"need at least 1, got {value}")
        return [{} for _ in range(value)]
    if not isinstance(value, list):
        fail(
            path,
            "expected a count (e.g. 4), a list of node settings (e.g. [{slowdown: 1}, "
            "{slowdown: 3}]) or a mapping with `count` (e.g. {count: 8, speeds: ...}); "
            f"got {type(value).__name__} {value!r}",
        )
    if any(not isinstance(node, dict) for node in value):
        fail(
            path,
            f"each node of the list is a mapping of its settings, got {value!r}: {_fix(value)}",
        )
    return value


def _fix(nodes: list) -> str:
    """The config a user who wrote a list of bare values most likely meant."""
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in nodes):
        meant = ", ".join(f"{{slowdown: {v}}}" for v in nodes)
        return f"for nodes of those slowdowns write [{meant}]; for {len(nodes)} equal nodes, {len(nodes)}"
    return "write e.g. [{slowdown: 1}, {slowdown: 3}] (one mapping per node), or a count"
