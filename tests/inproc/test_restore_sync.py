"""A sync shard killed at a round boundary and restored from an older
checkpoint, in one process (mem:// transports, the workers' real PSClient).

Sync, workers A and B, shards S0 and S1, fused push+pull. Five rounds train.
In round 5, S1's reply to B is lost (S1 dies before B reads it) while A,
already answered, pushes clock 6 to both shards and S1 takes it. S1 is then
replaced at the same address by a shard restored from its checkpoint of
version 6 - k (k rounds behind). B re-sends its clock-5 push to the new S1; A
waits on S0, where its clock-6 push is parked until B's clock 6, and must
re-send its lost clock-6 push to S1 meanwhile. Every fault is triggered by
an event (a push arriving), not by time; retries run on real time with short
intervals, and every wait has a deadline.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from shard_harness import PLAN_ID, SHARD_IDS, ShardHarness, grads, make_plan, tiny_model, values_of

from hetps.proto.messages import Ack, Params, Pull, Push
from hetps.proto.rpc import RpcClient
from hetps.proto.transport import MemServer, make_server
from hetps.ps.shard import Shard
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import CheckpointConfig, ClusterConfig
from hetps.runtime import checkpoint
from hetps.training.state import model_specs
from hetps.worker.client import PSClient

A, B = 11, 12
KILL_ROUND = 5  # the round whose reply to B is lost
STEPS = 10  # clocks each worker trains
RETRY_S = 0.05
TIMEOUT_S = 15.0  # request timeout: a deadlock fails the step after this


@pytest.fixture(scope="module", autouse=True)
def warm_optimizer():
    """The first torch.optim optimizer imports torch._dynamo, seconds on a loaded
    machine: paid here, not inside a request's timeout (a shard makes one at INIT)."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)


class DyingShard(Shard):
    """S1: every reply to B from B's round-5 push on is lost; right after it
    took A's clock-6 push, `die()` replaces it."""

    def __init__(self, *args, die, **kwargs):
        super().__init__(*args, **kwargs)
        self.die = die
        self.lost_peers: set[bytes] = set()

    def on_push(self, peer, env):
        if env.src == B and env.msg.clock >= KILL_ROUND:
            self.lost_peers.add(peer)
        answer = super().on_push(peer, env)
        if env.src == A and env.msg.clock == KILL_ROUND + 1:
            self.die()
        return answer

    def reply(self, peer, req_id, msg):
        if peer in self.lost_peers:
            return None  # the process died before this reply left
        return super().reply(peer, req_id, msg)


class Cluster:
    """S0 and S1 served by one thread; `die()` swaps S1 for its restored twin."""

    def __init__(self, tmp_path, behind: int):
        model = tiny_model()
        self.model = model
        self.cfg = load_config(None, ["algorithm.name=sync", "optimizer.momentum=0.9"])
        addresses = [f"mem://restore-sync-{behind}-{i}-{id(self)}" for i in range(2)]
        plan = make_plan(model_specs(model), [A, B], n_shards=2)
        self.plan = dataclasses.replace(
            plan, shards=[dataclasses.replace(s, address=a) for s, a in zip(plan.shards, addresses)]
        )
        self.folder = tmp_path / "ps1"
        self.restore_version = KILL_ROUND + 1 - behind
        self.shards = [
            Shard(make_server(addresses[0]), SHARD_IDS[0], self.plan, self.cfg),
            DyingShard(
                make_server(addresses[1]),
                SHARD_IDS[1],
                self.plan,
                self.cfg,
                die=self.die,
                checkpointer=checkpoint.Checkpointer(
                    CheckpointConfig(every_updates=1, keep=20), self.folder
                ),
            ),
        ]
        self.died = threading.Event()
        self.stop = threading.Event()
        self.server = threading.Thread(target=self._serve, daemon=True)

    def die(self) -> None:
        """S1 dies with what it holds; a new S1 at its address restores the
        checkpoint `restore_version` (called on the serving thread)."""
        old = self.shards[1]
        twin = Shard(
            MemServer(old.server.address, take_over=True), SHARD_IDS[1], self.plan, self.cfg
        )
        old.server.close()
        twin.restore(checkpoint.load(checkpoint.latest(self.folder, self.restore_version)))
        self.shards[1] = twin
        self.died.set()

    def _serve(self) -> None:
        while not self.stop.is_set():
            for shard in list(self.shards):
                shard.serve_once(0.002)

    def close(self) -> None:
        self.stop.set()
        self.server.join(timeout=10)
        for s in self.shards:
            s.server.close()


def train(cluster: Cluster, node: int, client: PSClient, done: list, errors: list) -> None:
    try:
        for clock in range(STEPS):
            client.push_pull(grads(cluster.model, 10 * clock + node), clock, 8)
            done.append((clock, list(client.versions)))
    except Exception as exc:  # handed to the test thread
        errors.append(f"{node} at clock {len(done)}: {exc!r}")


@pytest.mark.parametrize("behind", [0, 1, 2, 5])
def test_sync_trains_on_after_a_shard_is_restored_rounds_behind(tmp_path, behind):
    cluster = Cluster(tmp_path, behind)
    cluster.server.start()
    clients = {
        n: PSClient(cluster.plan, n, ClusterConfig(request_timeout_s=TIMEOUT_S, retry_s=RETRY_S))
        for n in (A, B)
    }
    done = {A: [], B: []}
    errors: list[str] = []
    try:
        clients[A].init(values_of(cluster.model))
        threads = [
            threading.Thread(
                target=train, args=(cluster, n, clients[n], done[n], errors), daemon=True
            )
            for n in (A, B)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=STEPS * TIMEOUT_S)
        assert not any(t.is_alive() for t in threads), f"workers still waiting: {done}"
    finally:
        cluster.close()
        for c in clients.values():
            c.close()
    assert cluster.died.is_set(), "S1 never saw A's clock-6 push"
    assert not errors, errors
    assert [c for c, _ in done[A]] == [c for c, _ in done[B]] == list(range(STEPS))
    s0, s1 = cluster.shards
    assert s1.restored_version == cluster.restore_version
    assert s0.store.version == STEPS
    # the new S1 went on from its checkpoint: one update per round after the restore (the
    # round S1 lost both pushes of is gone; the lost round 5 closes with B alone)
    lost_rounds = max(0, behind - 1)
    assert s1.store.version == STEPS - lost_rounds
    for shard in (s0, s1):  # every push of both workers is in, no round left open
        assert shard.policy.applied == {A: STEPS, B: STEPS} and not shard.policy.rounds
    assert not s1.policy.restored  # rounds are whole again


def test_a_lower_version_from_a_shard_resends_what_it_lost_at_once(tmp_path):
    """Unfused: A's push was acknowledged and its pull parked when the shard
    died; the shard comes back from an older checkpoint. The first PARAMS
    with a lower version than A saw before makes A re-send its unanswered
    pull, and the push it depends on, at once (not after the 30 s retry)."""
    model = tiny_model()
    h = ShardHarness(model_specs(model), ["optimizer.momentum=0"], [A, B])
    a = RpcClient(h.addresses[0], src=A, timeout_s=5.0, retry_s=30.0)
    try:
        h.init(values_of(model))
        saved = tmp_path / "v0.pt"
        checkpoint.write_atomic(saved, {"format": checkpoint.FORMAT, **h.shards[0].state_dict()})
        h.push(A, 0, grads(model, 1))
        h.push(B, 0, grads(model, 2))
        seen = a.send(Pull(plan_id=PLAN_ID, clock=-1))
        h.serve()
        assert a.wait(seen, timeout_s=1.0).version == 1
        push = a.send(Push(plan_id=PLAN_ID, clock=1, base_version=1, tensors=grads(model, 3)))
        pull = a.send(Pull(plan_id=PLAN_ID, clock=2), after=push)  # as PSClient sends them unfused
        h.serve()
        assert isinstance(a.wait(push, timeout_s=1.0), Ack)
        assert h.stats()[0]["parked"] == 1  # B has not pushed clock 1
        # the shard dies; a new one at its address restores the checkpoint made after INIT
        old = h.shards[0]
        h.shards[0] = Shard(MemServer(h.addresses[0], take_over=True), SHARD_IDS[0], h.plan, h.cfg)
        old.server.close()
        h.shards[0].restore(checkpoint.load(saved))
        latest = a.send(Pull(plan_id=PLAN_ID, clock=-1))
        h.serve()
        assert a.wait(latest, timeout_s=1.0).version == 0  # lower than the 1 A saw: state was lost
        a.tend()  # re-sends the push, then the pull
        h.serve()
        # closes the round A's re-sent push opened
        h.push(B, 1, grads(model, 4))
        reply = a.wait(pull, timeout_s=1.0)
        assert isinstance(reply, Params) and reply.version == 1 and h.versions() == [1]
        assert a.resent == 1 and h.shards[0].policy.applied == {A: 2, B: 2}
    finally:
        a.close()
        h.close()
