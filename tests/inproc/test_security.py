"""CurveZMQ (security.curve): `hetps keys`, clear errors for missing keys,
bytes in transit hidden and tamper-proof, unknown and plaintext clients
refused by a live scheduler and shard without a reply or a state change,
and a whole `hetps run` training to its target with curve on.

Real sockets on random loopback ports; every wait has a timeout; every
process is reaped. Raw DEALER sockets (outside hetps's transport) play the
intruders, and the same raw socket with an allowed key is the control that
shows the intruders were refused for their key, not for a wrong address.
"""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
import zmq.auth
from torch import nn
from zmq.utils.monitor import recv_monitor_message

from cluster_util import REPO, Daemons, log_tails, run_hetps, summary
from hetps.proto import security
from hetps.proto.codec import decode, encode
from hetps.runconfig.schema import load_config
from hetps.runtime.membership import Membership
from hetps.proto.messages import Ack, Heartbeat, Init, Params, Pull, Push, Stop
from hetps.proto.plan import schema_hash
from hetps.proto.rpc import RpcClient
from hetps.proto.transport import make_client, make_server
from hetps.worker.state import model_specs, model_tensors

CONFIG = str(REPO / "configs/default.yaml")
REPLY_S = 5.0       # any reply that must come
SILENCE_S = 1.5     # how long a reply that must NOT come is waited for
HANDSHAKE_S = 10.0  # a handshake's outcome
EXIT_S = 30.0


@pytest.fixture
def keys_dir(tmp_path, monkeypatch):
    """A keys directory with client pairs client-0 and ps0; curve is off for
    this process again after the test, whatever it configured."""
    monkeypatch.delenv("HETPS_KEYS_DIR", raising=False)
    monkeypatch.delenv("HETPS_CLIENT_KEY", raising=False)
    path = tmp_path / "keys"
    security.write_keys(path, ["client-0", "ps0"])
    yield path
    security.reset()


def curve_overrides(keys: Path) -> list[str]:
    return ["security.curve=true", f"security.keys_dir={keys}"]


# ---------------------------------------------------------------- hetps keys and missing keys


def test_keys_command_writes_pairs_allow_list_and_private_modes(tmp_path):
    keys = tmp_path / "k"
    result = run_hetps(["keys", str(keys), "--clients", "3"], timeout_s=60)
    assert result.returncode == 0, result.stderr
    names = [f"client-{i}" for i in range(3)]
    secrets = [keys / "server.key_secret", *(keys / "clients" / f"{n}.key_secret" for n in names)]
    publics = [keys / "server.key", *(keys / "clients" / f"{n}.key" for n in names),
               *(keys / "authorized" / f"{n}.key" for n in names)]
    for path in secrets:
        assert path.stat().st_mode & 0o777 == 0o600, path
        public, secret = zmq.auth.load_certificate(path)
        assert len(secret) == 40 and zmq.curve_public(secret) == public, path  # a real pair
    for path in publics:
        assert path.stat().st_mode & 0o777 == 0o644, path
        assert zmq.auth.load_certificate(path)[1] is None, f"{path} holds a secret"
    assert sorted(p.name for p in (keys / "authorized").iterdir()) == [f"{n}.key" for n in names]
    for n in names:  # the allow-list holds exactly the client public keys
        assert (zmq.auth.load_certificate(keys / "authorized" / f"{n}.key")[0]
                == zmq.auth.load_certificate(keys / "clients" / f"{n}.key_secret")[0])
    all_keys = {zmq.auth.load_certificate(p)[0] for p in secrets}
    assert len(all_keys) == 4
    assert str(keys / "server.key_secret") in result.stdout
    again = run_hetps(["keys", str(keys)], timeout_s=60)  # never overwrites
    assert again.returncode == 2 and "server.key_secret" in again.stderr, again.stderr
    assert {zmq.auth.load_certificate(p)[0] for p in secrets} == all_keys


def test_missing_keys_exit_2_naming_the_key(keys_dir):
    sched = "tcp://127.0.0.1:9"  # never contacted: --check stops before connecting
    (keys_dir / "server.key_secret").unlink()
    cases = [
        (["scheduler", "--config", CONFIG, "--check", "security.curve=true"], "security.keys_dir"),
        (["scheduler", "--config", CONFIG, "--check", *curve_overrides(keys_dir.parent / "nowhere")],
         str(keys_dir.parent / "nowhere")),
        (["scheduler", "--config", CONFIG, "--check", *curve_overrides(keys_dir)],
         str(keys_dir / "server.key_secret")),
        (["worker", "--config", CONFIG, "--scheduler", sched, "--client-key", "nobody", "--check",
          *curve_overrides(keys_dir)], str(keys_dir / "clients" / "nobody.key_secret")),
    ]
    for args, named in cases:
        result = run_hetps(args, timeout_s=120)
        assert result.returncode == 2, f"{args}: {result.returncode}\n{result.stderr}"
        assert named in result.stderr and "security" in result.stderr, result.stderr
    ok = run_hetps(["worker", "--config", CONFIG, "--scheduler", sched, "--client-key", "ps0", "--check",
                    *curve_overrides(keys_dir)], timeout_s=120)  # the control: a present key passes
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
        security.configure(load_config(None, curve_overrides(keys_dir)), "ps")  # server and client here
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
            assert got is not None and bytes(got[1][0]) != marker  # plaintext: altered and delivered
    finally:
        client.close()
        relay.close()
        server.close()


# ---------------------------------------------------------------- intruders at live daemons


class RawPeer:
    """A DEALER outside hetps's transport with any key pair (None: no curve at
    all), and a monitor reporting how its handshake ended."""

    def __init__(self, address: str, server_public: bytes, pair: tuple[bytes, bytes] | None):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if pair is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey = pair
            self.sock.curve_serverkey = server_public
        self.monitor = self.sock.get_monitor_socket()
        self.sock.connect(address)

    def handshake(self) -> str:
        """The first HANDSHAKE_* event's name."""
        deadline = time.monotonic() + HANDSHAKE_S
        while time.monotonic() < deadline:
            if self.monitor.poll(100):
                name = zmq.Event(recv_monitor_message(self.monitor)["event"]).name
                if name.startswith("HANDSHAKE"):
                    return name
        raise AssertionError(f"no handshake outcome within {HANDSHAKE_S}s")

    def send(self, msg, src: int) -> None:
        self.sock.send_multipart(encode(msg, req_id=77, src=src), copy=False)

    def reply(self, timeout_s: float):
        """The decoded reply, or None when none came within `timeout_s`."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return decode(self.sock.recv_multipart()).msg

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


def probe(address: str, keys: Path, pair: tuple[bytes, bytes] | None, msg, src: int):
    """(handshake outcome, reply or None) for `msg` sent by a raw peer with `pair`."""
    peer = RawPeer(address, zmq.auth.load_certificate(keys / "server.key")[0], pair)
    try:
        peer.send(msg, src)  # queued until the handshake is done
        outcome = peer.handshake()
        return outcome, peer.reply(REPLY_S if outcome == "HANDSHAKE_SUCCEEDED" else SILENCE_S)
    finally:
        peer.close()


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


@pytest.mark.cluster
def test_unknown_and_plaintext_clients_get_nothing_and_change_nothing(keys_dir, run_dir, tmp_path):
    overrides = ["cluster.workers=1", "cluster.shards=1", "eval.enabled=false", "stop.target_accuracy=null",
                 "stop.max_seconds=120", "cluster.dead_after_s=120", f"cluster.request_timeout_s={REPLY_S}",
                 *curve_overrides(keys_dir)]
    daemons = Daemons(tmp_path, overrides)
    closers = []
    try:
        sched = daemons.scheduler(CONFIG, run_dir)
        daemons.start(["ps", "--config", CONFIG, "--rank", "0", "--scheduler", sched, "--client-key", "ps0"])
        cfg = load_config(CONFIG, overrides)
        security.configure(cfg, "worker", "client-0")  # this test is the one allowed worker
        model = tiny_model()
        specs = model_specs(model)
        member = Membership(sched, "worker", 0, cfg.cluster)
        closers.append(member.close)
        node = member.join(tensor_specs=[s.to_wire() for s in specs], schema_hash=schema_hash(specs))
        plan = member.wait_plan()
        shard_addr = plan.shards[0].address
        shard = RpcClient(shard_addr, src=node, timeout_s=REPLY_S)
        closers.append(shard.close)
        values = {n: t.detach().clone() for n, (t, _) in model_tensors(model).items()}
        assert isinstance(shard.call(Init(plan_id=plan.plan_id, tensors=values)), Ack)
        grads = {n: torch.full_like(t, 0.5) for n, t in values.items()}
        push = Push(plan_id=plan.plan_id, clock=0, base_version=0, tensors=grads)
        allowed = zmq.auth.load_certificate(keys_dir / "clients" / "client-0.key_secret")

        outcome, reply = probe(shard_addr, keys_dir, allowed, Pull(plan_id=plan.plan_id, clock=0), node)
        assert outcome == "HANDSHAKE_SUCCEEDED" and isinstance(reply, Params), (outcome, reply)  # control
        # an unknown key is refused by the allow-list; no curve at all fails the handshake (mechanism
        # mismatch, or the server hanging up on it)
        for who, pair, refused in (("unknown key", zmq.curve_keypair(), "HANDSHAKE_FAILED_AUTH"),
                                   ("no curve", None, "HANDSHAKE_FAILED_")):
            for msg in (push, Pull(plan_id=plan.plan_id, clock=0)):
                outcome, reply = probe(shard_addr, keys_dir, pair, msg, node)
                assert outcome.startswith(refused) and reply is None, f"shard, {who}, {msg.OP.name}: {outcome}"
            outcome, reply = probe(sched, keys_dir, pair, Stop(reason="intruder"), node)
            assert outcome.startswith(refused) and reply is None, f"scheduler, {who}: {outcome}"
            current = shard.call(Pull(plan_id=plan.plan_id, clock=0))
            assert isinstance(current, Params) and current.version == 0, who
            for n, t in values.items():
                assert torch.equal(current.tensors[n], t), f"{who}: {n} changed"
            ack = member.rpc.call(Heartbeat(node_id=node, stats={"steps": 1}), timeout_s=REPLY_S)
            assert isinstance(ack, Ack) and ack.stop is False and ack.plan_id == plan.plan_id, who

        ack = shard.call(push)  # an allowed push is still served and applied
        assert isinstance(ack, Ack) and ack.version == 1
        after = shard.call(Pull(plan_id=plan.plan_id, clock=1))
        torch.testing.assert_close(after.tensors[specs[0].name], values[specs[0].name] - cfg.optimizer.lr * 0.5)
        ctl = RpcClient(sched, timeout_s=REPLY_S)
        closers.append(ctl.close)
        assert ctl.call(Stop(reason="test done")).stop is True
        member.bye({"steps": 1}, timeout_s=REPLY_S)
        codes = daemons.wait(EXIT_S)
        assert codes == [0, 0], f"{codes}\n{daemons.tails()}"
    finally:
        for close in reversed(closers):
            close()
        daemons.close()
    s = summary(run_dir)
    assert s["stop_reason"] == "test done" and s["shard_versions"] == {"ps0": 1}, s
    assert s["not_left"] == [] and s["failures"] == [], s


# ---------------------------------------------------------------- a whole run


@pytest.mark.cluster
def test_hetps_run_with_curve_trains_to_target(run_dir, monkeypatch):
    monkeypatch.delenv("HETPS_KEYS_DIR", raising=False)
    result = run_hetps(["run", "configs/sync.yaml", "security.curve=true", "stop.target_accuracy=0.9",
                        "stop.max_seconds=60", "eval.every_s=1.0", "--out", str(run_dir), "--quiet"],
                       timeout_s=180)
    assert result.returncode == 0, result.stderr + log_tails(run_dir)
    s = summary(run_dir)
    assert s["time_to_target_s"] is not None and s["best_accuracy"] >= 0.9, s
    assert s["failures"] == [] and s["not_left"] == []
    keys = run_dir / "keys"  # made by `hetps run`, one client key per process
    names = ["evaluator", "ps0", "ps1", "worker0", "worker1", "worker2", "worker3"]
    assert sorted(p.stem for p in (keys / "authorized").glob("*.key")) == names
    assert (keys / "server.key_secret").stat().st_mode & 0o777 == 0o600
    assert f"keys_dir: {keys.resolve()}" in (run_dir / "config.yaml").read_text()
    for name in ["scheduler", *names]:
        log = (run_dir / "logs" / f"{name}.log").read_text()
        assert "CurveZMQ on" in log, name
        assert name == "scheduler" or f"client key {name}" in log, name
