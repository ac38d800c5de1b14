"""CurveZMQ (security.curve) with real processes: unknown and plaintext
clients refused by a live scheduler and shard without a reply or a state
change, and a whole `hetps run` training to its target with curve on. (The
keys, errors and bytes in transit: tests/inproc/test_security.py.)

Real processes on random loopback ports; every wait has a timeout; every
process is reaped. Raw DEALER sockets (outside hetps's transport) play the
intruders, and the same raw socket with an allowed key is the control that
shows the intruders were refused for their key, not for a wrong address.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import zmq
import zmq.auth
from cluster_util import Daemons, log_tails, run_hetps, summary
from security_util import CONFIG, HANDSHAKE_S, REPLY_S, SILENCE_S, curve_keys, curve_overrides
from shard_harness import tiny_model
from zmq.utils.monitor import recv_monitor_message

from hetps.proto.codec import decode, encode
from hetps.proto.messages import Ack, Heartbeat, Init, Params, Pull, Push, Stop
from hetps.proto.plan import schema_hash
from hetps.proto.records import NodeStats
from hetps.proto.rpc import RpcClient
from hetps.runconfig.load import load_config
from hetps.runtime import curve_setup
from hetps.runtime.membership import Membership
from hetps.training.state import model_specs, model_tensors

EXIT_S = 30.0


@pytest.fixture
def keys_dir(tmp_path, monkeypatch):
    """A keys directory with client pairs client-0 and ps0; curve is off for
    this process again after the test, whatever it configured."""
    yield from curve_keys(tmp_path, monkeypatch)


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


@pytest.mark.cluster
def test_unknown_and_plaintext_clients_get_nothing_and_change_nothing(keys_dir, run_dir, tmp_path):
    overrides = [
        "cluster.workers=1",
        "cluster.shards=1",
        "eval.enabled=false",
        "stop.target_accuracy=null",
        "stop.max_seconds=120",
        "cluster.dead_after_s=120",
        f"cluster.request_timeout_s={REPLY_S}",
        *curve_overrides(keys_dir),
    ]
    daemons = Daemons(tmp_path, overrides)
    closers = []
    try:
        sched = daemons.scheduler(CONFIG, run_dir)
        daemons.start(
            ["ps", "--config", CONFIG, "--rank", "0", "--scheduler", sched, "--client-key", "ps0"]
        )
        cfg = load_config(CONFIG, overrides)
        curve_setup.configure(cfg, "worker", "client-0")  # this test is the one allowed worker
        model = tiny_model(batchnorm=False)
        specs = model_specs(model)
        member = Membership(sched, "worker", 0, cfg.cluster)
        closers.append(member.close)
        node = member.join(tensor_specs=specs, schema_hash=schema_hash(specs))
        plan = member.wait_plan()
        shard_addr = plan.shards[0].address
        shard = RpcClient(shard_addr, src=node, timeout_s=REPLY_S)
        closers.append(shard.close)
        values = {n: t.detach().clone() for n, (t, _) in model_tensors(model).items()}
        assert isinstance(shard.call(Init(plan_id=plan.plan_id, tensors=values)), Ack)
        grads = {n: torch.full_like(t, 0.5) for n, t in values.items()}
        push = Push(plan_id=plan.plan_id, clock=0, base_version=0, tensors=grads)
        allowed = zmq.auth.load_certificate(keys_dir / "clients" / "client-0.key_secret")

        outcome, reply = probe(
            shard_addr, keys_dir, allowed, Pull(plan_id=plan.plan_id, clock=0), node
        )
        # control
        assert outcome == "HANDSHAKE_SUCCEEDED" and isinstance(reply, Params), (outcome, reply)
        # an unknown key is refused by the allow-list; no curve at all fails the handshake (mechanism
        # mismatch, or the server hanging up on it)
        for who, pair, refused in (
            ("unknown key", zmq.curve_keypair(), "HANDSHAKE_FAILED_AUTH"),
            ("no curve", None, "HANDSHAKE_FAILED_"),
        ):
            for msg in (push, Pull(plan_id=plan.plan_id, clock=0)):
                outcome, reply = probe(shard_addr, keys_dir, pair, msg, node)
                assert outcome.startswith(refused) and reply is None, (
                    f"shard, {who}, {msg.OP.name}: {outcome}"
                )
            outcome, reply = probe(sched, keys_dir, pair, Stop(reason="intruder"), node)
            assert outcome.startswith(refused) and reply is None, f"scheduler, {who}: {outcome}"
            current = shard.call(Pull(plan_id=plan.plan_id, clock=0))
            assert isinstance(current, Params) and current.version == 0, who
            for n, t in values.items():
                assert torch.equal(current.tensors[n], t), f"{who}: {n} changed"
            ack = member.rpc.call(
                Heartbeat(node_id=node, stats=NodeStats(steps=1)), timeout_s=REPLY_S
            )
            assert isinstance(ack, Ack) and ack.stop is False and ack.plan_id == plan.plan_id, who

        ack = shard.call(push)  # an allowed push is still served and applied
        assert isinstance(ack, Ack) and ack.version == 1
        after = shard.call(Pull(plan_id=plan.plan_id, clock=1))
        torch.testing.assert_close(
            after.tensors[specs[0].name], values[specs[0].name] - cfg.optimizer.lr * 0.5
        )
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
    result = run_hetps(
        [
            "run",
            "configs/sync.yaml",
            "security.curve=true",
            "stop.target_accuracy=0.9",
            "stop.max_seconds=60",
            "eval.every_s=1.0",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        timeout_s=180,
    )
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
