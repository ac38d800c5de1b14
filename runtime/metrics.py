"""The operator's Prometheus endpoint: one per daemon, off by default.

    hetps worker ... --metrics-port 9100     (or HETPS_METRICS_PORT=9100; 0 = a random free port)

`serve_metrics` starts an HTTP server on a daemon thread whose collector calls
the daemon's `stats()` at scrape time (the same dict its heartbeats carry) and
turns the keys listed in METRICS into gauges and counters labelled with the
daemon's role and rank. Keys not listed, and values that are not finite
numbers, are skipped: a scrape never fails because of a stat. `stats()` runs on
the HTTP thread, so it must be safe to call from another thread (the daemons'
stats already are: the heartbeat thread calls them too).
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import socket
import threading
from http.server import ThreadingHTTPServer
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

from prometheus_client import CollectorRegistry, MetricsHandler, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


class Spec(NamedTuple):
    name: str
    # "gauge", "counter", or "member" (the value is a label, the sample is 1)
    kind: str
    help: str
    labels: tuple[str, ...] = ()  # for dict values: one label per nesting level


# stats key -> metric; one table for every role (a role exports the keys it has)
METRICS = {
    # worker
    "steps": Spec(
        "hetps_steps_total", "counter", "Training steps taken by this worker (its clock)."
    ),
    # a state, not a rate of this scrape: the speed the scheduler's current grouping is based on
    "speed": Spec(
        "hetps_speed_samples_per_second", "gauge", "Measured speed the scheduler groups by."
    ),
    "staleness": Spec("hetps_staleness", "gauge", "Staleness of this worker's last push."),
    "group": Spec(
        "hetps_group",
        "member",
        "1 for the group this worker belongs to in the current plan.",
        ("group",),
    ),
    "rounds": Spec(
        "hetps_rounds_total", "counter", "Averaging rounds (worker: joined; shard: closed)."
    ),
    "evals": Spec(
        "hetps_evals_total", "counter", "Evaluations run (evaluator) or received (scheduler)."
    ),
    "bytes_sent": Spec("hetps_bytes_sent_total", "counter", "Bytes sent to the shards."),
    "bytes_received": Spec(
        "hetps_bytes_received_total", "counter", "Bytes received from the shards."
    ),
    "plan_id": Spec("hetps_plan_id", "gauge", "Id of the cluster plan this node follows."),
    "collective_s": Spec(
        "hetps_collective_seconds_total",
        "counter",
        "Seconds this worker spent in its group's collectives (comm.aggregate).",
    ),
    "collective_group_rounds": Spec(
        "hetps_collective_group_rounds_total",
        "counter",
        "Rounds this worker reduced with its group before the shards (comm.aggregate).",
    ),
    "collective_failures": Spec(
        "hetps_collective_failures_total",
        "counter",
        "Collectives of this worker's group that failed or timed out.",
    ),
    # shard
    "version": Spec("hetps_shard_version", "gauge", "Updates applied to this shard's tensors."),
    "group_updates": Spec(
        "hetps_group_updates_total", "counter", "Updates applied per group.", ("group",)
    ),
    "group_staleness": Spec(
        "hetps_group_staleness", "gauge", "Mean staleness of each group's updates.", ("group",)
    ),
    "pushes": Spec("hetps_pushes_total", "counter", "Pushes this shard accepted."),
    "pulls": Spec("hetps_pulls_total", "counter", "Pulls this shard answered."),
    "push_bytes": Spec(
        "hetps_push_bytes_total", "counter", "Bytes of the tensors of the pushes this shard took."
    ),
    "aggregated": Spec(
        "hetps_aggregated_pushes_total",
        "counter",
        "Pushes this shard took that carried a group's reduced gradient (comm.aggregate).",
    ),
    "parked": Spec("hetps_parked_pulls", "gauge", "Pulls waiting for a round or a clock."),
    "pending": Spec(
        "hetps_pending_contributions", "gauge", "Contributions waiting in open rounds."
    ),
    "malformed": Spec("hetps_malformed_total", "counter", "Messages dropped or refused at decode."),
    "nonfinite": Spec(
        "hetps_nonfinite_total", "counter", "Pushes refused for NaN or infinite values."
    ),
    "busy_s": Spec("hetps_busy_seconds_total", "counter", "Seconds spent applying updates."),
    "checkpoint_errors": Spec(
        "hetps_checkpoint_errors_total",
        "counter",
        "Checkpoint writes that failed (a full or failing disk); training went on.",
    ),
    "lr": Spec("hetps_learning_rate", "gauge", "Learning rate of the shard's optimizer."),
    # sparse tables (docs/sparse.md): shard
    "sparse_rows_pulled": Spec(
        "hetps_sparse_rows_pulled_total", "counter", "Rows of sparse tables this shard sent."
    ),
    "sparse_rows_updated": Spec(
        "hetps_sparse_rows_updated_total", "counter", "Rows of sparse tables this shard updated."
    ),
    "sparse_updates": Spec(
        "hetps_sparse_updates_total", "counter", "Updates applied to this shard's sparse rows."
    ),
    "sparse_open_rounds": Spec(
        "hetps_sparse_open_rounds", "gauge", "Rounds of row pushes waiting for members."
    ),
    "sparse_bytes": Spec(
        "hetps_sparse_bytes", "gauge", "Bytes of sparse-table slices and their optimizer state."
    ),
    # sparse tables: worker
    "rows_pulled": Spec("hetps_rows_pulled_total", "counter", "Rows of sparse tables pulled."),
    "rows_pushed": Spec(
        "hetps_rows_pushed_total", "counter", "Gradient rows of sparse tables pushed."
    ),
    # scheduler (and evaluator)
    "nodes": Spec(
        "hetps_nodes", "gauge", "Registered nodes by role and state.", ("node_role", "state")
    ),
    "global_steps": Spec("hetps_global_steps", "gauge", "Steps summed over every worker."),
    "accuracy": Spec("hetps_accuracy", "gauge", "Latest test accuracy."),
    "best_accuracy": Spec("hetps_best_accuracy", "gauge", "Best test accuracy so far."),
    "loss": Spec("hetps_loss", "gauge", "Latest test loss."),
    "metric": Spec(
        "hetps_metric",
        "gauge",
        "Latest value of the watched metric (stop.target's, eval.metric or the task's primary "
        "one), labelled with its name: accuracy, perplexity, r2, ...",
        ("metric",),
    ),
    "best_metric": Spec(
        "hetps_best_metric",
        "gauge",
        "Best value so far of the watched metric (highest or lowest, by its direction).",
        ("metric",),
    ),
    "elapsed_s": Spec("hetps_elapsed_seconds", "gauge", "Seconds since training began."),
    "stopping": Spec("hetps_stopping", "gauge", "1 once the scheduler began stopping the cluster."),
    "samples": Spec(
        "hetps_samples_total", "counter", "Training samples this worker computed gradients on."
    ),
    "stall_s": Spec(
        "hetps_stall_seconds",
        "gauge",
        "Seconds the node has been holding others up, by why "
        "(compute, network, unresponsive, dead, shard busy); absent while nobody is.",
        ("node", "reason"),
    ),
    "stall_held_s": Spec(
        "hetps_stall_held_seconds_total",
        "counter",
        "Seconds in all the node held others up.",
        ("node",),
    ),
}
# histograms() key -> metric (a worker's StepTimer keeps them, worker/trainer.py)
HISTOGRAMS = {
    "step_s": Spec(
        "hetps_step_duration_seconds", "histogram", "Wall time of one training step, seconds."
    ),
    "compute_s": Spec(
        "hetps_compute_duration_seconds",
        "histogram",
        "Forward+backward time of one step (emulated slowdown included), seconds.",
    ),
    "push_s": Spec(
        "hetps_push_duration_seconds",
        "histogram",
        "Time from sending a step's push until every shard acknowledged it, seconds.",
    ),
    "round_wait_s": Spec(
        "hetps_round_wait_seconds",
        "histogram",
        "Time a step waited after its push was acknowledged until the next values came "
        "(other workers, the round, the staleness bound), seconds.",
    ),
}
BUILD_INFO = "hetps_build_info"
_SERVERS: dict[str, ThreadingHTTPServer] = {}


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _leaves(value, depth: int, path: tuple = ()) -> Iterator[tuple[tuple, object]]:
    """(label values, leaf) of a dict nested `depth` levels deep; other shapes yield nothing."""
    if depth == 0:
        yield path, value
    elif isinstance(value, dict):
        for key, inner in value.items():
            yield from _leaves(inner, depth - 1, (*path, str(key)))


def family(spec: Spec, value, base: dict[str, str]) -> Metric | None:
    """One metric family for a stat, or None when nothing in it is a number."""
    names, values = [*base, *spec.labels], list(base.values())
    cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
    metric = cls(spec.name, spec.help, labels=names)
    if spec.kind == "member":
        if _number(value) is None:
            return None
        metric.add_metric([*values, str(int(value))], 1.0)
        return metric
    for path, leaf in _leaves(value, len(spec.labels)):
        number = _number(leaf)
        if number is not None:
            metric.add_metric([*values, *path], number)
    return metric if metric.samples else None


def histogram_family(spec: Spec, snapshot, base: dict[str, str]) -> Metric | None:
    """One histogram family from a Histogram.snapshot(), or None when it is not one."""
    try:
        buckets = [
            ("+Inf" if math.isinf(b) else repr(float(b)), float(n)) for b, n in snapshot["buckets"]
        ]
        total = float(snapshot["sum"])
    except (KeyError, TypeError, ValueError):
        return None
    if not buckets or buckets[-1][0] != "+Inf":
        return None
    metric = HistogramMetricFamily(spec.name, spec.help, labels=list(base))
    metric.add_metric(list(base.values()), buckets, total)
    return metric


def build_info(base: dict[str, str], algorithm: str) -> Metric:
    """hetps_build_info{version, torch_version, algorithm} 1: join on it to tell runs apart."""

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "unknown"

    info = {"version": version("hetps"), "torch_version": version("torch"), "algorithm": algorithm}
    metric = GaugeMetricFamily(
        BUILD_INFO,
        "Which hetps and torch this daemon runs, and the run's algorithm.",
        labels=[*base, *info],
    )
    metric.add_metric([*base.values(), *info.values()], 1.0)
    return metric


class StatsCollector(Collector):
    """Reads `stats()` (and `histograms()`) at every scrape; a failing call yields nothing of it."""

    def __init__(
        self,
        role: str,
        rank: int,
        stats: Callable[[], dict],
        histograms: Callable[[], dict] | None = None,
        algorithm: str = "",
    ):
        self.base = {"role": role, "rank": str(rank)}
        self.stats = stats
        self.histograms = histograms
        self.info = build_info(self.base, algorithm)

    def collect(self) -> Iterator[Metric]:
        yield self.info
        for source, table, make in (
            (self.stats, METRICS, family),
            (self.histograms, HISTOGRAMS, histogram_family),
        ):
            try:
                values = source() if source is not None else {}
            except Exception as exc:  # a racing update in the daemon: the next scrape will do
                log.warning("metrics: %s() failed: %r", getattr(source, "__name__", "stats"), exc)
                continue
            if not isinstance(values, dict):
                continue
            for key, spec in table.items():
                metric = make(spec, values.get(key), self.base) if key in values else None
                if metric is not None:
                    yield metric


def serve_metrics(
    port: int,
    host: str,
    role: str,
    rank: int,
    stats: Callable[[], dict],
    *,
    histograms: Callable[[], dict] | None = None,
    algorithm: str = "",
    targets: str | Path | None = None,
) -> str | None:
    """Serve /metrics on HOST:PORT (port 0: a free one) from a daemon thread;
    returns "http://HOST:PORT/metrics", or None when port < 0 (off) or the
    port cannot be bound (logged; training goes on without metrics).
    `histograms`: durations (HISTOGRAMS keys -> Histogram.snapshot()); `algorithm`
    labels hetps_build_info; `targets`: a file_sd file this daemon adds itself to.
    Not blocking; the server lives as long as the process."""
    if port < 0:
        return None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(role, rank, stats, histograms, algorithm))
    ProcessCollector(registry=registry)  # CPU seconds, resident memory, open fds of this daemon
    try:
        server = ThreadingHTTPServer((host, port), MetricsHandler.factory(registry))
    except OSError as exc:
        log.error("metrics: cannot listen on %s:%d: %s; serving no metrics", host, port, exc)
        return None
    server.daemon_threads = True
    # a short poll interval: `stop_metrics` returns within 50 ms (the default 0.5 s made each stop wait)
    threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": 0.05},
        name=f"metrics-{role}{rank}",
        daemon=True,
    ).start()
    address = f"http://{host}:{server.server_address[1]}/metrics"
    _SERVERS[address] = server
    log.info("metrics at %s", address)
    if targets:
        try:
            add_target(Path(targets), host, server.server_address[1], daemon_name(role, rank))
        except OSError as exc:  # metrics are still served; only discovery by file is lost
            log.error("metrics: cannot write the targets file %s: %s", targets, exc)
    return address


def daemon_name(role: str, rank: int) -> str:
    """The name a local run gives the daemon's process and log: scheduler, ps0, worker3, evaluator."""
    return role if role in ("scheduler", "evaluator") else f"{role}{rank}"


def add_target(path: Path, host: str, port: int, daemon: str) -> None:
    """Add (or replace) DAEMON's entry in a Prometheus file_sd targets file:
    `[{"targets": ["HOST:PORT"], "labels": {"daemon": ..., "hetps_run": ...}}, ...]`.
    Daemons of one run add themselves concurrently: a lock file serializes them and
    the file is replaced atomically, so Prometheus never reads half of it.
    Blocking (briefly); raises OSError."""
    if host in ("0.0.0.0", "::", ""):  # a wildcard bind: scrape it by this machine's name
        host = socket.gethostname()
    entry = {
        "targets": [f"{host}:{port}"],
        "labels": {"daemon": daemon, "hetps_run": path.parent.name},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = [e for e in read_targets(path) if e.get("labels", {}).get("daemon") != daemon]
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps([*entries, entry], indent=1) + "\n")
        os.replace(tmp, path)


def read_targets(path: Path) -> list[dict]:
    """The entries of a file_sd targets file; [] when missing or unreadable."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def stop_metrics(address: str) -> None:
    """Shut down a server `serve_metrics` started (tests; daemons just exit)."""
    server = _SERVERS.pop(address, None)
    if server is not None:
        server.shutdown()
        server.server_close()
