"""CurveZMQ on every ZeroMQ socket of a process, the socket side: key pairs
on disk, applying CURVE options to sockets, and the ZAP authenticator that
checks client public keys against an allow-list.

This is a trust boundary. With `security.curve: true` a server socket (the
scheduler's, each shard's) accepts only clients whose public key is in the
allow-list; a client that fails the handshake never reaches the decoder, so
it gets no reply and changes no state.

A keys directory, as `hetps keys DIR --clients N` writes it:

    DIR/server.key, DIR/server.key_secret          the cluster's server key pair (every server)
    DIR/clients/NAME.key, NAME.key_secret          one key pair per client (client-0 ... client-N-1)
    DIR/authorized/NAME.key                        the allow-list: client public keys only

Which keys a process needs follows from its role: the scheduler the server
pair and the allow-list; a shard those and a client pair (it is a client of
the scheduler); workers and the evaluator a client pair and the server's
public key. A process picks its client pair with `--client-key NAME` or
$HETPS_CLIENT_KEY (a name under DIR/clients, or a path to a .key_secret file;
default `client-0`). Which directory, and whether curve is on at all, the
run's config says: runtime/curve_setup.py reads it (security.curve,
security.keys_dir or $HETPS_KEYS_DIR) and calls `load_keys` and `use_keys`.

Process-global, unlike the other socket settings (transport.py's
TransportOptions): one CurveZMQ identity per process, as the ZAP
authenticator belongs to the process's ZeroMQ context anyway. `use_keys`
once per daemon, before any socket exists; `transport` then calls
`secure_socket` on every socket it creates. Not meant to be changed while
sockets are open.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from .errors import HetpsError

log = logging.getLogger(__name__)

SERVER_NAME = "server"
CLIENTS_DIR = "clients"
ALLOW_DIR = "authorized"
DEFAULT_CLIENT = "client-0"
SERVER_ROLES = frozenset({"scheduler", "ps"})
CLIENT_ROLES = frozenset({"ps", "worker", "evaluator"})


class SecurityError(HetpsError):
    """Curve is on but a key or the keys directory is missing or unusable; the
    message names the path."""


@dataclass(frozen=True)
class CurveKeys:
    """What one process needs: always the server's public key; servers also
    its secret key and the allow-list; clients their own key pair."""

    keys_dir: Path
    server_public: bytes
    server_secret: bytes | None = field(default=None, repr=False)
    allow_dir: Path | None = None
    allowed: int = 0
    client_name: str = ""
    client_public: bytes | None = None
    client_secret: bytes | None = field(default=None, repr=False)


# ---------------------------------------------------------------- writing keys


def write_keys(keys_dir: Path, client_names: list[str]) -> list[Path]:
    """Write the server key pair and one client key pair per name, plus the
    allow-list of client public keys; secret files get mode 0600 (created
    under umask 077, so never readable by others). Refuses to overwrite an
    existing server key. Returns the files written. Not thread-safe (umask)."""
    if (keys_dir / f"{SERVER_NAME}.key_secret").exists():
        raise SecurityError(
            f"{keys_dir / (SERVER_NAME + '.key_secret')} already exists; "
            "not overwriting keys (remove the directory or pick another)"
        )
    return write_missing_keys(keys_dir, client_names)


def write_missing_keys(keys_dir: Path, client_names: list[str]) -> list[Path]:
    """Write the server pair and the named client pairs that `keys_dir` lacks
    (with their allow-list entries), modes as `write_keys`; an existing
    pair is kept. Returns the files written. Not thread-safe (umask)."""
    keys_dir.parent.mkdir(parents=True, exist_ok=True)  # parents with the usual modes
    written: list[Path] = []
    old_umask = os.umask(0o077)
    try:
        for sub in (keys_dir, keys_dir / CLIENTS_DIR, keys_dir / ALLOW_DIR):
            sub.mkdir(exist_ok=True)
        if not (keys_dir / f"{SERVER_NAME}.key_secret").exists():
            written += [Path(p) for p in zmq.auth.create_certificates(keys_dir, SERVER_NAME)]
        for name in client_names:
            if (keys_dir / CLIENTS_DIR / f"{name}.key_secret").exists():
                continue
            public, secret = zmq.auth.create_certificates(keys_dir / CLIENTS_DIR, name)
            allowed = keys_dir / ALLOW_DIR / f"{name}.key"
            allowed.write_bytes(Path(public).read_bytes())
            written += [Path(public), Path(secret), allowed]
    finally:
        os.umask(old_umask)
    for path in written:  # public keys may be read by anyone; secrets stay 0600
        path.chmod(0o600 if path.name.endswith(".key_secret") else 0o644)
    return written


# ---------------------------------------------------------------- loading keys


def _key_pair(path: Path, what: str) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise SecurityError(f"{what} {path}: {exc}") from None
    if secret is not None and path.stat().st_mode & 0o077:
        log.warning("secret key %s is readable by group or others (chmod 600 it)", path)
    return public, secret


def _secret_pair(path: Path, what: str) -> tuple[bytes, bytes]:
    if not path.is_file():
        raise SecurityError(f"{what} {path} not found (make keys with `hetps keys DIR`)")
    public, secret = _key_pair(path, what)
    if secret is None:
        raise SecurityError(f"{what} {path} holds no secret key")
    return public, secret


def client_key_path(keys_dir: Path, client_key: str | None) -> Path:
    """A client key given as a path (has a '/' or ends in .key_secret) or as
    a name under DIR/clients; None means $HETPS_CLIENT_KEY, else client-0."""
    chosen = client_key or os.environ.get("HETPS_CLIENT_KEY") or DEFAULT_CLIENT
    if "/" in chosen or chosen.endswith(".key_secret"):
        return Path(chosen).expanduser()
    return keys_dir / CLIENTS_DIR / f"{chosen}.key_secret"


def _allow_list(keys_dir: Path) -> tuple[Path, int]:
    allow_dir = keys_dir / ALLOW_DIR
    if not allow_dir.is_dir():
        raise SecurityError(
            f"allow-list directory {allow_dir} not found (make keys with `hetps keys DIR`)"
        )
    count = len(zmq.auth.load_certificates(allow_dir))
    if count == 0:
        raise SecurityError(f"allow-list {allow_dir} holds no client public keys (*.key)")
    return allow_dir, count


def load_keys(keys_dir: Path, role: str, client_key: str | None = None) -> CurveKeys:
    """The keys `role` needs from the keys directory `keys_dir`, read and
    checked now: servers (SERVER_ROLES) the server pair and the allow-list,
    clients (CLIENT_ROLES) the pair `client_key` names (`client_key_path`).
    Raises SecurityError naming the missing or unusable file."""
    if not zmq.has("curve"):
        raise SecurityError(f"this libzmq ({zmq.zmq_version()}) was built without CURVE support")
    if not keys_dir.is_dir():
        raise SecurityError(
            f"keys directory {keys_dir} not found (make one with `hetps keys {keys_dir}`)"
        )
    server_file = keys_dir / f"{SERVER_NAME}.key"
    keys = CurveKeys(keys_dir, server_public=b"")
    if role in SERVER_ROLES:
        public, secret = _secret_pair(keys_dir / f"{SERVER_NAME}.key_secret", "server secret key")
        allow_dir, allowed = _allow_list(keys_dir)
        keys = replace(
            keys, server_public=public, server_secret=secret, allow_dir=allow_dir, allowed=allowed
        )
    else:
        if not server_file.is_file():
            raise SecurityError(
                f"server public key {server_file} not found (make keys with `hetps keys DIR`)"
            )
        keys = replace(keys, server_public=_key_pair(server_file, "server public key")[0])
    if role in CLIENT_ROLES:
        path = client_key_path(keys_dir, client_key)
        public, secret = _secret_pair(path, "client secret key")
        keys = replace(
            keys,
            client_name=path.name.removesuffix(".key_secret"),
            client_public=public,
            client_secret=secret,
        )
    return keys


# ---------------------------------------------------------------- process state

_KEYS: list[CurveKeys] = []  # this process's keys, when curve is on
_AUTH: list[ThreadAuthenticator] = []  # started with the first server socket
_LOCK = threading.Lock()
atexit.register(lambda: reset())  # stop the authenticator's thread before the interpreter goes


def use_keys(keys: CurveKeys | None) -> CurveKeys | None:
    """Curve on with `keys` for every later ZeroMQ socket of this process
    (None: off); returns `keys`. Call once, before any socket is made
    (runtime/curve_setup.py `configure` does, from the config)."""
    reset()
    if keys is None:
        return None
    _KEYS.append(keys)
    sides = ([f"server, {keys.allowed} allowed client keys"] if keys.server_secret else []) + (
        [f"client key {keys.client_name}"] if keys.client_secret else []
    )
    log.info("CurveZMQ on (keys %s): %s", keys.keys_dir, "; ".join(sides))
    return keys


def reset() -> None:
    """Curve off for later sockets; the authenticator, if running, stops."""
    with _LOCK:
        _KEYS.clear()
        while _AUTH:
            _AUTH.pop().stop()


def _start_authenticator(keys: CurveKeys) -> None:
    with _LOCK:
        if _AUTH:
            return
        auth = ThreadAuthenticator(zmq.Context.instance())
        auth.start()
        auth.configure_curve(domain="*", location=str(keys.allow_dir))
        _AUTH.append(auth)


def secure_socket(sock: zmq.Socket, server: bool) -> None:
    """Apply this process's curve settings to a new socket, before it binds
    (`server`) or connects. No-op when curve is off. Raises SecurityError when
    the process's role lacks the keys for that side."""
    if not _KEYS:
        return
    keys = _KEYS[0]
    if server:
        if keys.server_secret is None:
            raise SecurityError(
                f"curve is on but this process has no server secret key "
                f"({keys.keys_dir / (SERVER_NAME + '.key_secret')})"
            )
        _start_authenticator(keys)
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
        sock.curve_server = True
        return
    if keys.client_secret is None:
        raise SecurityError(
            f"curve is on but this process has no client key "
            f"(--client-key or $HETPS_CLIENT_KEY under {keys.keys_dir / CLIENTS_DIR})"
        )
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public
