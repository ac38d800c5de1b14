"""Configuration drift across hosts, with real processes: daemons started by hand against one
scheduler, each with its own command-line overrides, as on hosts whose config files drifted
apart. The scheduler refuses every node whose agreed settings (runconfig/agreement.py) differ,
or whose rank the configuration does not have; the node exits 2 naming each key and both
values; the scheduler's log names it while the cluster forms, and its start-up failure names the
nodes it refused and why. A node that agrees still joins and the run trains."""

from __future__ import annotations

import signal

import yaml
from cluster_util import Daemons, records, summary, wait_for

from hetps.runconfig.agreement import agreed_values
from hetps.runconfig.load import load_config
from hetps.runtime.membership import Membership

BASE = {
    "seed": 0,
    "model": {"name": "mlp"},
    "data": {"dataset": "mnist-5k", "batch_size": 32},
    "optimizer": {"name": "sgd", "lr": 0.05},
    "algorithm": {"name": "sync"},
    "cluster": {
        "shards": [{}],
        "workers": [{}, {}],
        "profile_steps": 1,
        "startup_timeout_s": 300,
    },
    "stop": {"target_accuracy": None, "max_steps": 40, "max_seconds": 120},
    "eval": {"every_s": 1.0},
}
STARTUP_TIMEOUT_S = 6
# node name -> (role flags, overrides, what its error line must hold)
DRIFTED = {
    "ps-lr": (
        ["ps", "--rank", "0"],
        ["optimizer.lr=0.1"],
        ["optimizer: ", '"lr": 0.1', '"lr": 0.05'],
    ),
    "worker-count": (
        ["worker", "--rank", "1"],
        ["cluster.workers=3"],
        ["cluster.workers: 3 (worker 1) vs 2 (scheduler)"],
    ),
    "worker-model": (
        ["worker", "--rank", "1"],
        ["model.name=lenet5"],
        ["model.name: 'lenet5' (worker 1) vs 'mlp' (scheduler)"],
    ),
    "worker-data-seed-algorithm": (
        ["worker", "--rank", "1"],
        ["seed=7", "data.batch_size=64", "algorithm.name=ssp"],
        [
            "seed: 7 (worker 1) vs 0 (scheduler)",
            "data.batch_size: 64 (worker 1) vs 32 (scheduler)",
            "algorithm.name: 'ssp' (worker 1) vs 'sync' (scheduler)",
            "algorithm.params: ",
        ],
    ),
    "worker-rank": (
        ["worker", "--rank", "2"],
        [],
        ["worker rank 2 is not one of the configured ranks 0..1 (cluster.workers has 2"],
    ),
}


def write_base(tmp_path) -> str:
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(BASE))
    return str(path)


def test_each_kind_of_drift_is_refused_naming_the_keys_and_the_run_goes_on(tmp_path):
    config = write_base(tmp_path)
    run_dir = tmp_path / "drift"
    daemons = Daemons(tmp_path, [])
    try:
        addr = daemons.scheduler(config, run_dir)

        def start(flags: list[str], overrides: list[str]) -> int:
            daemons.start(
                [flags[0], "--config", config, *flags[1:], "--scheduler", addr, *overrides]
            )
            return len(daemons.procs) - 1

        drifted = {name: start(flags, overrides) for name, (flags, overrides, _) in DRIFTED.items()}
        codes = {name: daemons.procs[i].wait(timeout=240) for name, i in drifted.items()}
        logs = {name: (tmp_path / f"{i}.log").read_text() for name, i in drifted.items()}
        # every drifted node refused, each exiting 2 with one config-error line naming its keys
        for name, (_, _, expected) in DRIFTED.items():
            lines = [x for x in logs[name].splitlines() if x.startswith("hetps: config error: ")]
            assert codes[name] == 2 and len(lines) == 1, (name, codes[name], logs[name][-2000:])
            for text in expected:
                assert text in lines[0], (name, text, lines[0])
        # the scheduler said whom it refused and what it still waits for
        sched_log = (tmp_path / "0.log").read_text()
        for node in ("ps0", "worker1", "worker2"):
            assert f"refused {node} from host " in sched_log, sched_log[-3000:]
        assert "still waiting for {'ps': 1, 'worker': 2}" in sched_log, sched_log[-3000:]
        refused = {r["node"] for r in records(run_dir, "refused")}
        assert refused == {"ps0", "worker1", "worker2"}, records(run_dir, "refused")
        # the nodes that agree form the cluster and train; the evaluator first, registered before
        # the plan (the scheduler does not wait for it, and 40 steps of an MLP take under a
        # second: an evaluator that joined later once found the run already over)
        start(["worker", "--evaluator"], [])
        wait_for(
            lambda: "registered evaluator" in (tmp_path / "0.log").read_text(),
            180,
            "the evaluator's registration",
        )
        start(["ps", "--rank", "0"], [])
        start(["worker", "--rank", "0"], [])
        start(["worker", "--rank", "1"], [])
        wait_for(lambda: records(run_dir, "eval"), 180, "an evaluation of the agreeing cluster")
        daemons.procs[0].send_signal(signal.SIGTERM)
        codes = daemons.wait(120)
    finally:
        daemons.close()
    assert codes[-4:] == [0, 0, 0, 0] and codes[0] == 0, daemons.tails()  # evaluator, ps, workers
    s = summary(run_dir)
    # the agreeing workers trained; the refused worker 2 never took part
    assert set(s["per_node"]) == {"worker0", "worker1", "evaluator0"}, s["per_node"]
    assert s["per_node"]["worker1"]["steps"] > 0 and "ps0" in s["shard_stats"], s


def test_the_start_up_failure_names_the_refused_node_and_why(tmp_path):
    """A node refused for drift never registers: the scheduler's start-up timeout names it (a
    real scheduler process; the node is this test's own client, registering over ZeroMQ with the
    settings its drifted config gives)."""
    # short: the test's own client registers within a second of the scheduler's start (its
    # start-up timer), and the scheduler waits the whole timeout out before it fails the run
    BASE["cluster"]["startup_timeout_s"] = STARTUP_TIMEOUT_S
    try:
        config = write_base(tmp_path)
    finally:
        BASE["cluster"]["startup_timeout_s"] = 300
    run_dir = tmp_path / "timeout"
    daemons = Daemons(tmp_path, [])
    try:
        addr = daemons.scheduler(config, run_dir)
        drifted = load_config(config, ["model.name=lenet5"])
        member = Membership(addr, "worker", 1, drifted.cluster)
        try:
            member.join(agreed=agreed_values(drifted))
        except SystemExit as exc:  # a daemon exits 2 here, after printing the scheduler's answer
            assert exc.code == 2
        else:
            raise AssertionError("the drifted worker was admitted")
        finally:
            member.close()
        code = daemons.procs[0].wait(timeout=120)
    finally:
        daemons.close()
    s = summary(run_dir)
    reason = s["stop_reason"]
    assert reason.startswith(f"cluster did not form within {STARTUP_TIMEOUT_S}"), reason
    assert "still waiting for {'ps': 1, 'worker': 2}" in reason, reason
    assert "refused worker1 from host " in reason, reason
    assert "model.name: 'lenet5' (worker 1) vs 'mlp' (scheduler)" in reason, reason
    (startup,) = [f for f in s["failures"] if f["kind"] == "startup"]
    assert [r["node"] for r in startup["refused"]] == ["worker1"], startup
    assert code != 0, daemons.tails()
