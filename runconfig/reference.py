"""Generate the configuration reference (docs/configuration.md) from the
config dataclasses themselves, so the two cannot drift apart:

    python -m hetps.runconfig.reference > docs/configuration.md

Keys, types and defaults come from the dataclasses in schema.py and
algorithm_params.py; each description is the comment at the end of the
field's line in the source (or, for the few fields without one, `HELP`
below); allowed values come from `config.CHOICES` and the algorithm table.
tests/unit/test_config_docs.py fails when the file is out of date.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import sys
import typing
from functools import cache

from . import schema as config
from .algorithms import ALGORITHM_PARAMS

REGENERATE = "python -m hetps.runconfig.reference > docs/configuration.md"

# Descriptions of fields whose source line carries no comment.
HELP = {
    "name": "run name: names the run directory",
    "seed": "seeds model initialization, data order and emulated faults",
    "out_dir": "where `hetps run` puts run directories",
    "data.synthetic.shape": "shape of one synthetic sample",
    "data.synthetic.classes": "number of synthetic classes",
    "data.synthetic.train_size": "synthetic training samples",
    "data.synthetic.test_size": "synthetic test samples",
    "data.dataset": "what to train on (`mnist-5k` is offline: real digits installed with the package)",
    "data.eval_batch_size": "the evaluator's batch size",
    "data.download": "let torchvision download `mnist`, `cifar10` or `cifar100` into `data.root`",
    "optimizer.schedule.gamma": "`step`: the factor applied every `step_size` updates",
    "optimizer.lr": "learning rate of the shards' optimizer",
    "optimizer.momentum": "SGD momentum",
    "optimizer.nesterov": "SGD with Nesterov momentum",
    "optimizer.weight_decay": "L2 weight decay",
    "optimizer.betas": "Adam's betas",
    "algorithm.name": "the training algorithm; its parameters sit beside the name (see below)",
    "cluster.shards": "the shards: a count, or a list of nodes (keys below)",
    "cluster.workers": "the workers: a count, or a list of nodes (keys below)",
    "cluster.heartbeat_s": "seconds between a node's heartbeats",
    "cluster.faults": "fault injection on the wire (keys below)",
    "eval.enabled": "run the evaluator (`hetps run`)",
    "eval.every_s": "seconds between evaluations",
    "eval.keep_best": "keep a copy of the parameters of the best evaluation and write them as best.safetensors",
    "slowdown": "the new slowdown from then on",
    "algorithm.regroup_every_s": "seconds between the scheduler's checks for drifted speeds",
}
SECTION_TITLES = {"": "Top level"}


@cache
def _comments(cls: type) -> dict[str, str]:
    """Field name -> the comment at the end of its line in `cls`'s source,
    with the comment-only lines right below it that continue it."""
    out: dict[str, str] = {}
    name, columns = None, ()
    for line in inspect.getsource(cls).splitlines():
        found = re.match(r"\s+(\w+)\s*:[^#]*#\s*(.+)$", line)
        more = re.match(r"\s+#\s*(.+)$", line)
        if found:
            name, columns = found.group(1), (line.index("#"), found.start(2))
            out[name] = found.group(2).strip()
        elif (
            more
            and name is not None
            and (line.index("#") == columns[0] or more.start(1) == columns[1])
        ):
            # a comment-only line right under it, its '#' or its text lined up with the field's comment
            out[name] += " " + more.group(1).strip()
        else:
            name = None
    return out


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
    help_text = _comments(cls).get(f.name) or HELP.get(key) or HELP.get(f.name, "")
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
        comments = (
            {**_comments(ALGORITHM_PARAMS["wpsgd"]), **_comments(cls)}
            if issubclass(
                # a subclass inherits its base's comments
                cls,
                ALGORITHM_PARAMS["wpsgd"],
            )
            else _comments(cls)
        )
        out += [
            f"| `algorithm.{f.name}` | `{f.type}` | {_show(_default(f))} | "
            f"{(comments.get(f.name) or HELP.get(f'algorithm.{f.name}', '')).replace('|', '/')} |"
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
