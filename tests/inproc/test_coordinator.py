"""The scheduler's coordinator in one process (an in-memory transport, no
daemons): liveness is judged from the first plan on, not from registration."""

from __future__ import annotations

import contextlib
import time

from hetps.proto.codec import Envelope
from hetps.proto.messages import Register, Report
from hetps.proto.plan import TensorSpec
from hetps.proto.records import NodeStats
from hetps.proto.transport import MemServer
from hetps.runconfig.load import load_config
from hetps.scheduler.coordinator import Coordinator

SPECS = [TensorSpec("w", "float32", (2, 3))]
DEAD_AFTER_S = 0.2


def register(coord: Coordinator, role: str, rank: int) -> int:
    msg = Register(
        role=role,
        rank=rank,
        address=f"mem://{role}{rank}" if role == "ps" else "",
        tensor_specs=SPECS if role == "worker" else [],
        speed=1.0,
    )
    return coord.on_register(b"peer", Envelope(msg, req_id=1, src=0)).node_id


def test_nodes_that_registered_long_before_the_plan_are_not_declared_dead(tmp_path):
    cfg = load_config(
        None,
        [
            "cluster.workers=2",
            "cluster.shards=1",
            f"cluster.dead_after_s={DEAD_AFTER_S}",
            # heartbeats must be more frequent than dead_after_s
            "cluster.heartbeat_s=0.05",
        ],
    )
    server = MemServer("mem://coordinator-liveness")
    try:
        coord = Coordinator(server, cfg, run_dir=tmp_path)
        register(coord, "ps", 0)
        register(coord, "worker", 0)
        # the last worker is slow to start: the others only wait for the plan
        time.sleep(3 * DEAD_AFTER_S)
        register(coord, "worker", 1)
        assert coord.plan is not None and coord.plan.plan_id == 1
        coord.tick()
        assert coord.failures == [] and coord.plan.plan_id == 1
        # silence after the plan is still detected: nobody heartbeats here
        time.sleep(2 * DEAD_AFTER_S)
        coord.tick()
        assert sorted(f.node for f in coord.failures) == ["ps0", "worker0", "worker1"]
    finally:
        server.close()


class SchedulerClock:
    """Stands in for the `time` module the scheduler reads: a monotonic clock
    and a wall clock that only the test moves (both by the same seconds)."""

    def __init__(self):
        self.mono, self.wall = 1000.0, 1_700_000_000.0

    def monotonic(self) -> float:
        return self.mono

    def time(self) -> float:
        return self.wall

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += seconds


def test_a_restarted_scheduler_keeps_the_runs_clock(tmp_path, monkeypatch):
    """The scheduler dies 1.45 s into training (its state last saved when the
    plan went out) and is back 1.0 s later: evaluation times, time to target
    and wall time count from the run's start, through the restart."""
    import json

    from hetps.scheduler import coordinator as coordinator_module
    from hetps.scheduler import state

    clock = SchedulerClock()
    monkeypatch.setattr(coordinator_module, "time", clock)
    monkeypatch.setattr(state, "time", clock)
    cfg = load_config(None, ["cluster.workers=1", "cluster.shards=1", "stop.target_accuracy=0.9"])

    def evaluation(coord: Coordinator, evaluator: int, accuracy: float) -> None:
        coord.on_report(
            b"peer",
            Envelope(
                Report(node_id=evaluator, kind="eval", values={"accuracy": accuracy}),
                req_id=2,
                src=evaluator,
            ),
        )

    first = MemServer("mem://coordinator-clock-1")
    try:
        coord = Coordinator(first, cfg, run_dir=tmp_path)
        register(coord, "ps", 0)
        register(coord, "worker", 0)
        evaluator = register(coord, "evaluator", 0)
        assert coord.plan is not None
        clock.advance(1.15)
        evaluation(coord, evaluator, 0.5)
        clock.advance(0.3)  # killed here: nothing saved since the plan
    finally:
        first.close()
    clock.advance(1.0)  # down for a second
    second = MemServer("mem://coordinator-clock-2")
    try:
        again = Coordinator(second, cfg, run_dir=tmp_path)
        again.restore(state.read(tmp_path))
        clock.advance(0.2)
        evaluation(again, evaluator, 0.95)
        summary = again.summary()
        again.runlog.close()
    finally:
        second.close()
    times = [
        r["t"]
        for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == "eval"
    ]
    assert times == [1.15, 2.65]
    assert summary["time_to_target_s"] == 2.65 and summary["wall_s"] >= 2.65


def test_a_burst_of_registrations_writes_the_state_once_per_tick(tmp_path):
    """64 workers registering back to back before the plan: the state file is
    written by the next tick, once, with every node in it (not 64 times,
    which made start-up quadratic at 1,024 nodes); after the plan a joining
    node is saved at once."""
    import json

    from hetps.scheduler import state

    cfg = load_config(None, ["cluster.workers=65", "cluster.shards=1"])
    server = MemServer("mem://coordinator-burst")
    try:
        coord = Coordinator(server, cfg, run_dir=tmp_path)
        register(coord, "ps", 0)
        for rank in range(64):
            register(coord, "worker", rank)
        path = tmp_path / state.STATE_FILE
        assert not path.exists() and coord.state_dirty
        coord.tick()
        assert len(json.loads(path.read_text())["nodes"]) == 65 and not coord.state_dirty
        register(coord, "worker", 64)  # the last one: the plan goes out and is saved with it
        assert coord.plan is not None
        assert len(json.loads(path.read_text())["nodes"]) == 66
    finally:
        server.close()


def test_a_node_parks_one_plan_request_at_most(tmp_path):
    """A shard that gave up waiting for a plan a push named (a bogus id) asks
    again later: the scheduler keeps only its newest parked GET_PLAN, so
    bogus ids cannot grow the waiting list; another node's request stays."""
    from hetps.proto.messages import GetPlan

    cfg = load_config(None, ["cluster.workers=1", "cluster.shards=1"])
    server = MemServer("mem://coordinator-parked")
    try:
        coord = Coordinator(server, cfg, run_dir=tmp_path)
        register(coord, "ps", 0)
        register(coord, "worker", 0)
        assert coord.plan is not None
        for req_id, after in enumerate((1_000, 2_000, 3_000), start=10):
            assert (
                coord.on_get_plan(b"shard", Envelope(GetPlan(after=after), req_id=req_id, src=1))
                is None
            )
        coord.on_get_plan(b"worker", Envelope(GetPlan(after=5), req_id=7, src=2))
        assert coord.plan_waiters == [(b"shard", 12, 3_000), (b"worker", 7, 5)]
    finally:
        server.close()


def test_held_heartbeats_are_answered_with_news_or_when_their_hold_runs_out(tmp_path):
    """Heartbeats with `hold_s` are long polls: the ACK comes when the hold
    (capped at cluster.heartbeat_s) runs out, at once when a newer plan or
    the node's stop arrives, or when the node's next heartbeat comes; a
    shard's stop waits for the workers to leave, as without holding."""
    from hetps.proto.messages import Ack, Bye, Heartbeat

    now = [100.0]
    cfg = load_config(None, ["cluster.workers=2", "cluster.shards=1", "cluster.heartbeat_s=0.5"])
    server = MemServer("mem://coordinator-held-beats")
    try:
        coord = Coordinator(server, cfg, run_dir=tmp_path, clock=lambda: now[0])
        shard, worker0, worker1 = (
            register(coord, "ps", 0),
            register(coord, "worker", 0),
            register(coord, "worker", 1),
        )
        assert coord.plan is not None and coord.plan.plan_id == 1
        sent: list[tuple[bytes, int, Ack]] = []
        coord.reply = lambda peer, req_id, msg: sent.append((peer, req_id, msg))

        def beat(node: int, req_id: int, hold_s: float = 5.0):
            return coord.on_heartbeat(
                b"n%d" % node,
                Envelope(Heartbeat(node_id=node, hold_s=hold_s), req_id=req_id, src=node),
            )

        now_ack = beat(worker0, 1, hold_s=0.0)  # no hold asked: answered now
        assert isinstance(now_ack, Ack) and not now_ack.stop and now_ack.plan_id == 1
        assert beat(worker0, 2) is None and beat(shard, 3) is None and beat(worker1, 4) is None
        now[0] += 0.4
        coord.tick()
        assert sent == []  # nothing new, and the hold (capped at heartbeat_s = 0.5) has not run out
        now[0] += 0.11
        coord.tick()
        assert sorted((p, r) for p, r, _ in sent) == [
            (b"n%d" % shard, 3),
            (b"n%d" % worker0, 2),
            (b"n%d" % worker1, 4),
        ]
        assert all(a.plan_id == 1 and not a.stop for _, _, a in sent)

        sent.clear()  # a newer beat of the same node answers its held one
        assert beat(worker0, 5) is None and beat(worker0, 6) is None
        assert [(r, a.stop) for _, r, a in sent] == [(5, False)]

        sent.clear()  # a new plan (worker 1 left) is news for every held beat
        assert beat(shard, 7) is None
        coord.on_bye(b"n%d" % worker1, Envelope(Bye(node_id=worker1), req_id=8, src=worker1))
        assert coord.plan.plan_id == 2
        coord.tick()
        assert sorted((r, a.plan_id, a.stop) for _, r, a in sent) == [(6, 2, False), (7, 2, False)]

        sent.clear()  # stop: the worker hears it at once; the shard once the workers are gone
        assert beat(worker0, 9) is None and beat(shard, 10) is None
        coord.begin_stop("test stop")
        coord.tick()
        assert [(r, a.stop, a.info.get("reason")) for _, r, a in sent] == [(9, True, "test stop")]
        coord.on_bye(b"n%d" % worker0, Envelope(Bye(node_id=worker0), req_id=11, src=worker0))
        coord.tick()
        assert [(r, a.stop) for _, r, a in sent[1:]] == [(10, True)]
        assert len(coord.held_beats) == 0
    finally:
        server.close()


def test_groups_re_form_only_once_every_worker_measured_its_speed(tmp_path):
    """Grouping-SGD: a worker's profiled speed (compute alone) is not comparable
    with the others' measured ones (compute and push): while one worker has
    not reported a measured speed, no re-grouping happens however far the
    others drifted; once it has, the groups re-form from measured speeds."""
    from hetps.proto.messages import Heartbeat

    now = [100.0]
    cfg = load_config(
        None,
        [
            "algorithm.name=grouping",
            "cluster.workers=3",
            "cluster.shards=1",
            "algorithm.regroup_every_s=1",
            "algorithm.confirm_checks=1",
        ],
    )
    server = MemServer("mem://coordinator-measured-speeds")
    try:
        coord = Coordinator(server, cfg, run_dir=tmp_path, clock=lambda: now[0])
        register(coord, "ps", 0)
        workers = [register(coord, "worker", r) for r in range(3)]  # profiled 1.0 each: one group
        assert coord.plan.plan_id == 1 and coord.plan.groups == [sorted(workers)]

        def beat(node: int, stats: dict) -> None:
            coord.on_heartbeat(
                b"n%d" % node,
                Envelope(Heartbeat(node_id=node, stats=NodeStats.read(stats)), req_id=3, src=node),
            )

        def beats(third: dict) -> None:
            beat(workers[0], {"speed": 100.0})
            beat(workers[1], {"speed": 10.0})  # 10x apart: two groups, were the third speed known
            beat(workers[2], third)
            now[0] += 1.5
            coord.tick()

        for _ in range(3):
            beats({"steps": 0})  # alive, no step measured yet
        assert coord.plan.plan_id == 1 and coord.failures == []
        beats({"speed": 95.0})
        assert coord.plan.plan_id == 2
        assert coord.plan.groups == [sorted([workers[0], workers[2]]), [workers[1]]]
    finally:
        server.close()


def test_a_worker_leaving_on_an_error_is_re_planned_at_once_and_nonfinite_everywhere_is_divergence(
    tmp_path,
):
    """BYE with `error`: recorded in failures and the worker leaves the plan at
    once (no dead_after_s of silence); when the last live worker leaves on
    NONFINITE (its pushes refused for NaN/Inf), the run stops as diverged,
    naming the learning rate."""
    from hetps.proto.messages import Bye, Status

    now = [100.0]
    cfg = load_config(
        None,
        ["cluster.workers=3", "cluster.shards=1", "cluster.dead_after_s=1000", "optimizer.lr=7"],
    )
    server = MemServer("mem://coordinator-error-bye")
    try:
        coord = Coordinator(server, cfg, run_dir=tmp_path, clock=lambda: now[0])
        register(coord, "ps", 0)
        workers = [register(coord, "worker", r) for r in range(3)]
        assert coord.plan.plan_id == 1

        def leave(node: int, error: str, refused: int = 0):
            coord.on_bye(
                b"n%d" % node,
                Envelope(Bye(node_id=node, error=error, refused=refused), req_id=5, src=node),
            )

        leave(
            workers[0],
            "RuntimeError: CUDA error: an illegal memory access (at model.py:9 in forward)",
        )
        assert coord.plan.plan_id == 2 and [w.node_id for w in coord.plan.workers] == workers[1:]
        assert coord.stop_reason is None
        (failure,) = coord.failures
        assert failure.kind == "worker_error" and failure.node == "worker0"
        assert "illegal memory access" in failure.error and failure.refused == 0
        nan = "ipc://ps0 refused PUSH: NONFINITE: tensor 'fc.weight' holds NaN or Inf"
        leave(workers[1], nan, Status.NONFINITE)  # one worker's NaN: the others go on
        assert coord.plan.plan_id == 3 and coord.stop_reason is None
        leave(workers[2], nan, Status.NONFINITE)  # the last one's too: the run diverged
        assert coord.stop_reason == "diverged" and coord.plan.plan_id == 3
        assert "worker2" in coord.guard.verdict and "optimizer.lr (now 7)" in coord.guard.verdict
        assert [f.refused for f in coord.failures] == [0, Status.NONFINITE, Status.NONFINITE]
        assert (
            coord.summary()["status"] == "diverged"
            and coord.summary()["detail"] == coord.guard.verdict
        )
    finally:
        server.close()
    # the last worker leaving on any other error: the run failed, naming it and its error
    server = MemServer("mem://coordinator-error-bye-2")
    try:
        coord = Coordinator(
            server, load_config(None, ["cluster.workers=1", "cluster.shards=1"]), run_dir=tmp_path
        )
        register(coord, "ps", 0)
        worker = register(coord, "worker", 0)
        timeout = "no reply from ipc://ps0 to PUSH within 30.0s"
        coord.on_bye(b"w", Envelope(Bye(node_id=worker, error=timeout), req_id=5, src=worker))
        s = coord.summary()
        assert (
            s["status"] == "failed" and s["failed_node"] == "worker0" and s["detail"] == timeout
        ), s
        assert coord.stop_reason.startswith("no live workers left"), coord.stop_reason
    finally:
        server.close()


@contextlib.contextmanager
def one_worker_and_an_evaluator(tmp_path, overrides: list[str], now: list[float]):
    """A coordinator (clock: `now[0]`) with a shard, a worker and an evaluator
    registered; yields it and the evaluator's node id."""
    cfg = load_config(None, ["cluster.workers=1", "cluster.shards=1", *overrides])
    server = MemServer(f"mem://coordinator-{tmp_path.name}")
    try:
        coord = Coordinator(server, cfg, run_dir=tmp_path, clock=lambda: now[0])
        register(coord, "ps", 0)
        register(coord, "worker", 0)
        yield coord, register(coord, "evaluator", 0)
    finally:
        server.close()


def evaluation(coord: Coordinator, evaluator: int, accuracy: float, now: list[float]) -> None:
    """The evaluator reports `accuracy` one second after the last report."""
    now[0] += 1.0
    coord.on_report(
        b"e",
        Envelope(
            Report(node_id=evaluator, kind="eval", values={"accuracy": accuracy}),
            req_id=2,
            src=evaluator,
        ),
    )


def test_target_patience_stops_on_the_nth_evaluation_in_a_row_at_the_target(tmp_path):
    """stop.target_patience=2: an evaluation at the target followed by one
    below it does not stop the run; two in a row do. The time to target is
    the first evaluation that reached it; a scheduler restored from its state
    keeps the streak."""
    from hetps.scheduler import state

    now = [0.0]
    with one_worker_and_an_evaluator(
        tmp_path, ["stop.target_accuracy=0.9", "stop.target_patience=2"], now
    ) as (coord, evaluator):
        for accuracy in (0.91, 0.88):
            evaluation(coord, evaluator, accuracy, now)
        # saved at the next tick: a restart keeps the break
        assert coord.evals.streak == 0 and coord.state_dirty
        evaluation(coord, evaluator, 0.92, now)
        assert coord.stop_reason is None and coord.evals.streak == 1
        coord.save_state()
        again = Coordinator(coord.server, coord.cfg, run_dir=tmp_path, clock=lambda: now[0])
        again.restore(state.read(tmp_path))
        evaluation(again, evaluator, 0.93, now)
        assert again.stop_reason == "target accuracy 0.9 reached (0.9300, held for 2 evaluations)"
        s = again.summary()
        assert s["time_to_target_s"] == coord.evals.time_to_target_s and s["target_patience"] == 2
        assert s["best_accuracy"] == 0.93 and s["final_accuracy"] == 0.93 and s["evals"] == 4


def test_target_patience_one_stops_at_the_first_evaluation_that_reaches_it(tmp_path):
    now = [0.0]
    with one_worker_and_an_evaluator(tmp_path, ["stop.target_accuracy=0.9"], now) as (
        coord,
        evaluator,
    ):
        evaluation(coord, evaluator, 0.5, now)
        assert coord.stop_reason is None
        evaluation(coord, evaluator, 0.9, now)
        assert coord.stop_reason == "target accuracy 0.9 reached (0.9000)"
