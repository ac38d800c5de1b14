"""The public API is visible to type checkers: the wheel ships `hetps/py.typed` (PEP 561) and
`hetps.run` and friends resolve to their definitions (api/__init__.py imports them under
TYPE_CHECKING), so mypy checks a call against its signature; at run time they stay lazy
(`import hetps.proto` loads none of them)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import hetps

REPO = Path(__file__).resolve().parents[2]
MYPY = Path(sys.executable).with_name("mypy")

# a user's script: a good call, then one with a wrong argument type on line 6
SCRIPT = """\
import hetps

result: hetps.Result = hetps.run("sines.yaml", on_eval=print, on_end=print, step_every=10)
print(result.metrics, hetps.config("sines.yaml").stop.max_seconds)
hetps.load_result(result.run_dir)
hetps.run("sines.yaml", progress="yes")
"""

# only hetps's public modules are read (their errors silent); torch and the rest are skipped,
# as they would be Any in a script without their stubs: seconds, not a minute of torch's stubs
MYPY_INI = """\
[mypy]
follow_imports = skip
[mypy-hetps,hetps.running,hetps.make_config,hetps.models]
follow_imports = silent
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """hetps's wheel, built offline from a copy of the checkout's package folders (the build
    writes nothing into the checkout) and unpacked into a folder that stands for
    site-packages (mypy reads a package from there only with its py.typed)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    folders = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    for folder in folders["package-dir"].values():
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--quiet", "--wheel-dir", str(tmp / "wheel"), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp / "wheel").glob("hetps-*.whl")
    site = tmp / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    return site


def mypy(script: Path, site: Path) -> subprocess.CompletedProcess:
    ini = script.with_name("mypy.ini")
    ini.write_text(MYPY_INI)
    # mypy finds installed packages on the interpreter's path (PYTHONPATH included) and
    # takes a package from there only when it has py.typed
    return subprocess.run(
        [str(MYPY), "--config-file", str(ini), "--python-executable", sys.executable]
        + ["--no-incremental", "--cache-dir", "/dev/null", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=script.parent,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )


def test_the_wheel_ships_py_typed(installed):
    assert (installed / "hetps" / "py.typed").is_file()


def test_mypy_reports_a_wrong_argument_to_hetps_run(installed, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = mypy(script, installed)
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    # the wrong one only: the good calls resolve (Result, config, load_result, the callbacks)
    assert len(errors) == 1, out.stdout + out.stderr
    assert errors[0].startswith("train.py:6:") and '"progress"' in errors[0], errors
    assert '"bool"' in errors[0], errors


def test_without_py_typed_mypy_does_not_read_the_package(installed, tmp_path):
    """The check above can fail: the same wheel without py.typed is a package mypy will not
    read, and the call goes unchecked (an import error instead)."""
    bare = tmp_path / "site"
    subprocess.run(["cp", "-r", str(installed), str(bare)], check=True)
    (bare / "hetps" / "py.typed").unlink()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = mypy(script, bare)
    assert "py.typed" in out.stdout and '"progress"' not in out.stdout, out.stdout


def test_every_exported_name_is_imported_for_type_checkers_and_lazily():
    source = (REPO / "api" / "__init__.py").read_text()
    checked = source.split("if TYPE_CHECKING:")[1].split("\n\n")[0]
    for name, module in hetps._EXPORTS.items():
        assert f"from {module} import" in checked and name in checked, name
        assert getattr(hetps, name) is getattr(__import__(module, fromlist=[name]), name)
    assert sorted(hetps.__all__) == sorted(hetps._EXPORTS)


def test_import_hetps_proto_loads_none_of_the_api():
    code = (
        "import sys, hetps.proto.codec; "
        "print(sorted(m for m in ('hetps.running', 'hetps.make_config', 'hetps.models', "
        "'hetps.training.task') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
