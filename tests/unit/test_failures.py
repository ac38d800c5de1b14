"""runtime/failures.py: one typed record per failure, written to summary.json and the
scheduler's state file in the shape each kind has always had."""

import json

import pytest

from hetps.runtime.failures import KINDS, Failure, declared_dead

# one of each kind as summary.json holds it (the keys, in order, are the record's shape)
WRITTEN = [
    {"kind": "worker_dead", "node": "worker1", "node_id": 4, "t": 9.5, "silent_s": 3.2},
    {"kind": "shard_dead", "node": "ps0", "node_id": 1, "t": 9.5, "silent_s": 3.2},
    {
        "kind": "evaluator_error",
        "node": "evaluator0",
        "node_id": 6,
        "t": 2.0,
        "error": "RuntimeError: x",
        "refused": 0,
    },
    {"kind": "shard_restarted", "node": "ps1", "t": 4.0, "was_dead": True},
    {
        "kind": "shard_failover",
        "node": "ps0",
        "node_id": 1,
        "t": 5.0,
        "plan_id": 3,
        "served_by": {"0": 2},
        "backups": {},
    },
    {
        "kind": "startup_failed",
        "node": "worker1",
        "host": "h",
        "error": "ValueError: no file",
        "t": 0.4,
        "reason": "worker1 on h failed at start-up: ValueError: no file",
    },
    {
        "kind": "checkpoint_damaged",
        "node": "ps0",
        "node_id": 1,
        "t": 1.0,
        "file": "/c/v40.pt",
        "error": "cut short",
        "restored_version": 20,
    },
    {"kind": "config", "node": None, "t": 3.0, "error": "stop.target.metric: 'r2' is not ..."},
    {"kind": "timer_error", "timer": "save_when_due", "error": "OSError()", "t": 7.0},
    {
        "kind": "startup",
        "missing": {"worker": 1},
        "refused": [{"node": "worker2", "host": "h", "reason": "drift", "t": 0.2}],
    },
    {"kind": "no_steps", "t": 5.0, "error": "no training step was taken (time limit 5s)"},
]


@pytest.mark.parametrize("written", WRITTEN, ids=[w["kind"] for w in WRITTEN])
def test_each_kind_reads_back_and_writes_the_same_json(written):
    failure = Failure.from_json(json.loads(json.dumps(written)))
    assert list(failure.to_json().items()) == list(written.items())


def test_a_node_failure_is_named_by_its_role():
    assert Failure.of_node("ps", 2, 7, "dead", 1.5, silent_s=3.0).to_json() == {
        "kind": "shard_dead",
        "node": "ps2",
        "node_id": 7,
        "t": 1.5,
        "silent_s": 3.0,
    }
    error = Failure.of_node("worker", 0, 3, "error", 2.0, error="boom", refused=0)
    assert (error.kind, error.node, error.error, error.refused) == (
        "worker_error",
        "worker0",
        "boom",
        0,
    )
    # `startup`'s refused nodes and `{role}_error`'s refused status share the JSON key
    startup = Failure("startup", missing={}, refused_nodes=[])
    assert startup.to_json() == {"kind": "startup", "missing": {}, "refused": []}


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown failure kind 'worker_lost'"):
        Failure("worker_lost")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown failure kind"):
        Failure.from_json({"kind": "nope"})
    assert {w["kind"] for w in WRITTEN} <= KINDS


def test_a_node_stays_declared_dead_until_it_is_restarted():
    failures = [
        Failure.of_node("worker", 1, 3, "dead", 4.0, silent_s=3.0).to_json(),
        Failure.of_node("ps", 1, 2, "dead", 5.0, silent_s=3.0).to_json(),
        Failure("shard_restarted", node="ps1", t=6.0, was_dead=True).to_json(),
        Failure.of_node("worker", 2, 4, "error", 7.0, error="boom", refused=0).to_json(),
    ]
    assert declared_dead(failures) == {"worker1"}
    # declared dead again after its restart
    again = Failure.of_node("ps", 1, 5, "dead", 9.0, silent_s=3.0).to_json()
    assert declared_dead([*failures, again]) == {"worker1", "ps1"}
    assert declared_dead([{"kind": "worker_dead"}, {"kind": "no_steps", "t": 1.0}]) == set()
