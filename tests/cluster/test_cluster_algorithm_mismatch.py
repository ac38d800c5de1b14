"""The algorithm table's plan check with real daemons (the in-process checks are in
tests/inproc/test_algorithm_table.py): a worker daemon whose algorithm
parameters differ from the plan's refuses it, naming both values."""

from __future__ import annotations

from cluster_util import REPO, Daemons


def test_a_worker_daemon_whose_config_differs_from_the_plan_exits_2_naming_both(tmp_path):
    """Real processes: scheduler and shard run ssp with staleness 2 (configs/ssp.yaml),
    the worker's command line says 3; the worker refuses the plan."""
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
    assert "algorithm mismatch in staleness: this node's config says {staleness: 3}" in log, log
    assert "says {staleness: 2}" in log, log
