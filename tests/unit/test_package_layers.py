"""The packages' dependency rules, checked on every import statement of the source tree
(module level and inside functions alike; relative imports resolved to the module they name):

    proto            the wire: imports no other hetps package
    runconfig        the run configuration: proto only
    runtime          what every daemon shares beyond the wire: proto, runconfig
    training         what is trained and the step core (task, models, data, step, ...):
                     the three above; worker and sim both stand on it
    ps, worker,      the role daemons: the four above; never each other, so each role
    scheduler        runs (and is tested) without the others' code
    sim              the virtual-time engine: drives the coordinator and the shards, so it
                     may import them; its workers run training's step core, never worker's
    frontend         what a user runs: anything; nothing imports it (the launcher starts
                     the roles as processes, by command line)
    api, examples    `hetps` itself (api/: the Python API, above the command it drives) and
                     hetps.examples (models and datasets a config names by module path, as
                     a user's own would be): anything below; never each other, and nothing
                     imports them

Each package may import only packages of a lower layer (and itself), so there is no cycle
between packages. Packages are named here by their folder: `hetps.<folder>`, and `hetps`
itself for api/. A relative import counts as the absolute one it stands for:
`from ..worker import data` inside ps/ is ps -> worker.

Inside a package there is no cycle either: no module imports, directly or through others of
its package, a module that imports it back. Each import counts, those inside functions
included (a lazy import is still a dependency, only a later one); imports under
`if TYPE_CHECKING:` do not (they never run). `from . import x` and `from .x import y` both
import x; a name that is no module (`from . import y`, `from hetps.ps import y`) imports the
package's __init__.py. A module's parent packages, which Python runs before it, are not
counted unless it names them."""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path
from typing import Iterator

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
# Pairs the layers would allow that are kept apart all the same.
APART = {("sim", "worker"): "the simulated workers run training's step core, not the daemon"}
BEYOND = "(beyond hetps)"  # what a relative import above the `hetps` package resolves to

# Cycles being removed by work in progress: per package, the files that may still import each
# other round; a cycle all of whose files are listed is not reported. To be emptied.
KNOWN_CYCLES: dict[str, set[str]] = {}


def folder_of(module: str) -> str | None:
    """The source folder of a hetps module (`hetps.worker.trainer` -> worker; `hetps` and its own
    modules, `hetps.running`, -> api), or None for a module of another distribution."""
    parts = module.split(".")
    if parts[0] != "hetps":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in RANK else TOP


def module_names(root: Path, package: str) -> dict[str, Path]:
    """The dotted name of every module under `root/package` (`hetps.ps.policies` for
    ps/policies/__init__.py), to its file."""
    prefix = ("hetps",) if package == TOP else ("hetps", package)
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root / package).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(prefix + parts)] = path
    return names


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under an `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
            (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
            or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
        ):
            skipped |= {id(n) for statement in node.body for n in ast.walk(statement)}
    return skipped


def imported_names(
    path: Path, module: str, type_checking: bool = True
) -> Iterator[tuple[int, str]]:
    """(line, absolute dotted name) for every import in `path`, the file of `module`: a module
    imported (`import a.b`, `from a import b` gives `a.b`, which may be a name in module a),
    relative imports resolved from the module's package, or BEYOND for one that climbs above
    `hetps`. Imports under `if TYPE_CHECKING:` only when `type_checking`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    skipped = set() if type_checking else _type_checking_only(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                if node.level > len(parts):
                    yield node.lineno, BEYOND
                    continue
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join(anchor + [node.module] if node.module else anchor)
            for alias in node.names:
                yield node.lineno, base if alias.name == "*" else f"{base}.{alias.name}"


def violations(root: Path) -> list[str]:
    """Every import under `root` that breaks the layer rules, as `path:line: a -> b (why)`."""
    out = []
    for package, rank in RANK.items():
        for module, path in module_names(root, package).items():
            for line, name in imported_names(path, module):
                where = f"{path.relative_to(root)}:{line}: {package} ->"
                if name == BEYOND:
                    out.append(f"{where} {BEYOND} (a relative import above the top package)")
                    continue
                target = folder_of(name)
                if target is None or target == package:
                    continue
                if RANK[target] >= rank:
                    why = "same layer" if RANK[target] == rank else "a higher layer"
                    out.append(f"{where} {target} ({why})")
                elif (package, target) in APART:
                    out.append(f"{where} {target} ({APART[package, target]})")
    return out


def module_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Each module of `package`, named by its file under the package folder (`policies/sync.py`),
    to the modules of the same package it imports, TYPE_CHECKING imports left out."""
    names = module_names(root, package)
    label = {module: path.relative_to(root / package).as_posix() for module, path in names.items()}
    graph: dict[str, set[str]] = {label[module]: set() for module in names}
    for module, path in names.items():
        for _, name in imported_names(path, module, type_checking=False):
            if name == BEYOND or folder_of(name) != package:
                continue
            # `a.b.c` is module c, or a name in module b (or in package b's __init__).
            while name and name not in names:
                name = name.rpartition(".")[0]
            if name and name != module:
                graph[label[module]].add(label[name])
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` of more than one node (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        work = [(start, iter(sorted(graph[start])))]
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return components


def shortest_cycle(graph: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    """The shortest path start -> ... -> start over the nodes `within` (a component holding start)."""
    parent = {start: start}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for succ in sorted(graph[node] & within):
            if succ == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return path[::-1] + [start]
            if succ not in parent:
                parent[succ] = node
                queue.append(succ)
    raise AssertionError(f"{start} is on no cycle within {sorted(within)}")


def cycles(root: Path, known: dict[str, set[str]] | None = None) -> list[str]:
    """Import cycles inside each package under `root`, as `package: a.py -> b.py -> a.py`: one
    per module of a strongly connected component, until each is on one reported; a cycle all of
    whose files are in `known[package]` is left out."""
    out = []
    for package in sorted(RANK):
        graph = module_graph(root, package)
        for component in strongly_connected(graph):
            uncovered = set(component)
            while uncovered:
                cycle = shortest_cycle(graph, min(uncovered), set(component))
                uncovered -= set(cycle)
                if not set(cycle) <= (known or {}).get(package, set()):
                    out.append(f"{package}: {' -> '.join(cycle)}")
    return out


def test_packages_import_only_lower_layers():
    assert violations(REPO) == []


def test_no_import_cycle_inside_a_package():
    assert cycles(REPO, KNOWN_CYCLES) == []


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
        ("ps", "from ..worker import data\n", "ps -> worker (same layer)"),
        ("ps", "def f():\n    from .. import worker\n", "ps -> worker (same layer)"),
        ("ps", "from .. import load_model\n", "ps -> api (a higher layer)"),
        ("ps", "from . import shard\nfrom .store import Store\n", None),
        ("training", "from ..runtime.optim import build\n", None),
        ("sim", "from hetps.training.step import GradientStep\n", None),
        ("sim", "from hetps.ps.shard import Shard\n", None),
        ("sim", "from ..worker import trainer\n", f"sim -> worker ({APART['sim', 'worker']})"),
        (
            "proto",
            "from ... import x\n",
            f"proto -> {BEYOND} (a relative import above the top package)",
        ),
        ("api", "from .. import x\n", f"api -> {BEYOND} (a relative import above the top package)"),
    ],
)
def test_a_violation_is_reported(tmp_path, package, source, expected):
    (tmp_path / package).mkdir()
    (tmp_path / package / "mod.py").write_text(source)
    found = violations(tmp_path)
    assert found == (
        [] if expected is None else [f"{package}/mod.py:{source.count(chr(10))}: {expected}"]
    )


@pytest.mark.parametrize(
    "source, expected",
    [
        (
            "from ...scheduler.runlog import read\n",
            "ps/policies/sync.py:1: ps -> scheduler (same layer)",
        ),
        ("from ...worker import data\n", "ps/policies/sync.py:1: ps -> worker (same layer)"),
        ("from .. import shard\nfrom ..store import Store\nfrom . import base\n", None),
    ],
)
def test_a_relative_import_from_a_subpackage_is_resolved(tmp_path, source, expected):
    (tmp_path / "ps" / "policies").mkdir(parents=True)
    (tmp_path / "ps" / "policies" / "sync.py").write_text(source)
    assert violations(tmp_path) == ([] if expected is None else [expected])


def write_package(root: Path, package: str, files: dict[str, str]) -> None:
    for name, source in files.items():
        (root / package / name).parent.mkdir(parents=True, exist_ok=True)
        (root / package / name).write_text(source)


@pytest.mark.parametrize(
    "files, expected",
    [
        (
            {"a.py": "from . import b\n", "b.py": "from .a import f\n"},
            ["training: a.py -> b.py -> a.py"],
        ),
        (
            {
                "a.py": "from hetps.training.b import g\n",
                "b.py": "import hetps.training.c\n",
                "c.py": "from .a import f\n",
            },
            ["training: a.py -> b.py -> c.py -> a.py"],
        ),
        (
            {
                "data.py": "def load():\n    from .user_data import factory\n",
                "user_data.py": "def f():\n    from hetps.training import data\n",
            },
            ["training: data.py -> user_data.py -> data.py"],
        ),
        (
            {"__init__.py": "from .a import f\n", "a.py": "from . import g\n"},
            ["training: __init__.py -> a.py -> __init__.py"],
        ),
        (
            {
                "sub/__init__.py": "",
                "sub/x.py": "from ..a import f\n",
                "a.py": "from .sub.x import y\n",
            },
            ["training: a.py -> sub/x.py -> a.py"],
        ),
        (
            {
                "a.py": "from . import b, c\nfrom .d import x\n",
                "b.py": "from .c import y\nfrom . import d\n",
                "c.py": "from .d import z\nimport hetps.proto.codec\n",
                "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n",
                "__init__.py": "",
            },
            [],
        ),
    ],
    ids=["two", "three", "lazy", "init", "subpackage", "dag"],
)
def test_a_cycle_is_reported(tmp_path, files, expected):
    write_package(tmp_path, "training", files)
    assert cycles(tmp_path) == expected


def test_the_top_package_imports_its_init_only_by_name(tmp_path):
    """In api/ (`hetps` itself) `import hetps.proto.codec` is no import of api/__init__.py;
    `from hetps import x` is."""
    write_package(
        tmp_path,
        "api",
        {
            "__init__.py": "def __getattr__(name):\n    from . import running\n",
            "running.py": "import hetps.proto.codec\nfrom hetps.training.data import Datasets\n",
            "models.py": "from hetps import config\n",
        },
    )
    assert cycles(tmp_path) == []
    (tmp_path / "api" / "running.py").write_text("from hetps import config\n")
    assert cycles(tmp_path) == ["api: __init__.py -> running.py -> __init__.py"]


def test_a_known_cycle_is_left_out(tmp_path):
    write_package(tmp_path, "training", {"a.py": "from . import b\n", "b.py": "from . import a\n"})
    assert cycles(tmp_path, {"training": {"a.py", "b.py"}}) == []
    assert cycles(tmp_path, {"training": {"a.py"}}) == ["training: a.py -> b.py -> a.py"]
