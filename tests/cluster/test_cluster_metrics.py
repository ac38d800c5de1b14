"""The operator's Prometheus endpoint on a real `hetps run --metrics` cluster,
scraped while it trains (the collector on fake stats: tests/inproc/test_metrics.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import urllib.error

from cluster_util import HETPS, REPO, log_tails, wait_for
from metrics_scrape import scrape, value

from hetps.runtime.metrics import read_targets

DAEMONS = ("scheduler", "ps0", "worker0", "worker1", "evaluator")


def metrics_addresses(run_dir) -> dict[str, str] | None:
    """Each daemon's metrics address from its log, once every daemon wrote one."""
    found = {}
    for name in DAEMONS:
        log = run_dir / "logs" / f"{name}.log"
        match = log.exists() and re.search(
            r"metrics at (http://\S+/metrics)", log.read_text(errors="replace")
        )
        if not match:
            return None
        found[name] = match.group(1)
    return found


def scrape_when(url: str, ready) -> list:
    """Scrape until `ready(samples)` holds (a daemon may still be starting)."""

    def attempt():
        try:
            samples = scrape(url)
        except (urllib.error.URLError, ConnectionError):
            return None
        return samples if ready(samples) else None

    return wait_for(attempt, 60, f"metrics at {url}", interval_s=0.5)


def test_cluster_daemons_serve_metrics_while_training(run_dir, tmp_path):
    stderr = open(tmp_path / "run.stderr", "w+")
    proc = subprocess.Popen(
        [
            *HETPS,
            "run",
            "configs/sync.yaml",
            "cluster.workers=2",
            "cluster.shards=1",
            "stop.target_accuracy=null",
            "stop.max_seconds=120",
            "--metrics",
            "--out",
            str(run_dir),
            "--quiet",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        start_new_session=True,
    )
    try:
        urls = wait_for(
            lambda: metrics_addresses(run_dir), 90, "every daemon to log its metrics address"
        )
        worker = scrape_when(urls["worker0"], lambda s: (value(s, "hetps_steps_total") or 0) > 2)
        me = {"role": "worker", "rank": "0"}
        assert value(worker, "hetps_bytes_sent_total", **me) > 0
        assert value(worker, "hetps_bytes_received_total", **me) > 0
        assert value(worker, "hetps_plan_id", **me) >= 1
        assert value(worker, "hetps_group", group="0", **me) == 1  # sync: one group
        assert value(worker, "hetps_staleness", **me) is not None
        steps = value(worker, "hetps_steps_total", **me)
        assert value(worker, "hetps_samples_total", **me) >= 32 * steps > 0  # sync.yaml: batch 32
        # one observation a step, made just after the step counter moves; the histograms are read
        # after the counter, and before a second scrape's counter
        steps_later = value(scrape(urls["worker0"]), "hetps_steps_total", **me)
        for name in (
            "hetps_step_duration_seconds",
            "hetps_push_duration_seconds",
            "hetps_compute_duration_seconds",
            "hetps_round_wait_seconds",
        ):
            count = value(worker, f"{name}_count", **me)
            assert steps - 1 <= count <= steps_later, (name, count, steps, steps_later)
            assert value(worker, f"{name}_bucket", le="+Inf", **me) == count, name
            assert 0 < value(worker, f"{name}_sum", **me) < 30 * count, name
        assert value(worker, "hetps_build_info", algorithm="sync", **me) == 1

        shard = scrape_when(urls["ps0"], lambda s: (value(s, "hetps_shard_version") or 0) > 0)
        me = {"role": "ps", "rank": "0"}
        assert value(shard, "hetps_plan_id", **me) >= 1
        assert value(shard, "hetps_pushes_total", **me) > 0
        assert value(shard, "hetps_malformed_total", **me) == 0
        assert value(shard, "hetps_parked_pulls", **me) is not None
        assert value(shard, "hetps_group_staleness", group="0", **me) >= 1

        scheduler = scrape_when(
            urls["scheduler"],
            lambda s: (
                value(s, "hetps_accuracy") is not None and (value(s, "hetps_global_steps") or 0) > 0
            ),
        )  # after a heartbeat
        me = {"role": "scheduler", "rank": "0"}
        assert value(scheduler, "hetps_nodes", node_role="worker", state="alive", **me) == 2
        assert value(scheduler, "hetps_nodes", node_role="ps", state="alive", **me) == 1
        assert value(scheduler, "hetps_nodes", node_role="evaluator", state="alive", **me) == 1
        assert value(scheduler, "hetps_global_steps", **me) > 0
        assert value(scheduler, "hetps_plan_id", **me) >= 1
        assert 0 <= value(scheduler, "hetps_accuracy", **me) <= 1

        evaluator = scrape_when(
            urls["evaluator"], lambda s: (value(s, "hetps_evals_total") or 0) >= 1
        )
        assert value(evaluator, "hetps_bytes_received_total", role="evaluator") > 0

        # the file_sd file lists every daemon at the address it logged, each answering a scrape
        targets = {
            e["labels"]["daemon"]: e["targets"]
            for e in read_targets(run_dir / "prometheus_targets.json")
        }
        assert targets == {
            name: [urls[name].removeprefix("http://").removesuffix("/metrics")] for name in DAEMONS
        }
        for name, (target,) in targets.items():
            assert (
                value(scrape(f"http://{target}/metrics"), "hetps_build_info", algorithm="sync") == 1
            ), name

        proc.send_signal(signal.SIGINT)  # everything is checked: a clean stop, not the time limit
        code = proc.wait(timeout=120)
        stderr.seek(0)
        assert code == 130, stderr.read() + log_tails(run_dir)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        stderr.close()
