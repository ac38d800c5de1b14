"""Generate the configuration reference (docs/configuration.md) from the
config dataclasses themselves, so the two cannot drift apart:

    python -m hetps.runconfig.reference > docs/configuration.md

Keys, types and defaults come from the dataclasses in schema.py and
algorithm_params.py; each description is the `help` in the field's metadata
(`setting(default, help=...)`, setting.py); allowed values come from
`config.CHOICES` and the algorithm table.
tests/unit/test_config_docs.py fails when the file is out of date.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import typing

from . import schema as config
from .algorithms import ALGORITHM_PARAMS
from .setting import HELP

REGENERATE = "python -m hetps.runconfig.reference > docs/configuration.md"

SECTION_TITLES = {"": "Top level"}


def _help(cls: type, name: str) -> str:
    """The field's help text (`setting(..., help=...)`); a subclass's field
    without one, such as a changed default, keeps its base's."""
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass):
            for f in dataclasses.fields(klass):
                if f.name == name and HELP in f.metadata:
                    return f.metadata[HELP]
    return ""


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _show(value) -> str:
    if value is dataclasses.MISSING:
        return "(required)"
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
        return f"{len(value)} nodes"
    return f"`{json.dumps(value)}`"


def _element(cls: type, f: dataclasses.Field):
    """The dataclass a list field holds (e.g. NodeConfig), else None."""
    hint = typing.get_type_hints(cls, vars(config))[f.name]
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _row(key: str, f: dataclasses.Field, cls: type) -> str:
    help_text = _help(cls, f.name)
    choices = config.CHOICES.get(key) or (
        tuple(ALGORITHM_PARAMS) if key == "algorithm.name" else None
    )
    if choices:
        help_text += f" (one of: {', '.join(f'`{c}`' for c in choices)})"
    return f"| `{key}` | `{f.type}` | {_show(_default(f))} | {help_text.replace('|', '/')} |"


def _table(prefix: str, cls: type, sections: list) -> list[str]:
    """Rows for `cls`'s scalar fields; dataclass fields are queued as sections."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if cls is config.AlgorithmConfig and f.name == "params":
            continue
        nested = _default(f)
        if dataclasses.is_dataclass(nested):
            sections.append((key, type(nested)))
            continue
        element = _element(cls, f)
        if element is not None:
            sections.append((f"{key}.N" if element is config.NodeConfig else f"{key}[]", element))
        rows.append(_row(key, f, cls))
    return rows


def _algorithms() -> list[str]:
    out = [
        "## algorithm parameters",
        "",
        "`algorithm: {name: NAME, KEY: VALUE, ...}`; unknown keys for that algorithm are an error.",
        "",
    ]
    for name, cls in ALGORITHM_PARAMS.items():
        out.append(f"### `{name}`")
        out.append("")
        params = dataclasses.fields(cls)
        if not params:
            out += [inspect.getdoc(cls) or "No parameters.", ""]
            continue
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        out += [
            f"| `algorithm.{f.name}` | `{f.type}` | {_show(_default(f))} | "
            f"{_help(cls, f.name).replace('|', '/')} |"
            for f in params
        ]
        out.append("")
    return out


def render() -> str:
    """The whole reference as Markdown."""
    out = [
        "# Configuration reference",
        "",
        f"<!-- generated from runconfig/schema.py and runconfig/algorithm_params.py by `{REGENERATE}`; "
        "do not edit by hand -->",
        "",
        "A config is YAML; every key has a default. Unknown keys, wrong types and unknown names are errors "
        "that name the key path and the allowed values. Override any key on the command line with its "
        "dotted path: `optimizer.lr=0.01`, `cluster.workers=8`, `cluster.workers.1.slowdown=3`, "
        "`stop.target_accuracy=null`. `hetps run` writes the resolved config to `RUN_DIR/config.yaml`.",
        "",
    ]
    sections: list = [("", config.RunConfig)]
    while sections:
        prefix, cls = sections.pop(0)
        title = SECTION_TITLES.get(prefix, f"`{prefix}`")
        out += [f"## {title}", ""]
        doc = (
            inspect.getdoc(cls)
            if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(")
            else ""
        )
        if doc:
            out += [doc.replace("\n", " "), ""]
        out += _table(f"{prefix}." if prefix else "", cls, sections) + [""]
    out += _algorithms()
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
