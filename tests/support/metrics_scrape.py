"""Scraping a daemon's Prometheus endpoint (runtime/metrics.py) and reading its
samples: used by the collector's tests (tests/inproc/test_metrics.py) and by the
scrapes of a real cluster (tests/cluster/test_cluster_metrics.py)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> list:
    """Every sample at `url` (raises URLError when nothing answers)."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(samples: list, name: str, **labels) -> float | None:
    """The value of the first sample called `name` whose labels include `labels`."""
    for s in samples:
        if s.name == name and labels.items() <= s.labels.items():
            return s.value
    return None
