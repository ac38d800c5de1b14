"""The operator's Prometheus endpoint: the collector on a fake stats dict, served
over HTTP in this process (a real `hetps run --metrics` cluster scraped while it
trains: tests/cluster/test_cluster_metrics.py)."""

from __future__ import annotations

import argparse
import json
import math
import re
import socket
import urllib.request

import pytest
from metrics_scrape import scrape, value
from prometheus_client.parser import text_string_to_metric_families

from hetps.runtime.daemon import common_args
from hetps.runtime.histogram import Histogram
from hetps.runtime.metrics import METRICS, add_target, read_targets, serve_metrics, stop_metrics


@pytest.fixture
def served():
    addresses = []

    def serve(stats, role="worker", rank=3, **kwargs):
        address = serve_metrics(0, "127.0.0.1", role, rank, stats, **kwargs)
        addresses.append(address)
        return address

    yield serve
    for address in addresses:
        stop_metrics(address)


def test_worker_and_shard_stats_become_labelled_metrics(served):
    stats = {
        "steps": 7,
        "samples": 224,
        "bytes_sent": 1000,
        "bytes_received": 2000,
        "plan_id": 2,
        "group": 1,
        "staleness": 3,
        "version": 40,
        "parked": 2,
        "malformed": 1,
        "group_staleness": {"0": 1.0, "1": 2.5},
        "group_updates": {"0": 30, "1": 10},
    }
    url = served(lambda: stats)
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url)
    samples = scrape(url)
    me = {"role": "worker", "rank": "3"}
    assert value(samples, "hetps_steps_total", **me) == 7
    assert value(samples, "hetps_samples_total", **me) == 224
    assert value(samples, "hetps_bytes_sent_total", **me) == 1000
    assert value(samples, "hetps_bytes_received_total", **me) == 2000
    assert value(samples, "hetps_plan_id", **me) == 2
    assert value(samples, "hetps_group", group="1", **me) == 1
    assert value(samples, "hetps_staleness", **me) == 3
    assert value(samples, "hetps_shard_version", **me) == 40
    assert value(samples, "hetps_parked_pulls", **me) == 2
    assert value(samples, "hetps_malformed_total", **me) == 1
    assert value(samples, "hetps_group_staleness", group="1", **me) == 2.5
    assert value(samples, "hetps_group_updates_total", group="0", **me) == 30
    assert value(samples, "process_cpu_seconds_total") is not None
    stats["steps"] = 8  # read at scrape time, not at start
    assert value(scrape(url), "hetps_steps_total") == 8


def test_scheduler_nodes_by_role_and_state(served):
    url = served(
        lambda: {
            "nodes": {"worker": {"alive": 3, "dead": 1}, "ps": {"alive": 2}},
            "global_steps": 500,
            "accuracy": 0.91,
            "plan_id": 3,
        },
        role="scheduler",
        rank=0,
    )
    samples = scrape(url)
    assert (
        value(samples, "hetps_nodes", node_role="worker", state="dead", role="scheduler", rank="0")
        == 1
    )
    assert value(samples, "hetps_nodes", node_role="ps", state="alive") == 2
    assert value(samples, "hetps_global_steps") == 500
    assert value(samples, "hetps_accuracy") == 0.91


def test_unknown_and_non_numeric_stats_are_skipped(served):
    url = served(
        lambda: {
            "steps": "many",
            "plan_id": None,
            "staleness": float("nan"),
            "version": True,
            "group": "fast",
            "group_staleness": {"0": "x", "1": 2},
            "nodes": [1, 2],
            "bytes_sent": float("inf"),
            "mystery": 5,
            "lr": {"nested": 1},
            "loss": 0.5,
        }
    )
    samples = scrape(url)
    names = {
        s.name for s in samples if s.name.startswith("hetps_") and s.name != "hetps_build_info"
    }
    assert names == {"hetps_group_staleness", "hetps_loss"}
    assert value(samples, "hetps_group_staleness", group="1") == 2


def test_a_failing_stats_call_still_answers(served):
    def broken():
        raise RuntimeError("dictionary changed size during iteration")

    samples = scrape(served(broken, histograms=broken))
    assert {s.name for s in samples if s.name.startswith("hetps_")} == {"hetps_build_info"}
    assert value(samples, "process_cpu_seconds_total") is not None


def test_histogram_counts_cumulative_buckets():
    h = Histogram((0.1, 1.0))
    # negative and NaN: a clock step, ignored
    for seconds in (0.05, 0.1, 0.5, 3.0, -1.0, float("nan")):
        h.observe(seconds)
    snap = h.snapshot()
    # le: 0.1 itself falls in the 0.1 bucket
    assert snap["buckets"] == [[0.1, 2], [1.0, 3], [math.inf, 4]]
    assert snap["count"] == 4 and snap["sum"] == pytest.approx(3.65)
    with pytest.raises(ValueError, match="increasing"):
        Histogram((1.0, 0.5))


def test_durations_are_histograms_and_build_info_names_the_run(served):
    step = Histogram()
    for seconds in (0.02, 0.03, 0.4):
        step.observe(seconds)
    url = served(
        lambda: {"steps": 3},
        histograms=lambda: {"step_s": step.snapshot(), "push_s": "junk"},
        algorithm="grouping",
    )
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    hist = families["hetps_step_duration_seconds"]
    assert hist.type == "histogram"
    samples = hist.samples
    assert value(samples, "hetps_step_duration_seconds_count", role="worker", rank="3") == 3
    assert value(samples, "hetps_step_duration_seconds_sum") == pytest.approx(0.45)
    assert value(samples, "hetps_step_duration_seconds_bucket", le="0.025") == 1
    assert value(samples, "hetps_step_duration_seconds_bucket", le="0.5") == 3
    assert value(samples, "hetps_step_duration_seconds_bucket", le="+Inf") == 3
    # a malformed snapshot is skipped, not fatal
    assert "hetps_push_duration_seconds" not in families
    (info,) = families["hetps_build_info"].samples
    assert (
        info.value == 1
        and info.labels["algorithm"] == "grouping"
        and info.labels["role"] == "worker"
    )
    assert info.labels["version"] and info.labels["torch_version"].split(".")[0].isdigit()


def test_no_metric_is_a_precomputed_rate_or_average():
    """Rates are left to PromQL over counters; durations are histograms (HISTOGRAMS)."""
    for key, spec in METRICS.items():
        assert "moving average" not in spec.help.lower(), key
        # speed: the plan's input
        assert not spec.name.endswith("_per_second") or key == "speed", key


def test_targets_file_lists_each_daemon_once(tmp_path):
    path = tmp_path / "run7" / "prometheus_targets.json"
    add_target(path, "127.0.0.1", 9101, "ps0")
    add_target(path, "0.0.0.0", 9102, "worker0")  # a wildcard bind is scraped by the host's name
    add_target(path, "127.0.0.1", 9103, "ps0")  # a restarted shard replaces its entry
    entries = json.loads(path.read_text())
    by_daemon = {e["labels"]["daemon"]: e for e in entries}
    assert len(entries) == 2 and by_daemon["ps0"]["targets"] == ["127.0.0.1:9103"]
    assert by_daemon["worker0"]["targets"] == [f"{socket.gethostname()}:9102"]
    assert all(e["labels"]["hetps_run"] == "run7" for e in entries)
    path.write_text("{broken")
    assert read_targets(path) == []


def test_off_by_default_and_a_taken_port_is_not_fatal(monkeypatch):
    assert serve_metrics(-1, "127.0.0.1", "ps", 0, dict) is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert serve_metrics(taken.getsockname()[1], "127.0.0.1", "ps", 0, dict) is None
    parser = argparse.ArgumentParser()
    common_args(parser)
    assert parser.parse_args([]).metrics_port == -1
    monkeypatch.setenv("HETPS_METRICS_PORT", "0")
    parser = argparse.ArgumentParser()
    common_args(parser)
    assert parser.parse_args([]).metrics_port == 0
    assert parser.parse_args(["--metrics-port", "9100"]).metrics_port == 9100


def test_sparse_table_stats_become_metrics(served):
    shard = {"sparse_rows_updated": 12, "sparse_updates": 3, "sparse_bytes": 4096}
    samples = scrape(served(lambda: shard, role="ps", rank=1))
    me = {"role": "ps", "rank": "1"}
    assert value(samples, "hetps_sparse_rows_updated_total", **me) == 12
    assert value(samples, "hetps_sparse_updates_total", **me) == 3
    assert value(samples, "hetps_sparse_bytes", **me) == 4096
    worker = {"rows_pulled": 500, "rows_pushed": 480}
    samples = scrape(served(lambda: worker))
    assert value(samples, "hetps_rows_pulled_total", role="worker", rank="3") == 500
    assert value(samples, "hetps_rows_pushed_total", role="worker", rank="3") == 480
