"""The scheduler's stall attribution (scheduler/stalls.py) on an injected
clock: heartbeat stats in, the named node, its reason, the stall records and
the summary out."""

from __future__ import annotations

import pytest

from hetps.proto.records import NodeStats
from hetps.scheduler.nodes import Node
from hetps.scheduler.stalls import StallTracker

HB = 0.5  # heartbeat_s
DEAD = 5.0  # dead_after_s
SHARD = 1


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


def cluster(clock, workers: int = 4, **worker_stats) -> dict[int, Node]:
    """One shard (node 1) and `workers` workers (nodes 2..), all just heard from."""
    nodes = {SHARD: Node(SHARD, "ps", 0, "", clock.now)}
    for rank in range(workers):
        stats = {"compute_s": 0.01, "push_s": 0.002, **worker_stats.get(f"w{rank}", {})}
        nodes[2 + rank] = Node(2 + rank, "worker", rank, "", clock.now, stats=stats)
    return nodes


def beat(tracker, nodes, clock, node_id=SHARD, **stats):
    """A heartbeat from `node_id` with `stats` (read as from the wire)."""
    nodes[node_id].stats = NodeStats.read(stats)
    nodes[node_id].last_seen = clock.now
    if nodes[node_id].role == "ps":
        tracker.on_heartbeat(nodes[node_id])


def everyone_beats(tracker, nodes, clock, **shard_stats):
    for n in nodes.values():
        if n.role == "worker":
            n.last_seen = clock.now
    beat(tracker, nodes, clock, **shard_stats)


def test_a_worker_the_round_waits_for_is_named_with_its_reason(clock):
    t = StallTracker(HB, DEAD, clock)
    nodes = cluster(clock, w3={"compute_s": 0.1, "push_s": 0.002})
    everyone_beats(t, nodes, clock, waiting=[{"node": 5, "for_s": 0.7, "waiters": [2, 3, 4]}])
    [b] = t.blockers(nodes)
    assert (b.node, b.reason, b.waiters) == ("worker3", "compute", 3)
    assert b.since == pytest.approx(clock.now - 0.7)


def test_a_short_wait_is_no_stall(clock):
    t = StallTracker(HB, DEAD, clock)
    nodes = cluster(clock)
    everyone_beats(t, nodes, clock, waiting=[{"node": 5, "for_s": 0.01, "waiters": [2]}])
    assert t.blockers(nodes) == []


@pytest.mark.parametrize("released_s, named", [(0.45, True), (0.1, False)])
def test_a_node_whose_pushes_release_the_waiters_most_of_the_time_is_named(
    clock, released_s, named
):
    # a heartbeat may fall between two rounds: what its pushes released over the interval decides
    t = StallTracker(HB, DEAD, clock)
    nodes = cluster(clock)
    everyone_beats(t, nodes, clock, held=[{"node": 5, "s": 3.0, "waiters": 3}])
    clock.now += HB
    everyone_beats(t, nodes, clock, held=[{"node": 5, "s": 3.0 + released_s, "waiters": 3}])
    assert [(b.node, b.reason, b.waiters) for b in t.blockers(nodes)] == (
        [("worker3", "compute", 3)] if named else []
    )


def test_a_worker_pushing_slower_than_it_computes_is_named_for_the_network(clock):
    t = StallTracker(HB, DEAD, clock)
    nodes = cluster(clock, w1={"compute_s": 0.01, "push_s": 0.2})
    everyone_beats(t, nodes, clock, waiting=[{"node": 3, "for_s": 1.0, "waiters": [2]}])
    assert [(b.node, b.reason) for b in t.blockers(nodes)] == [("worker1", "network")]


def test_a_silent_worker_is_unresponsive_before_it_is_dead(clock):
    t = StallTracker(HB, DEAD, clock)
    nodes = cluster(clock)
    for step in range(1, 11):  # worker2 (node 4) stopped; the shard waits for it, growing
        clock.now += HB
        for n in nodes.values():
            if n.node_id != 4 and n.role == "worker":
                n.last_seen = clock.now
        beat(t, nodes, clock, waiting=[{"node": 4, "for_s": step * HB, "waiters": [2, 3, 5]}])
        reasons = [b.reason for b in t.blockers(nodes) if b.node == "worker2"]
        silent = step * HB
        assert reasons == (["unresponsive"] if silent > t.unresponsive_after_s else ["compute"]), (
            step
        )
    nodes[4].dead = True
    assert [(b.node, b.reason) for b in t.blockers(nodes)] == [("worker2", "dead")]
    assert t.unresponsive_after_s < DEAD


def test_a_busy_shard_is_named_instead_of_the_workers_whose_pushes_it_slows(clock):
    t = StallTracker(HB, DEAD, clock)
    nodes = cluster(clock, w0={"compute_s": 0.01, "push_s": 0.3})
    everyone_beats(t, nodes, clock, busy_s=10.0)
    clock.now += HB
    everyone_beats(
        t, nodes, clock, busy_s=10.45, waiting=[{"node": 2, "for_s": 0.6, "waiters": [3, 4, 5]}]
    )
    assert [(b.node, b.reason, b.waiters) for b in t.blockers(nodes)] == [("ps0", "shard busy", 4)]


def test_a_silent_shard_is_named_though_nobody_reports_it(clock):
    t = StallTracker(HB, DEAD, clock)
    nodes = cluster(clock)
    clock.now += 2.0
    for n in nodes.values():
        if n.role == "worker":
            n.last_seen = clock.now
    assert [(b.node, b.reason, b.waiters) for b in t.blockers(nodes)] == [
        ("ps0", "unresponsive", 4)
    ]


def test_stall_records_once_per_heartbeat_then_an_ended_record_and_the_summary(clock):
    t = StallTracker(HB, DEAD, clock)
    nodes = cluster(clock, w3={"compute_s": 0.1})
    wait = lambda s: [{"node": 5, "for_s": s, "waiters": [2, 3, 4]}]  # noqa: E731
    everyone_beats(t, nodes, clock, waiting=wait(1.0))
    [first] = t.update(nodes)
    assert first == {
        "node": "worker3",
        "reason": "compute",
        "for_s": 1.0,
        "waiting": 3,
        "ended": False,
    }
    clock.now += HB / 2
    assert t.update(nodes) == []  # at most once per heartbeat
    clock.now += HB / 2
    everyone_beats(t, nodes, clock, waiting=wait(1.5))
    [again] = t.update(nodes)
    assert again["for_s"] == 1.5 and not again["ended"]
    assert t.gauges() == {"worker3": {"compute": 1.5}}
    clock.now += HB
    everyone_beats(t, nodes, clock, waiting=[])
    [end] = t.update(nodes)
    assert end == {
        "node": "worker3",
        "reason": "compute",
        "for_s": 1.5,
        "waiting": 3,
        "ended": True,
    }
    assert t.current() == [] and t.gauges() == {}
    summary = t.summary([("worker3", 1.2), ("worker3", 1.4)])
    assert summary == {
        "worker3": {"held_s": 1.5, "by_reason": {"compute": 1.5}, "stalls": 1, "shard_held_s": 1.4}
    }


def test_stopping_ends_every_open_stall(clock):
    t = StallTracker(HB, DEAD, clock)
    nodes = cluster(clock)
    everyone_beats(t, nodes, clock, waiting=[{"node": 2, "for_s": 2.0, "waiters": [3]}])
    assert len(t.update(nodes)) == 1
    clock.now += 0.1
    [end] = t.update(nodes, stopping=True)
    assert end["ended"] and end["node"] == "worker0" and t.current() == []


# ---------------------------------------------------------------- the progress line


def test_the_progress_line_names_the_blocker_and_the_groups(tmp_path):
    import json

    from hetps.frontend.report import Progress

    path = tmp_path / "metrics.jsonl"
    progress = Progress(path, target=0.95, max_seconds=240)

    def write(**rec):
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        progress.poll()
        return progress.line()

    write(kind="plan", t=0.0, plan_id=1, groups=[[2, 3], [4, 5, 6]])
    line = write(
        kind="stall", t=5.0, node="worker4", reason="compute", for_s=3.2, waiting=5, ended=False
    )
    assert "groups 2+3" in line and "target 0.95" in line and "/240s" in line, line
    assert line.endswith("waiting 3.2 s for worker4 (compute) — 5 workers idle"), line
    line = write(
        kind="stall", t=5.5, node="ps1", reason="unresponsive", for_s=1.0, waiting=1, ended=False
    )
    assert line.endswith("waiting 3.2 s for worker4 (compute) and 1 more — 5 workers idle"), line
    write(kind="stall", t=6.0, node="worker4", reason="compute", for_s=4.0, waiting=5, ended=True)
    line = write(kind="step", t=6.1, worker=0, step=10, loss=1.0)
    assert line.endswith("waiting 1.0 s for ps1 (unresponsive) — 1 worker idle"), line
    # no fresh stall record: not shown
    line = write(kind="step", t=9.0, worker=0, step=20, loss=1.0)
    assert "waiting" not in line, line


def test_the_stall_gauge_has_node_and_reason_labels():
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from hetps.runtime.metrics import StatsCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        StatsCollector(
            "scheduler",
            0,
            lambda: {
                "stall_s": {"worker4": {"compute": 3.2}},
                "stall_held_s": {"worker4": 7.5, "ps1": 1.0},
            },
        )
    )
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())
    }
    [gauge] = families["hetps_stall_seconds"].samples
    assert gauge.labels == {
        "role": "scheduler",
        "rank": "0",
        "node": "worker4",
        "reason": "compute",
    }
    assert gauge.value == 3.2
    held = {
        s.labels["node"]: s.value
        for s in families["hetps_stall_held_seconds"].samples
        if s.name.endswith("_total")
    }
    assert held == {"worker4": 7.5, "ps1": 1.0}


def test_a_named_node_stays_named_while_it_still_holds_a_quarter_of_the_time(clock):
    t = StallTracker(HB, DEAD, clock)
    nodes = cluster(clock)
    held = 0.0
    names = []
    for released in (0.0, 0.4, 0.15, 0.15, 0.1, 0.2):  # seconds released per half-second interval
        held += released
        everyone_beats(t, nodes, clock, held=[{"node": 5, "s": held, "waiters": 3}])
        t.update(nodes)
        names.append([s.node for s in t.current()])
        clock.now += HB
    assert names == [[], ["worker3"], ["worker3"], ["worker3"], [], []]


# ---------------------------------------------------------------- the coordinator's side


def test_the_coordinator_writes_stall_records_metrics_and_the_summary(tmp_path):
    import json

    from hetps.proto.codec import Envelope
    from hetps.proto.messages import Heartbeat, Register
    from hetps.proto.plan import TensorSpec
    from hetps.proto.transport import MemServer
    from hetps.runconfig.load import load_config
    from hetps.scheduler.coordinator import Coordinator

    cfg = load_config(None, ["cluster.workers=2", "cluster.shards=1", "cluster.heartbeat_s=0.5"])
    server = MemServer("mem://coordinator-stalls")
    try:
        coord = Coordinator(server, cfg, run_dir=tmp_path)
        ids = {}
        for role, rank in (("ps", 0), ("worker", 0), ("worker", 1)):
            msg = Register(
                role=role,
                rank=rank,
                address="mem://ps0" if role == "ps" else "",
                speed=1.0,
                tensor_specs=[TensorSpec("w", "float32", (2,))] if role == "worker" else [],
            )
            ids[f"{role}{rank}"] = coord.on_register(
                b"peer", Envelope(msg, req_id=1, src=0)
            ).node_id
        assert coord.plan is not None

        def heartbeat(name, **stats):
            coord.on_heartbeat(
                b"peer",
                Envelope(
                    Heartbeat(node_id=ids[name], stats=NodeStats.read(stats)),
                    req_id=2,
                    src=ids[name],
                ),
            )

        heartbeat("worker0", compute_s=0.01, push_s=0.001)
        heartbeat("worker1", compute_s=0.002, push_s=0.05)  # its pushes are what takes long
        heartbeat(
            "ps0",
            waiting=[{"node": ids["worker1"], "for_s": 1.2, "waiters": [ids["worker0"]]}],
            held=[{"node": ids["worker1"], "s": 3.0, "waiters": 1}],
        )
        coord.tick()
        [rec] = [
            json.loads(line)
            for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
            if '"stall"' in line
        ]
        assert (rec["node"], rec["reason"], rec["waiting"], rec["ended"]) == (
            "worker1",
            "network",
            1,
            False,
        )
        assert rec["for_s"] >= 1.2
        assert list(coord.metrics()["stall_s"]) == ["worker1"]
        assert coord.metrics()["stall_s"]["worker1"]["network"] >= 1.2
        stalls = coord.summary()["stalls"]
        assert set(stalls) == {"worker1"} and stalls["worker1"]["shard_held_s"] == 3.0
        assert stalls["worker1"]["held_s"] >= 1.2 and stalls["worker1"]["stalls"] == 1
    finally:
        server.close()


def test_the_progress_line_leaves_out_one_group_per_worker(tmp_path):
    import json

    from hetps.frontend.report import Progress

    path = tmp_path / "metrics.jsonl"
    path.write_text(
        json.dumps({"kind": "plan", "t": 0.0, "plan_id": 1, "groups": [[2], [3], [4]]}) + "\n"
    )
    progress = Progress(path, max_seconds=60)
    progress.poll()
    assert "groups" not in progress.line()
