"""Several shard ranks in one process (`hetps ps --ranks`, cluster.shard_processes)
and the local run's socket addresses (comm.local_transport). In one process:
the real coordinator and the real shard daemon's main() on the in-memory
transport, a worker played with the real Membership and PSClient (a real
`hetps run`: tests/cluster/test_cluster_colocated.py)."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest
import torch
from cluster_util import REPO
from shard_harness import tiny_model

from hetps.frontend.local_sockets import (
    UNIX_PATH_MAX,
    LocalSockets,
    process_name,
    shard_groups,
    shard_process,
)
from hetps.proto import security
from hetps.proto.plan import schema_hash
from hetps.proto.transport import MemServer, make_client, make_server
from hetps.ps.__main__ import main as ps_main
from hetps.ps.colocated import rank_binds
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ConfigError
from hetps.runtime import checkpoint, curve_setup
from hetps.runtime.membership import Membership
from hetps.scheduler.coordinator import Coordinator
from hetps.training.state import model_specs, model_tensors
from hetps.worker.client import PSClient

JOIN_S = 30.0  # upper bound on any thread's end
LR = 0.1


# main() in this process: its SIGUSR1 stack dump undone after each test (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("no_stack_dump_handler_left")


# ---------------------------------------------------------------- pure pieces


@pytest.mark.parametrize(
    "shards,processes,groups",
    [
        (2, 0, [[0], [1]]),
        (2, 1, [[0, 1]]),
        (5, 2, [[0, 1, 2], [3, 4]]),
        (3, 3, [[0], [1], [2]]),
    ],
)
def test_shard_groups_pack_contiguous_ranks(shards, processes, groups):
    cfg = load_config(None, [f"cluster.shards={shards}", f"cluster.shard_processes={processes}"])
    assert shard_groups(cfg) == groups
    assert [process_name(g) for g in groups][-1] == (
        f"ps{groups[-1][0]}" if len(groups[-1]) == 1 else f"ps{groups[-1][0]}-{groups[-1][-1]}"
    )


@pytest.mark.parametrize(
    "overrides,named",
    [
        (
            ["cluster.shard_processes=3"],
            r"cluster.shard_processes: must be 0 \(one process per shard\) up to the number of shards \(2\), got 3",
        ),
        (["cluster.shard_processes=-1"], "got -1"),
        (["cluster.shard_processes=1", "cluster.replicas=1"], "cannot hold backups"),
        (
            ["cluster.shard_processes=1", "cluster.kill=[{node: ps1, at_s: 1}]"],
            "cluster.kill.0.node: ps1 shares",
        ),
        (["comm.local_transport=udp"], "comm.local_transport: unknown value 'udp'"),
    ],
)
def test_bad_colocation_settings_name_the_key(overrides, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, ["cluster.shards=2", *overrides])


def test_shard_process_arguments_name_the_ranks_their_sockets_and_versions(tmp_path):
    sockets = LocalSockets(load_config(None, ["comm.local_transport=ipc"]), tmp_path)
    folder = tmp_path.resolve() / "sockets"
    assert shard_process([2], sockets) == ("ps2", ("--rank", "2", "--bind", f"ipc://{folder}/ps2"))
    name, args = shard_process([0, 1], sockets, versions={0: 7, 1: 9})
    assert name == "ps0-1"
    assert args == (
        "--ranks",
        "0,1",
        "--bind",
        f"ipc://{folder}/ps{{rank}}",
        "--resume",
        "--restore-version",
        "7,9",
    )


def test_rank_binds_fill_in_the_rank_or_refuse_one_address_for_several():
    cfg = load_config(None, [])
    assert rank_binds("ipc:///r/ps{rank}", [0, 1], cfg) == ["ipc:///r/ps0", "ipc:///r/ps1"]
    assert rank_binds(None, [2, 3], cfg) == ["tcp://127.0.0.1:0"] * 2
    with pytest.raises(ValueError, match=r"names one address for 2 ranks: put \{rank\} in it"):
        rank_binds("tcp://0.0.0.0:7000", [0, 1], cfg)


def test_local_sockets_go_to_the_run_dir_or_a_short_tmp_dir(tmp_path):
    ipc, tcp = (
        load_config(None, ["comm.local_transport=ipc"]),
        load_config(None, ["comm.local_transport=tcp"]),
    )
    assert LocalSockets(tcp, tmp_path).bind_args("ps0") == ()
    short = LocalSockets(ipc, tmp_path)
    assert short.bind_args("ps0") == ("--bind", f"ipc://{tmp_path.resolve()}/sockets/ps0")
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    far = LocalSockets(ipc, deep)
    address = far.bind_args("scheduler")[1]
    assert len(address) - len("ipc://") < UNIX_PATH_MAX and far.folder.is_dir()
    far.close()
    assert not far.folder.exists()
    short.close()
    assert short.folder.is_dir()  # the run directory's own folder stays


def test_a_colocated_process_refuses_backups_and_a_shared_fixed_address(capfd):
    cfg_args = [
        "--config",
        str(REPO / "configs" / "sync.yaml"),
        "--scheduler",
        "tcp://scheduler:7000",
    ]
    assert ps_main([*cfg_args, "--ranks", "0,1", "--bind", "tcp://127.0.0.1:7000"]) == 2
    assert "put {rank} in it" in capfd.readouterr().err
    assert ps_main([*cfg_args, "--ranks", "0,1", "cluster.replicas=1"]) == 2
    assert "backups need one process per shard" in capfd.readouterr().err
    assert ps_main([*cfg_args, "--ranks", "0,1", "--restore-version", "4"]) == 2
    assert "--restore-version needs one version per rank (2), got 1" in capfd.readouterr().err


def test_curve_and_its_allow_list_hold_over_ipc(tmp_path, monkeypatch):
    """CurveZMQ is the same over unix sockets: the allowed client is answered,
    a plaintext client on the same socket path gets nothing."""
    monkeypatch.delenv("HETPS_KEYS_DIR", raising=False)
    monkeypatch.delenv("HETPS_CLIENT_KEY", raising=False)
    security.write_keys(tmp_path / "keys", ["client-0"])
    cfg = load_config(None, ["security.curve=true", f"security.keys_dir={tmp_path / 'keys'}"])
    server = plain = client = None
    try:
        curve_setup.configure(cfg, "ps")  # this process is both the server and the allowed client
        server = make_server(f"ipc://{tmp_path}/ps0")
        client = make_client(server.address)
        client.send([b"allowed"])
        got = server.recv(5.0)
        assert got is not None and bytes(got[1][0]) == b"allowed"
        security.reset()
        plain = make_client(server.address)
        plain.send([b"plaintext"])
        assert server.recv(1.0) is None, "a plaintext client got through a curve server over ipc"
    finally:
        for sock in (plain, client, server):
            if sock is not None:
                sock.close()
        security.reset()


# ---------------------------------------------------------------- two ranks, one process


class Thread(threading.Thread):
    """A thread that keeps its target's result or exception."""

    def __init__(self, target, name: str):
        super().__init__(name=name, daemon=True)
        self.fn, self.result, self.error = target, None, None

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def test_two_ranks_in_one_process_register_apart_and_both_apply_pushes(tmp_path: Path):
    tag = uuid.uuid4().hex[:8]
    overrides = [
        "cluster.shards=2",
        "cluster.workers=1",
        "cluster.shard_processes=1",
        "eval.enabled=false",
        f"optimizer.lr={LR}",
        "optimizer.momentum=0",
        "cluster.profile_steps=1",
        "stop.target_accuracy=null",
        "cluster.heartbeat_s=0.2",
    ]
    cfg = load_config(None, overrides)
    server = MemServer(f"mem://colo-sched-{tag}")
    coord = Coordinator(server, cfg, run_dir=tmp_path)
    serving = threading.Event()
    serving.set()

    def schedule():
        while serving.is_set() and not coord.finished():
            coord.serve_once(0.02)
            coord.tick()

    scheduler = Thread(schedule, "scheduler")
    shards = Thread(
        lambda: ps_main(
            [
                "--scheduler",
                server.address,
                "--ranks",
                "0,1",
                "--bind",
                f"mem://colo-{tag}-ps{{rank}}",
                "--checkpoint-dir",
                str(tmp_path / "ckpt"),
                *overrides,
            ]
        ),
        "ps0-1",
    )
    member = Membership(server.address, "worker", 0, cfg.cluster)
    client = None
    scheduler.start()
    shards.start()
    try:
        model = tiny_model(widths=(8, 16, 4), batchnorm=False)  # no buffers: SGD moves every tensor
        specs = model_specs(model)
        member.join(tensor_specs=specs, schema_hash=schema_hash(specs), speed=1.0)
        member.start_heartbeats(dict)  # a silent worker would be declared dead on a slow machine
        plan = member.wait_plan()
        assert sorted(s.rank for s in plan.shards) == [0, 1]
        assert {s.address for s in plan.shards} == {
            f"mem://colo-{tag}-ps0",
            f"mem://colo-{tag}-ps1",
        }
        assert set(plan.placement.values()) == {0, 1}, "the tiny model must span both shards"
        values = {n: t.detach().clone() for n, (t, _) in model_tensors(model).items()}
        client = PSClient(plan, member.node_id, cfg.cluster)
        client.init(values)
        grads = {n: torch.full_like(v, 0.5) for n, v in values.items()}
        for clock in range(3):
            _, pulled = client.push_pull(grads, clock, 32)
        for name, v in values.items():  # three plain SGD steps on each rank's own tensors
            assert torch.allclose(pulled[name], v - 3 * LR * 0.5), name
        coord.begin_stop("test done")
        member.bye({})  # the scheduler stops the shards once the workers left
        shards.join(JOIN_S)
        assert not shards.is_alive() and shards.error is None and shards.result == 0, shards.error
        scheduler.join(JOIN_S)
        assert not scheduler.is_alive() and scheduler.error is None
        ps_nodes = [n for n in coord.nodes.values() if n.role == "ps"]
        assert (
            sorted(n.rank for n in ps_nodes) == [0, 1] and len({n.node_id for n in ps_nodes}) == 2
        )
        assert all(n.left for n in ps_nodes), "each rank says goodbye"
        for rank in (0, 1):  # each rank's own last checkpoint
            assert (
                checkpoint.latest(checkpoint.shard_dir(tmp_path / "ckpt", plan.run_id, rank))
                is not None
            )
    finally:
        serving.clear()
        coord.begin_stop("test cleanup")
        if client is not None:
            client.close()
        member.close()
        shards.join(JOIN_S)
        scheduler.join(JOIN_S)
        server.close()
