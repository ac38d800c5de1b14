"""A worker daemon whose algorithm parameters differ from the scheduler's, with real daemons:
the scheduler refuses its registration (the settings every host must agree on,
runconfig/agreement.py; every kind of drift: test_cluster_config_drift.py) and the worker exits 2
naming both values. (The plan's own check, for a node that sends no settings: in-process, in
tests/inproc/test_algorithm_table.py.)"""

from __future__ import annotations

from cluster_util import REPO, Daemons


def test_a_worker_daemon_whose_config_differs_from_the_plan_exits_2_naming_both(tmp_path):
    """Real processes: scheduler and shard run ssp with staleness 2 (configs/ssp.yaml),
    the worker's command line says 3; the scheduler refuses it."""
    run_dir = tmp_path / "mismatch"
    config = str(REPO / "configs" / "ssp.yaml")
    daemons = Daemons(
        tmp_path,
        ["cluster.workers=1", "cluster.shards=1", "cluster.profile_steps=1", "stop.max_seconds=60"],
    )
    try:
        addr = daemons.scheduler(config, run_dir)
        daemons.start(["ps", "--config", config, "--rank", "0", "--scheduler", addr])
        daemons.start(
            [
                "worker",
                "--config",
                config,
                "--rank",
                "0",
                "--scheduler",
                addr,
                "algorithm.staleness=3",
            ]
        )
        worker = daemons.procs[-1]
        code = worker.wait(timeout=120)
        log = (tmp_path / f"{len(daemons.procs) - 1}.log").read_text()
    finally:
        daemons.close()
    assert code == 2, daemons.tails()
    line = next(x for x in log.splitlines() if x.startswith("hetps: config error: "))
    assert "algorithm.params: " in line and '"staleness": 3' in line and '"staleness": 2' in line
    assert line.index('"staleness": 3') < line.index("(worker 0)") < line.index('"staleness": 2')
