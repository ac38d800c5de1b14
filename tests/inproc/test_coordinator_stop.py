"""The coordinator's stop and divergence paths in one process (an in-memory
transport, no daemons, a clock the test moves): a scheduler restarted after
the stop was decided finishes that stop, and under the NaN-tolerant
`cluster.nonfinite` modes one worker's non-finite loss is counted, not a
verdict."""

from __future__ import annotations

import contextlib
import math

import pytest

from hetps.proto.codec import Envelope
from hetps.proto.messages import Ack, Bye, Heartbeat, Register, Report
from hetps.proto.plan import TensorSpec
from hetps.proto.records import NodeStats, read_step_records
from hetps.proto.transport import MemServer
from hetps.runconfig.load import load_config
from hetps.scheduler import state
from hetps.scheduler.coordinator import Coordinator

SPECS = [TensorSpec("w", "float32", (2, 3))]


class Cluster:
    """A coordinator on a clock the test moves (`now`), its nodes registered
    by name (ps0, worker0, ..., evaluator0) and the messages a node sends."""

    def __init__(self, coord: Coordinator, now: list[float]):
        self.coord, self.now = coord, now
        self.ids: dict[str, int] = {}

    def register(self, role: str, rank: int) -> None:
        msg = Register(
            role=role,
            rank=rank,
            address=f"mem://{role}{rank}" if role == "ps" else "",
            tensor_specs=SPECS if role == "worker" else [],
            speed=1.0,
        )
        welcome = self.coord.on_register(b"peer", Envelope(msg, req_id=1, src=0))
        self.ids[f"{role}{rank}"] = welcome.node_id

    def beat(self, name: str, stats: dict | None = None, records: list[dict] = ()) -> Ack:
        """A heartbeat without a hold (answered at once), as a node's last one before BYE."""
        node = self.ids[name]
        msg = Heartbeat(
            node_id=node,
            stats=NodeStats.read(stats or {}),
            records=read_step_records(list(records)),
        )
        return self.coord.on_heartbeat(name.encode(), Envelope(msg, req_id=3, src=node))

    def bye(self, name: str) -> None:
        node = self.ids[name]
        self.coord.on_bye(name.encode(), Envelope(Bye(node_id=node), req_id=4, src=node))

    def evaluation(self, accuracy: float, loss: float = 0.5, final: bool = False) -> None:
        node = self.ids["evaluator0"]
        values = {"accuracy": accuracy, "loss": loss, "final": final, "num_classes": 10}
        self.coord.on_report(
            b"e", Envelope(Report(node_id=node, kind="eval", values=values), req_id=2, src=node)
        )

    def restarted(self, tmp_path) -> Cluster:
        """A new coordinator on the same run directory, restored from the state
        file as the scheduler daemon does after a restart (the old one is gone
        without a word)."""
        again = Coordinator(
            self.coord.server, self.coord.cfg, run_dir=tmp_path, clock=lambda: self.now[0]
        )
        again.restore(state.read(tmp_path))
        cluster = Cluster(again, self.now)
        cluster.ids = dict(self.ids)
        return cluster


@contextlib.contextmanager
def cluster(tmp_path, overrides: list[str], workers: int = 2):
    """A shard, `workers` workers and an evaluator, registered: the first plan is out."""
    now = [100.0]
    cfg = load_config(None, [f"cluster.workers={workers}", "cluster.shards=1", *overrides])
    server = MemServer(f"mem://coordinator-stop-{tmp_path.name}")
    try:
        c = Cluster(Coordinator(server, cfg, run_dir=tmp_path, clock=lambda: now[0]), now)
        c.register("ps", 0)
        for rank in range(workers):
            c.register("worker", rank)
        c.register("evaluator", 0)
        assert c.coord.plan is not None
        yield c
    finally:
        server.close()


# ---------------------------------------------------------------- a scheduler restarted at the stop
def test_a_scheduler_restarted_right_after_the_stop_was_decided_finishes_that_stop(tmp_path):
    """The target is reached and the scheduler dies before any node heard of
    the stop: the restarted one carries the stop on (same reason, no new
    evaluation needed, none would reach the target again) and tells the
    nodes in the usual order, workers first, shards last."""
    with cluster(tmp_path, ["stop.target_accuracy=0.9", "cluster.dead_after_s=5"]) as c:
        c.now[0] += 3.0
        c.evaluation(0.93)
        reason = "target accuracy 0.9 reached (0.9300)"
        assert c.coord.stop_reason == reason
        c.now[0] += 1.0  # killed; back a second later
        again = c.restarted(tmp_path)
        assert again.coord.stop_reason == reason
        c.now[0] += 0.5
        again.coord.tick()
        # the shard and the evaluator wait for the workers, as in any stop
        assert not again.beat("ps0").stop and not again.beat("evaluator0").stop
        for name in ("worker0", "worker1"):
            ack = again.beat(name, {"steps": 40})  # a run that trained nothing would have failed
            assert ack.stop and ack.info["reason"] == reason
            again.bye(name)
        assert again.beat("evaluator0").stop and not again.beat("ps0").stop
        again.evaluation(0.89, final=True)  # the final model, below the target: still that stop
        again.bye("evaluator0")
        assert again.beat("ps0").stop
        again.bye("ps0")
        assert again.coord.finished()
        s = again.coord.summary()
        assert (s["status"], s["stop_reason"], s["final_accuracy"]) == ("completed", reason, 0.89)
        assert s["failures"] == [] and s["not_left"] == []
        # the run's clock goes on: 3 s to the target, 0.5 s after the restart (and the time down
        # on the wall clock, which this test does: test_a_restarted_scheduler_keeps_the_runs_clock)
        assert 3.5 <= s["wall_s"] < 4.0, s["wall_s"]


def test_nodes_that_left_while_the_scheduler_was_down_do_not_hold_the_stop_up(tmp_path):
    """Workers and the evaluator heard the stop from the old scheduler and left,
    their goodbyes lost with it: the restarted scheduler counts a node it
    never hears from as left after cluster.dead_after_s (not as a failure),
    and the shards, the only ones still running, are told to stop then; it
    does not wait for a time limit."""
    with cluster(
        tmp_path, ["stop.target_accuracy=null", "stop.max_steps=40", "cluster.dead_after_s=5"]
    ) as c:
        c.beat("worker0", {"steps": 20})
        c.beat("worker1", {"steps": 19})
        c.now[0] += 1.0
        c.coord.tick()
        assert c.coord.stop_reason is None
        c.coord.save_state()  # the last periodic save: 39 steps in all
        c.beat("worker1", {"steps": 20})  # 40 steps: the step limit
        c.coord.tick()
        assert c.coord.stop_reason == "step limit 40"
        c.now[0] += 2.0
        again = c.restarted(tmp_path)
        assert again.coord.stop_reason == "step limit 40"
        for _ in range(9):  # the shard beats on; nobody else is there
            c.now[0] += 0.5
            again.coord.tick()
            assert not again.beat("ps0").stop, "the shard must wait for the workers"
        c.now[0] += 0.6  # dead_after_s since the restart
        again.coord.tick()
        ack = again.beat("ps0")
        assert ack.stop and ack.info["reason"] == "step limit 40"
        again.bye("ps0")
        assert again.coord.finished()
        s = again.coord.summary()
        assert (s["status"], s["stop_reason"]) == ("completed", "step limit 40")
        assert s["failures"] == [] and s["not_left"] == []
        assert s["global_steps"] == 40


def test_a_scheduler_restarted_after_the_run_stopped_as_diverged_keeps_the_verdict(tmp_path):
    """A diverged stop survives the restart with its verdict: summary status
    `diverged` (exit 3) and the detail naming the cause."""
    with cluster(tmp_path, ["stop.target_accuracy=null"]) as c:
        c.evaluation(0.2, loss=math.nan)
        verdict = c.coord.guard.verdict
        assert c.coord.stop_reason == "diverged" and "the evaluator" in verdict
        again = c.restarted(tmp_path)
        for name in ("worker0", "worker1", "evaluator0", "ps0"):
            assert again.beat(name).stop
            again.bye(name)
        s = again.coord.summary()
        assert (s["status"], s["detail"]) == ("diverged", verdict)


# ---------------------------------------------------------------- NaN-tolerant modes
def nan_step(worker: str, step: int) -> dict:
    return {"worker": int(worker[-1]), "step": step, "loss": math.nan, "ago": 0.0}


def ok_step(worker: str, step: int) -> dict:
    return {"worker": int(worker[-1]), "step": step, "loss": 0.4, "ago": 0.0}


def test_under_skip_one_workers_nan_loss_is_counted_not_a_verdict(tmp_path):
    """cluster.nonfinite=skip: the shards drop one worker's NaN gradients, so
    its NaN training loss says nothing about the model: counted per worker
    (summary `nonfinite_losses`), and the run goes on while the evaluator's
    test loss is finite and another live worker's loss is."""
    with cluster(tmp_path, ["cluster.nonfinite=skip", "stop.target_accuracy=0.9"]) as c:
        for step in range(1, 4):
            c.beat("worker0", {"steps": step}, records=[ok_step("worker0", step)])
            c.beat("worker1", {"steps": step}, records=[nan_step("worker1", step)])
            c.now[0] += 1.0
            c.evaluation(0.6 + 0.1 * step)
            c.coord.tick()
        assert c.coord.stop_reason == "target accuracy 0.9 reached (0.9000)"
        s = c.coord.summary()
        assert s["status"] == "completed" and s["detail"] is None
        assert s["nonfinite_losses"] == {"worker1": 3}


def test_under_clip_every_live_workers_nan_loss_or_a_nan_test_loss_is_divergence(tmp_path):
    """cluster.nonfinite=clip: diverged once the latest loss of every live
    worker is not finite (a worker that recovered, or left, no longer counts
    against the run the way it did)."""
    with cluster(tmp_path, ["cluster.nonfinite=clip"], workers=3) as c:
        c.beat("worker0", records=[nan_step("worker0", 1)])
        c.beat("worker1", records=[nan_step("worker1", 1)])
        c.beat("worker2", records=[ok_step("worker2", 1)])
        c.beat("worker0", records=[ok_step("worker0", 2)])  # worker0 recovered
        c.beat("worker2", records=[nan_step("worker2", 2)])
        assert c.coord.stop_reason is None
        c.bye("worker0")  # the only finite one leaves: the others' next NaN decides
        c.beat("worker1", records=[nan_step("worker1", 2)])
        assert c.coord.stop_reason == "diverged"
        verdict = c.coord.guard.verdict
        assert "every live worker" in verdict and "worker1, worker2" in verdict, verdict
        assert "optimizer.lr" in verdict
        assert c.coord.summary()["nonfinite_losses"] == {"worker0": 1, "worker1": 2, "worker2": 1}
    # the evaluator's test loss is the model's: not finite, the run diverged at once
    with cluster(tmp_path, ["cluster.nonfinite=clip"]) as c:
        c.beat("worker1", records=[nan_step("worker1", 1)])
        c.evaluation(0.1, loss=math.inf)
        assert c.coord.stop_reason == "diverged"
        assert "the evaluator (test loss)" in c.coord.guard.verdict


def test_under_reject_a_workers_nan_loss_is_still_a_verdict_at_once(tmp_path):
    """cluster.nonfinite=reject (the default) refuses NaN pushes, so a NaN
    training loss that reached the scheduler came with gradients the shards
    took: the run diverged."""
    with cluster(tmp_path, []) as c:
        c.beat("worker0", records=[ok_step("worker0", 1)])
        c.beat("worker1", records=[nan_step("worker1", 1)])
        assert c.coord.stop_reason == "diverged"
        assert "worker1 at step 1" in c.coord.guard.verdict


def test_a_scheduler_killed_while_closing_leaves_a_summary_and_its_restart_writes_it_again(
    tmp_path, monkeypatch
):
    """Killed between writing the summary and marking its state finished (a
    restart of a finished run does nothing): the summary is on disk, and a
    restart finds the stop unfinished, sees every node gone and closes at once."""
    import json

    with cluster(tmp_path, ["stop.target_accuracy=0.9"]) as c:
        c.evaluation(0.95)
        for name in ("worker0", "worker1", "evaluator0", "ps0"):
            assert c.beat(name, {"steps": 40} if name.startswith("worker") else None).stop
            c.bye(name)
        assert c.coord.finished()
        written = state.write

        def killed_at_finished(run_dir, **fields):
            if fields["finished"]:
                raise SystemExit("SIGKILL")
            written(run_dir, **fields)

        monkeypatch.setattr(state, "write", killed_at_finished)
        with contextlib.suppress(SystemExit):
            c.coord.close()
        monkeypatch.setattr(state, "write", written)
        first = json.loads((tmp_path / "summary.json").read_text())
        assert first["stop_reason"] == "target accuracy 0.9 reached (0.9500)"
        again = c.restarted(tmp_path)
        assert again.coord.finished()
        again.coord.close()
        s = json.loads((tmp_path / "summary.json").read_text())
        assert (s["status"], s["stop_reason"]) == ("completed", first["stop_reason"])
        assert state.read(tmp_path)["finished"]


# ---------------------------------------------------------------- a scheduler that dies for good
def test_a_scheduler_dead_for_good_leaves_its_counts_in_its_state_file(tmp_path):
    """What `hetps run` writes into summary.json when the scheduler never comes back
    (status.saved_summary): the steps, evaluations and failures its state file holds."""
    from hetps.scheduler.status import saved_summary

    with cluster(tmp_path, ["stop.target_accuracy=0.99"]) as c:
        c.now[0] += 2.0
        c.beat("worker0", {"steps": 30, "samples": 960})
        c.beat("worker1", {"steps": 31, "samples": 992})
        c.evaluation(0.61)
        c.evaluation(0.72)
        c.coord.save_state()
        s = saved_summary(state.read(tmp_path))
    assert s["from_state"] is True and s["run_id"] == c.coord.run_id
    assert (s["global_steps"], s["global_samples"]) == (61, 1952)
    assert (s["evals"], s["final_accuracy"], s["best_accuracy"]) == (2, 0.72, 0.72)
    assert s["wall_s"] == pytest.approx(2.0, abs=0.01) and s["failures"] == []
    assert saved_summary({"nodes": [], "evals": {"bogus": 1}})["global_steps"] == 0  # odd file


# ---------------------------------------------------------------- step records written once
def test_a_heartbeat_sent_again_writes_its_step_records_once(tmp_path):
    """A worker whose heartbeat ACK came too late sends its records again with the next beat
    (runtime/membership.py requeues them): the scheduler, which had written them, writes only
    the newer ones, so each worker's steps in metrics.jsonl are in order and once."""
    from hetps.scheduler.runlog import read_metrics

    with cluster(tmp_path, []) as c:
        first = [{"step": s, "ago": 0.0, "loss": 1.0} for s in (1, 2, 3)]
        c.beat("worker0", records=first)
        c.beat("worker0", records=[*first, {"step": 4, "ago": 0.0, "loss": 1.0}])
        c.beat("worker1", records=[{"step": 1, "ago": 0.0, "loss": 1.0}])
        steps = [
            (r["worker"], r["step"])
            for r in read_metrics(tmp_path / "metrics.jsonl")
            if r["kind"] == "step"
        ]
    assert steps == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 1)]


# ---------------------------------------------------------------- a stop that names dead shards
@pytest.mark.parametrize("ps0_dies", [True, False])
def test_the_stop_names_the_shards_declared_dead_so_no_final_pull_waits_on_them(tmp_path, ps0_dies):
    """The ACK that tells a node to stop lists the shards the scheduler had declared dead
    (`dead_shards`, their ranks): the evaluator makes no final pull from them
    (worker/evaluator.py). A live shard is never listed."""
    overrides = ["stop.target_accuracy=null", "stop.max_steps=40", "cluster.dead_after_s=5"]
    with cluster(tmp_path, overrides) as c:
        for _ in range(3):  # 6 s: ps0 silent past dead_after_s, or beating
            c.now[0] += 2.0
            for name in ("worker0", "worker1", "evaluator0", *(() if ps0_dies else ("ps0",))):
                c.beat(name, {"steps": 10} if name.startswith("worker") else None)
            c.coord.tick()
        assert c.coord.stop_reason is None
        c.beat("worker0", {"steps": 30})  # 40 steps: the step limit
        c.coord.tick()
        acks = [c.beat("worker0", {"steps": 30})]
        c.bye("worker0")
        acks.append(c.beat("worker1", {"steps": 10}))
        c.bye("worker1")
        acks.append(c.beat("evaluator0"))  # told after the workers
    assert all(a.stop and a.info["reason"] == "step limit 40" for a in acks), acks
    assert all(a.info.get("dead_shards") == ([0] if ps0_dies else None) for a in acks), acks
