"""CurveZMQ (security.curve): `hetps keys`, clear errors for missing keys,
and bytes in transit hidden and tamper-proof. Intruders at live daemons and
a whole `hetps run` with curve on: tests/cluster/test_security_cluster.py.

Real sockets on random loopback ports; every wait has a timeout; every
process is reaped.
"""

from __future__ import annotations

import faulthandler
import signal
import socket
import subprocess
import threading

import pytest
import zmq
import zmq.auth
from security_util import CONFIG, HANDSHAKE_S, REPLY_S, SILENCE_S, curve_keys, curve_overrides

from hetps.frontend.cli import main as hetps_main
from hetps.proto import security
from hetps.proto.transport import make_client, make_server
from hetps.runconfig.load import load_config
from hetps.runtime import curve_setup
from hetps.worker.__main__ import main as worker_main


@pytest.fixture
def keys_dir(tmp_path, monkeypatch):
    """A keys directory with client pairs client-0 and ps0; curve is off for
    this process again after the test, whatever it configured."""
    yield from curve_keys(tmp_path, monkeypatch)


# ---------------------------------------------------------------- hetps keys and missing keys


def run_hetps(capfd, args: list[str]) -> subprocess.CompletedProcess:
    """`hetps ARGS` in this process, curve off before it as in a fresh process: the command's
    entry point (`hetps worker`: the worker's own, which it hands over to), exit status and
    output (capfd: what reaches the file descriptors, as a subprocess's pipes would)."""
    security.reset()
    capfd.readouterr()
    try:
        code = worker_main(args[1:]) if args[0] == "worker" else hetps_main(args)
    except SystemExit as exc:  # a config or key error, --check
        code = exc.code
    finally:
        faulthandler.unregister(signal.SIGUSR1)  # the daemons' stack dump (runtime/daemon.py)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def test_keys_command_writes_pairs_allow_list_and_private_modes(tmp_path, capfd):
    keys = tmp_path / "k"
    result = run_hetps(capfd, ["keys", str(keys), "--clients", "3"])
    assert result.returncode == 0, result.stderr
    names = [f"client-{i}" for i in range(3)]
    secrets = [keys / "server.key_secret", *(keys / "clients" / f"{n}.key_secret" for n in names)]
    publics = [
        keys / "server.key",
        *(keys / "clients" / f"{n}.key" for n in names),
        *(keys / "authorized" / f"{n}.key" for n in names),
    ]
    for path in secrets:
        assert path.stat().st_mode & 0o777 == 0o600, path
        public, secret = zmq.auth.load_certificate(path)
        assert len(secret) == 40 and zmq.curve_public(secret) == public, path  # a real pair
    for path in publics:
        assert path.stat().st_mode & 0o777 == 0o644, path
        assert zmq.auth.load_certificate(path)[1] is None, f"{path} holds a secret"
    assert sorted(p.name for p in (keys / "authorized").iterdir()) == [f"{n}.key" for n in names]
    for n in names:  # the allow-list holds exactly the client public keys
        assert (
            zmq.auth.load_certificate(keys / "authorized" / f"{n}.key")[0]
            == zmq.auth.load_certificate(keys / "clients" / f"{n}.key_secret")[0]
        )
    all_keys = {zmq.auth.load_certificate(p)[0] for p in secrets}
    assert len(all_keys) == 4
    assert str(keys / "server.key_secret") in result.stdout
    again = run_hetps(capfd, ["keys", str(keys)])  # never overwrites
    assert again.returncode == 2 and "server.key_secret" in again.stderr, again.stderr
    assert {zmq.auth.load_certificate(p)[0] for p in secrets} == all_keys


def test_missing_keys_exit_2_naming_the_key(keys_dir, capfd):
    sched = "tcp://127.0.0.1:9"  # never contacted: --check stops before connecting
    (keys_dir / "server.key_secret").unlink()
    cases = [
        (["scheduler", "--config", CONFIG, "--check", "security.curve=true"], "security.keys_dir"),
        (
            [
                "scheduler",
                "--config",
                CONFIG,
                "--check",
                *curve_overrides(keys_dir.parent / "nowhere"),
            ],
            str(keys_dir.parent / "nowhere"),
        ),
        (
            ["scheduler", "--config", CONFIG, "--check", *curve_overrides(keys_dir)],
            str(keys_dir / "server.key_secret"),
        ),
        (
            [
                "worker",
                "--config",
                CONFIG,
                "--scheduler",
                sched,
                "--client-key",
                "nobody",
                "--check",
                *curve_overrides(keys_dir),
            ],
            str(keys_dir / "clients" / "nobody.key_secret"),
        ),
    ]
    for args, named in cases:
        result = run_hetps(capfd, args)
        assert result.returncode == 2, f"{args}: {result.returncode}\n{result.stderr}"
        assert named in result.stderr and "security" in result.stderr, result.stderr
    ok = run_hetps(
        capfd,
        [
            "worker",
            "--config",
            CONFIG,
            "--scheduler",
            sched,
            "--client-key",
            "ps0",
            "--check",
            *curve_overrides(keys_dir),
        ],
    )  # the control: a present key passes
    assert ok.returncode == 0, ok.stderr


# ---------------------------------------------------------------- bytes in transit


class Relay:
    """One TCP connection relayed through loopback, every byte recorded; with
    `tamper` set, the last byte of each later chunk from the client is flipped."""

    def __init__(self, target_port: int):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(HANDSHAKE_S)
        self.port = self.listener.getsockname()[1]
        self.target_port = target_port
        self.seen = bytearray()
        self.tamper = False
        self.done = threading.Event()
        self.conns: list[socket.socket] = []
        self.threads = [threading.Thread(target=self._serve, daemon=True)]
        self.threads[0].start()

    def _serve(self) -> None:
        try:
            client, _ = self.listener.accept()
            server = socket.create_connection(("127.0.0.1", self.target_port), timeout=HANDSHAKE_S)
        except OSError:
            return
        self.conns += [client, server]
        back = threading.Thread(target=self._pump, args=(server, client, False), daemon=True)
        self.threads.append(back)
        back.start()
        self._pump(client, server, True)

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        src.settimeout(0.1)
        while not self.done.is_set():
            try:
                chunk = src.recv(1 << 16)
            except socket.timeout:
                continue
            except OSError:
                return
            if not chunk:
                return
            self.seen += chunk
            if from_client and self.tamper:
                chunk = chunk[:-1] + bytes([chunk[-1] ^ 0xFF])
            try:
                dst.sendall(chunk)
            except OSError:
                return

    def close(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(timeout=5)
        for s in [self.listener, *self.conns]:
            s.close()


@pytest.mark.parametrize("curve", [False, True], ids=["plaintext", "curve"])
def test_curve_hides_and_guards_bytes_in_transit(curve, keys_dir):
    if curve:
        # this process is the server and the client
        curve_setup.configure(load_config(None, curve_overrides(keys_dir)), "ps")
    server = make_server("tcp://127.0.0.1:0")
    relay = Relay(int(server.address.rsplit(":", 1)[1]))
    client = make_client(f"tcp://127.0.0.1:{relay.port}")
    try:
        marker = b"hetps-marker-must-not-be-readable-on-the-wire" * 3
        client.send([marker])
        got = server.recv(REPLY_S)
        assert got is not None and bytes(got[1][0]) == marker
        assert (marker in relay.seen) is (not curve)  # plaintext is readable; curve is not
        relay.tamper = True
        client.send([marker])
        got = server.recv(SILENCE_S if curve else REPLY_S)
        if curve:
            assert got is None, "a tampered curve message was delivered"
        else:
            # plaintext: altered and delivered
            assert got is not None and bytes(got[1][0]) != marker
    finally:
        client.close()
        relay.close()
        server.close()
