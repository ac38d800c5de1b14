"""The packages' dependency rules, checked on every import statement of the source tree
(module level and inside functions alike):

    proto            the wire: imports no other hetps package
    runconfig        the run configuration: proto only
    runtime          what every daemon shares beyond the wire: proto, runconfig
    ps, worker,      the role daemons: the three above; never each other, so each role
    scheduler        runs (and is tested) without the others' code
    sim              the virtual-time engine: drives the roles, so it may import them
    frontend         what a user runs: anything; nothing imports it (the launcher starts
                     the roles as processes, by command line)
    api, examples    `hetps` itself (api/: the Python API, above the command it drives) and
                     hetps.examples (models and datasets a config names by module path, as
                     a user's own would be): anything below; never each other, and nothing
                     imports them

Each package may import only packages of a lower layer (and itself), so there is no cycle
between packages. Packages are named here by their folder: `hetps.<folder>`, and `hetps`
itself for api/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAYERS = [
    {"proto"},
    {"runconfig"},
    {"runtime"},
    {"training"},
    {"ps", "worker", "scheduler"},
    {"sim"},
    {"frontend"},
    {"api", "examples"},
]
RANK = {package: i for i, layer in enumerate(LAYERS) for package in layer}
TOP = "api"  # the folder of the `hetps` package itself


def folder_of(module: str) -> str | None:
    """The source folder of a hetps module (`hetps.worker.trainer` -> worker; `hetps` and its own
    modules, `hetps.running`, -> api), or None for a module of another distribution."""
    parts = module.split(".")
    if parts[0] != "hetps":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in RANK else TOP


def imported_packages(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, hetps package folder) for every import in `path`, a module of `package`;
    relative imports resolve inside `package`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            folders = [folder_of(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            folders = [package] if node.level else [folder_of(node.module or "")]
        else:
            continue
        found += [(node.lineno, f) for f in folders if f is not None]
    return found


def violations(root: Path) -> list[str]:
    """Every import under `root` that breaks the layer rules, as `path:line: a -> b (why)`."""
    out = []
    for package, rank in RANK.items():
        for path in sorted((root / package).rglob("*.py")):
            for line, target in imported_packages(path, package):
                if target != package and RANK[target] >= rank:
                    why = "same layer" if RANK[target] == rank else "a higher layer"
                    out.append(f"{path.relative_to(root)}:{line}: {package} -> {target} ({why})")
    return out


def test_packages_import_only_lower_layers():
    assert violations(REPO) == []


def test_every_installed_package_has_a_layer():
    """A new package folder is placed in LAYERS before it can import anything."""
    import tomllib

    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    assert {name: folder_of(name) for name in mapping} == mapping
    assert set(mapping.values()) == set(RANK)


@pytest.mark.parametrize(
    "package, source, expected",
    [
        (
            "proto",
            "from hetps.runconfig.schema import RunConfig\n",
            "proto -> runconfig (a higher layer)",
        ),
        ("ps", "def f():\n    from hetps.worker import data\n", "ps -> worker (same layer)"),
        ("sim", "import hetps.frontend.cli\n", "sim -> frontend (a higher layer)"),
        ("runtime", "from hetps.proto.codec import decode\n", None),
        ("frontend", "import hetps\n", "frontend -> api (a higher layer)"),
        ("worker", "from hetps import load_model\n", "worker -> api (a higher layer)"),
        ("examples", "from hetps.frontend import cli\n", None),
        ("examples", "from hetps.shipped import task\n", "examples -> api (same layer)"),
        ("api", "from . import running\n", None),
    ],
)
def test_a_violation_is_reported(tmp_path, package, source, expected):
    (tmp_path / package).mkdir()
    (tmp_path / package / "mod.py").write_text(source)
    found = violations(tmp_path)
    assert found == (
        [] if expected is None else [f"{package}/mod.py:{source.count(chr(10))}: {expected}"]
    )
