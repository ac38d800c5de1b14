"""CurveZMQ from the run's config: whether `security.curve` is on, which keys
directory (`security.keys_dir`, or $HETPS_KEYS_DIR), and, for `hetps run`,
keys of its own in the run directory. The sockets' side (key files, CURVE
options, the ZAP authenticator) is proto/security.py; this module only
decides what to hand it.

Process-global: `configure` once per daemon, before any socket is made.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from hetps.proto.security import (
    CurveKeys,
    SecurityError,
    load_keys,
    reset,
    use_keys,
    write_missing_keys,
)
from hetps.runconfig.schema import RunConfig, SecurityConfig


class KeysSettingError(SecurityError):
    """The keys directory the config or the environment names is missing or
    not a directory; the message starts with that setting
    (`security.keys_dir: ...` or `$HETPS_KEYS_DIR: ...`)."""


def resolve_keys_dir(sec: SecurityConfig) -> Path:
    """$HETPS_KEYS_DIR, else security.keys_dir; raises KeysSettingError, naming
    the setting and the path, when neither is set or the directory is missing."""
    env = os.environ.get("HETPS_KEYS_DIR")
    setting, chosen = ("$HETPS_KEYS_DIR", env) if env else ("security.keys_dir", sec.keys_dir)
    if not chosen:
        raise KeysSettingError(
            "security.keys_dir: security.curve is on but no keys directory is set: set "
            "security.keys_dir or $HETPS_KEYS_DIR (make one with `hetps keys DIR`)"
        )
    path = Path(chosen).expanduser()
    if not path.exists():
        raise KeysSettingError(
            f"{setting}: {path} does not exist (make it with `hetps keys {path}`)"
        )
    if not path.is_dir():
        raise KeysSettingError(
            f"{setting}: {path} is not a directory (make a keys directory with `hetps keys DIR`)"
        )
    return path


def configure(cfg: RunConfig, role: str, client_key: str | None = None) -> CurveKeys | None:
    """Turn curve on for every later socket of this process when
    cfg.security.curve is set (else off), with the keys `role` needs
    (`client_key`: a name under KEYS_DIR/clients or a .key_secret path;
    None: $HETPS_CLIENT_KEY, else client-0). Returns the keys, or None when
    off. Raises SecurityError naming a missing key. Call once, before any
    socket is made."""
    reset()  # off until the keys are read: a missing key leaves no earlier setting behind
    if not cfg.security.curve:
        return None
    return use_keys(load_keys(resolve_keys_dir(cfg.security), role, client_key))


def makes_own_keys(sec: SecurityConfig, keys_dir: Path) -> bool:
    """Whether `hetps run` makes the keys itself, in `keys_dir` (its run's):
    curve is on and no other keys directory is given (config or $HETPS_KEYS_DIR)."""
    if not sec.curve or os.environ.get("HETPS_KEYS_DIR"):
        return False
    return not sec.keys_dir or Path(sec.keys_dir).expanduser().resolve() == keys_dir.resolve()


def check_run_keys(cfg: RunConfig, keys_dir: Path) -> None:
    """For `hetps run` before it starts any process: with curve on and keys
    from elsewhere (not made in `keys_dir`, its run's), load what the
    scheduler, the shards and the other clients will load (every process of
    such a run uses the default client key: $HETPS_CLIENT_KEY, else
    client-0). Raises SecurityError (KeysSettingError for the directory)
    naming the setting or the file."""
    if not cfg.security.curve or makes_own_keys(cfg.security, keys_dir):
        return
    found = resolve_keys_dir(cfg.security)
    load_keys(found, "scheduler")  # the server pair and the allow-list
    load_keys(found, "worker")  # the server's public key and a client pair


def keys_for_run(cfg: RunConfig, keys_dir: Path, client_names: list[str]) -> tuple[RunConfig, bool]:
    """For `hetps run`: with curve on and no other keys directory given
    (config or $HETPS_KEYS_DIR), make sure `keys_dir` holds a server pair and
    one client pair per name (a rerun or resume in the same run directory
    reuses them), and return the config pointing there and True. Otherwise
    return the config unchanged and False. Not thread-safe (umask)."""
    sec = cfg.security
    if not makes_own_keys(sec, keys_dir):
        return cfg, False
    write_missing_keys(keys_dir, client_names)
    return replace(cfg, security=replace(sec, keys_dir=str(keys_dir.resolve()))), True
