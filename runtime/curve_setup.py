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


def resolve_keys_dir(sec: SecurityConfig) -> Path:
    """$HETPS_KEYS_DIR, else security.keys_dir; raises SecurityError when
    neither is set or the directory does not exist."""
    chosen = os.environ.get("HETPS_KEYS_DIR") or sec.keys_dir
    if not chosen:
        raise SecurityError(
            "security.curve is on but no keys directory: set security.keys_dir or "
            "$HETPS_KEYS_DIR (make one with `hetps keys DIR`)"
        )
    path = Path(chosen).expanduser()
    if not path.is_dir():
        raise SecurityError(f"keys directory {path} not found (make one with `hetps keys {path}`)")
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


def keys_for_run(cfg: RunConfig, keys_dir: Path, client_names: list[str]) -> tuple[RunConfig, bool]:
    """For `hetps run`: with curve on and no other keys directory given
    (config or $HETPS_KEYS_DIR), make sure `keys_dir` holds a server pair and
    one client pair per name (a rerun or resume in the same run directory
    reuses them), and return the config pointing there and True. Otherwise
    return the config unchanged and False. Not thread-safe (umask)."""
    sec = cfg.security
    if not sec.curve or os.environ.get("HETPS_KEYS_DIR"):
        return cfg, False
    if sec.keys_dir and Path(sec.keys_dir).expanduser().resolve() != keys_dir.resolve():
        return cfg, False
    write_missing_keys(keys_dir, client_names)
    return replace(cfg, security=replace(sec, keys_dir=str(keys_dir.resolve()))), True
