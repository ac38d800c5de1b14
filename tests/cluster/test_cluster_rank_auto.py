"""`--rank auto` with real daemons: a shard and two workers without an index claim
their ranks from the scheduler and train under them (the coordinator's side in
one process: tests/inproc/test_rank_auto.py)."""

from __future__ import annotations

from cluster_util import REPO, Daemons, records, summary


def test_daemons_with_rank_auto_train_under_the_ranks_they_claimed(tmp_path):
    """Real processes: a shard and two workers started with --rank auto (HETPS_RANK=auto for one);
    the run completes and its records name the claimed ranks: ps0, and workers 2 and 3 beyond
    the two configured worker ranks (0, 1), which nobody took. The plan waits for both workers."""
    run_dir = tmp_path / "auto"
    config = str(REPO / "configs" / "sync.yaml")
    daemons = Daemons(
        tmp_path,
        [
            "cluster.workers=2",
            "cluster.shards=1",
            "cluster.profile_steps=1",
            "eval.enabled=false",
            "stop.target_accuracy=null",
            "stop.max_steps=20",
            "stop.max_seconds=60",
        ],
    )
    try:
        addr = daemons.scheduler(config, run_dir)
        daemons.start(["ps", "--config", config, "--rank", "auto", "--scheduler", addr])
        daemons.start(["worker", "--config", config, "--rank", "auto", "--scheduler", addr])
        daemons.start(
            ["worker", "--config", config, "--scheduler", addr], env={"HETPS_RANK": "auto"}
        )
        codes = daemons.wait(timeout_s=120)
    finally:
        daemons.close()
    assert codes == [0, 0, 0, 0], daemons.tails()
    outcome = summary(run_dir)
    assert outcome["status"] == "completed" and outcome["global_steps"] >= 20, outcome
    assert set(outcome["per_node"]) == {"worker2", "worker3"} and set(
        outcome["shard_versions"]
    ) == {"ps0"}
    assert {r["worker"] for r in records(run_dir, "step")} == {2, 3}
