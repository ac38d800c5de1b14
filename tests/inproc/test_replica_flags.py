"""`hetps ps --replica-bind/--replica-advertise` (and $HETPS_REPLICA_BIND,
$HETPS_REPLICA_ADVERTISE): where the backup a shard holds binds, and the
address it registers for its primary to forward to. In one process: the
shard daemon's main() against a scheduler played on the in-memory transport."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch
from cluster_util import REPO

from hetps.proto.codec import decode, encode
from hetps.proto.messages import Error, Register, Status
from hetps.proto.transport import MemServer
from hetps.ps.__main__ import main

CONFIG = str(REPO / "configs" / "sync.yaml")
SCHED = "tcp://scheduler:7000"  # never contacted: --check stops before connecting


# main() in this process: its SIGUSR1 stack dump undone after each test (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("no_stack_dump_handler_left")


def check(capfd, *flags: str) -> tuple[int, str, str]:
    """Run `hetps ps ... --check` in this process: (exit status, stdout, stderr)."""
    with pytest.raises(SystemExit) as ended:
        main(["--config", CONFIG, "--scheduler", SCHED, "--check", *flags])
    out = capfd.readouterr()
    return ended.value.code, out.out, out.err


def test_check_shows_the_replica_addresses_used_with_replicas(capfd):
    code, out, _ = check(
        capfd,
        "--replica-bind",
        "tcp://0.0.0.0:7101",
        "--replica-advertise",
        "tcp://ps1:7101",
        "cluster.replicas=1",
        "cluster.shards=2",
    )
    assert code == 0
    assert "replicas=1 replica_bind=tcp://0.0.0.0:7101 replica_advertise=tcp://ps1:7101" in out


def test_replica_flags_come_from_the_environment_and_default_to_a_random_port(capfd, monkeypatch):
    monkeypatch.setenv("HETPS_REPLICA_ADVERTISE", "tcp://ps0:7101")
    monkeypatch.setenv("HETPS_REPLICA_BIND", "tcp://0.0.0.0:7101")
    code, out, _ = check(capfd, "cluster.replicas=1", "cluster.shards=2")
    assert code == 0 and "replica_bind=tcp://0.0.0.0:7101 replica_advertise=tcp://ps0:7101" in out
    monkeypatch.delenv("HETPS_REPLICA_ADVERTISE")
    monkeypatch.delenv("HETPS_REPLICA_BIND")
    code, out, _ = check(capfd, "cluster.replicas=1", "cluster.shards=2", "cluster.host=10.1.2.3")
    assert code == 0 and "replica_bind=tcp://10.1.2.3:0 replica_advertise=None" in out


def test_without_replicas_the_replica_flags_are_ignored(capfd):
    """One manifest for both: the flags bind nothing when cluster.replicas is 0."""
    code, out, _ = check(
        capfd, "--replica-bind", "tcp://0.0.0.0:7101", "--replica-advertise", "tcp://ps1:7101"
    )
    assert code == 0 and "replicas=0 replica_bind=None" in out


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--replica-advertise", "tcp://ps1:7101"], "needs --replica-bind with a fixed port"),
        (
            ["--replica-bind", "tcp://0.0.0.0:0", "--replica-advertise", "tcp://ps1:7101"],
            "tcp://0.0.0.0:0",
        ),
        (
            ["--replica-bind", "tcp://0.0.0.0:7101", "--replica-advertise", "tcp://ps1:0"],
            "port 0 cannot be reached",
        ),
    ],
)
def test_an_advertised_replica_address_other_shards_cannot_reach_exits_2(capfd, flags, named):
    code, out, err = check(capfd, *flags, "cluster.replicas=1", "cluster.shards=2")
    assert code == 2 and "--replica-advertise" in err and named in err, err
    assert ": ok" not in out


def test_register_carries_the_advertised_replica_address():
    """The shard daemon registers its own --advertise and --replica-advertise;
    the backup's socket is bound at --replica-bind (in-memory here: no port to pick). The scheduler (played here)
    refuses the registration, so the daemon exits 1 without serving."""
    sched = f"mem://replica-flags-{uuid.uuid4().hex[:8]}"
    server = MemServer(sched)
    seen: list[Register] = []

    def scheduler() -> None:
        # an upper bound: the daemon registers once it profiled its update speed
        got = server.recv(30.0)
        if got is None:
            return
        peer, frames = got
        env = decode(frames)
        seen.append(env.msg)
        server.send(
            peer, encode(Error(status=int(Status.BAD_STATE), message="test: refused"), env.req_id)
        )

    thread = threading.Thread(target=scheduler, daemon=True)
    thread.start()
    threads = torch.get_num_threads()  # the daemon sets its node's threads for this whole process
    try:
        code = main(
            [
                "--config",
                CONFIG,
                "--scheduler",
                sched,
                "--bind",
                f"{sched}-shard",
                "--advertise",
                "tcp://ps7.example:7100",
                "--replica-bind",
                f"{sched}-backup",
                "--replica-advertise",
                "tcp://ps7.example:7101",
                "cluster.replicas=1",
                "cluster.shards=2",
                "cluster.profile_steps=1",
                "cluster.startup_timeout_s=30",
            ]
        )
    finally:
        torch.set_num_threads(threads)
        thread.join(timeout=40)
        server.close()
    assert code == 1
    assert len(seen) == 1 and isinstance(seen[0], Register)
    assert seen[0].address == "tcp://ps7.example:7100"
    assert seen[0].replica_address == "tcp://ps7.example:7101"
