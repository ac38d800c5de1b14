"""Settings that name paths, refused before anything starts: the keys
directory of security.curve (runtime/curve_setup.py) and what `hetps run`
checks before it starts a process (frontend/launcher.py `prestart_problems`), and the
scheduler's --run-dir."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hetps.frontend.launcher import prestart_problems
from hetps.proto.security import SecurityError, write_keys
from hetps.runconfig.load import load_config
from hetps.runtime.curve_setup import KeysSettingError, check_run_keys, resolve_keys_dir
from hetps.runtime.daemon import not_writable, security_problem


@pytest.fixture(autouse=True)
def no_keys_from_the_environment(monkeypatch):
    monkeypatch.delenv("HETPS_KEYS_DIR", raising=False)
    monkeypatch.delenv("HETPS_CLIENT_KEY", raising=False)


def curve(keys_dir: Path | str = "", *more: str):
    return load_config(None, ["security.curve=true", f"security.keys_dir={keys_dir}", *more])


def test_the_keys_directory_setting_is_named_with_its_path(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere"
    with pytest.raises(KeysSettingError) as refused:
        resolve_keys_dir(curve(missing).security)
    assert str(refused.value).startswith(f"security.keys_dir: {missing} does not exist")
    assert security_problem(refused.value).startswith("config error: security.keys_dir: ")
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(KeysSettingError, match=f"^security.keys_dir: {a_file} is not a directory"):
        resolve_keys_dir(curve(a_file).security)
    with pytest.raises(KeysSettingError, match="^security.keys_dir: .* no keys directory is set"):
        resolve_keys_dir(curve().security)
    monkeypatch.setenv("HETPS_KEYS_DIR", str(missing))  # the environment wins, and is named
    with pytest.raises(KeysSettingError, match=rf"^\$HETPS_KEYS_DIR: {missing} does not exist"):
        resolve_keys_dir(curve(tmp_path).security)


def test_hetps_run_loads_the_keys_it_is_given_before_it_starts(tmp_path):
    run_dir = tmp_path / "run"
    check_run_keys(load_config(None, []), run_dir / "keys")  # curve off: nothing to load
    check_run_keys(curve(), run_dir / "keys")  # keys of its own, made in the run directory
    check_run_keys(curve(run_dir / "keys"), run_dir / "keys")
    with pytest.raises(KeysSettingError, match="security.keys_dir: .* does not exist"):
        check_run_keys(curve(tmp_path / "nowhere"), run_dir / "keys")
    keys = tmp_path / "keys"
    write_keys(keys, ["client-0"])
    check_run_keys(curve(keys), run_dir / "keys")  # every process loads what it needs
    (keys / "clients" / "client-0.key_secret").unlink()  # the client key every process uses
    with pytest.raises(SecurityError, match=str(keys / "clients" / "client-0.key_secret")):
        check_run_keys(curve(keys), run_dir / "keys")


def test_directories_that_cannot_be_written_are_named(tmp_path):
    assert not_writable(tmp_path / "a" / "b") is None  # made when needed
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert not_writable(a_file / "run") == f"{a_file} is not a directory"
    assert not_writable(a_file) == f"{a_file} is not a directory"
    problems = prestart_problems(
        load_config(
            None,
            [
                "security.curve=true",
                f"security.keys_dir={tmp_path / 'nowhere'}",
                f"checkpoint.dir={a_file / 'checkpoints'}",
            ],
        ),
        a_file / "run",
    )
    assert problems == [
        f"config error: security.keys_dir: {tmp_path / 'nowhere'} does not exist (make it with "
        f"`hetps keys {tmp_path / 'nowhere'}`)",
        f"the run directory {a_file / 'run'} cannot be made: {a_file} is not a directory "
        "(choose another with --out)",
        f"config error: checkpoint.dir: shards cannot write to {a_file / 'checkpoints'}: {a_file} "
        "is not a directory",
    ]
    assert prestart_problems(load_config(None, []), tmp_path / "run") == []
    assert not (tmp_path / "run").exists()  # checked, not made


# a directory that exists and that nobody, root included, may write into (procfs): where the
# tests run as root, a folder's mode bits would not stop the write
UNWRITABLE = Path("/proc/self")


def test_an_existing_run_directory_that_cannot_be_written_is_said_to_be_not_writable(tmp_path):
    assert prestart_problems(load_config(None, []), UNWRITABLE) == [
        f"the run directory {UNWRITABLE} is not writable (choose another with --out)"
    ]


def scheduler(*args: str) -> subprocess.CompletedProcess:
    """`hetps scheduler ARGS` to its end (it imports no torch: a second or two)."""
    return subprocess.run(
        [sys.executable, "-m", "hetps.scheduler", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )


def test_a_scheduler_run_dir_that_cannot_be_made_or_written_is_one_line_exit_2(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    for run_dir, why in (
        (a_file / "run", f"cannot be made: {a_file} is not a directory"),
        (UNWRITABLE, "is not writable"),
    ):
        result = scheduler("--config", "configs/sync.yaml", "--run-dir", str(run_dir))
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [
            f"hetps scheduler: --run-dir {run_dir} {why}"
        ], result.stderr
