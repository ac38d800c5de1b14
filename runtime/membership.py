"""A node's side of membership: register with the scheduler, wait for the
plan, send heartbeats (with stats and step records) from a background
thread, report results, say goodbye.

Thread-safety: `join`, `wait_plan`, `report` and `bye` use the caller's
socket and must be called from one thread; the heartbeat thread has its own
socket. `stop_requested` (a threading.Event) is set when the scheduler asks
this node to stop, or when it has not answered a heartbeat for
`cluster.scheduler_grace_s`: then `scheduler_lost` is true too, the calls on
the caller's socket raise `Aborted` instead of waiting out their timeouts,
and the daemon exits with `EXIT_SCHEDULER_LOST` (runtime/daemon.py) so that a
supervisor sees a failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import socket
import sys
import threading
import time
import traceback
from typing import Callable, Iterator

from hetps.proto.errors import HetpsError, UnexpectedReply
from hetps.proto.messages import (
    Ack,
    Bye,
    Failed,
    GetPlan,
    Heartbeat,
    Plan,
    Register,
    Report,
    Status,
    Welcome,
)
from hetps.proto.plan import ClusterPlan, TensorSpec
from hetps.proto.records import NodeStats, read_step_records
from hetps.proto.rpc import RemoteError, RequestTimeout, RpcClient
from hetps.proto.transport import TransportOptions
from hetps.runconfig.schema import ClusterConfig

log = logging.getLogger(__name__)


MAX_QUEUED = 2000  # step records kept for the scheduler while it does not answer
FAIL_REPORT_S = 10.0  # longest wait for the scheduler to take a start-up failure report


_TCP = re.compile(r"tcp://(\[[^\]]*\]|[^:/]+):(\d+)$")
_WILDCARDS = {"0.0.0.0": socket.AF_INET, "*": socket.AF_INET, "[::]": socket.AF_INET6}


def reachable(address: str, scheduler: str) -> str:
    """`address` as peers on other hosts reach it. A TCP address bound on every
    interface (0.0.0.0, *, [::]) names no host: it becomes this host's address on
    the route toward the scheduler (the interface its packets would leave by).
    Any other address, or one whose route cannot be found, is returned as it is."""
    bound, toward = _TCP.match(address), _TCP.match(scheduler)
    if bound is None or toward is None or bound.group(1) not in _WILDCARDS:
        return address
    family = _WILDCARDS[bound.group(1)]
    try:
        # connecting a UDP socket sends nothing
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((toward.group(1).strip("[]"), int(toward.group(2))))
            ip = probe.getsockname()[0]
    except OSError as exc:
        log.warning(
            "%s is bound on every interface and no route to the scheduler %s was found (%s): "
            "peers on other hosts cannot reach it; pass --advertise",
            address,
            scheduler,
            exc,
        )
        return address
    return f"tcp://{f'[{ip}]' if family == socket.AF_INET6 else ip}:{bound.group(2)}"


class SchedulerUnreachable(HetpsError, RuntimeError):
    """The scheduler did not answer registration within the startup timeout."""


class Membership:
    def __init__(
        self,
        scheduler: str,
        role: str,
        rank: int,
        cluster: ClusterConfig,
        transport: TransportOptions | None = None,
    ):
        """`transport`: the options of this node's sockets (runtime/daemon.py
        `transport_options`), used for both sockets to the scheduler and kept
        as `self.transport` for the node's other clients; None: plain sockets
        bounded by cluster.max_message_bytes. Raises TransportError."""
        self.scheduler = scheduler
        self.role = role
        self.rank = rank
        self.cluster = cluster
        self.transport = transport or TransportOptions(max_message_bytes=cluster.max_message_bytes)
        self.node_id = 0
        # set (with stop_requested) once the scheduler is silent for the grace period
        self.scheduler_lost = False
        # re-sent when unanswered (at once after a reconnect: a restarted scheduler never saw
        # what the old one lost); the scheduler answers a re-sent request with its first reply
        self.rpc = RpcClient(
            scheduler,
            timeout_s=cluster.request_timeout_s,
            options=self.transport,
            should_abort=lambda: self.scheduler_lost,
            retry_s=cluster.retry_s,
        )
        self.stop_requested = threading.Event()
        self.stop_reason = ""
        # the ranks of the shards the scheduler had declared dead (and no backup serves) when
        # it told this node to stop: nothing can be pulled from them
        self.dead_shards: tuple[int, ...] = ()
        self.latest_plan_id = 0
        self._records: list[dict] = []
        self._records_lock = threading.Lock()
        self._beat_thread: threading.Thread | None = None
        self._registration: Register | None = None
        self._closing = threading.Event()
        # newer_plan is also asked from a worker's waits (failover)
        self._plan_lock = threading.Lock()

    def join(
        self,
        address: str = "",
        tensor_specs: list[TensorSpec] | None = None,
        schema_hash: str = "",
        speed: float = 0.0,
        startup: dict | None = None,
        replica_address: str = "",
        spare_slots: list[str] | None = None,
        agreed: dict | None = None,
    ) -> int:
        """Register; returns this node's id. Raises SchedulerUnreachable, naming
        the address and the timeout, if the scheduler does not answer in time.
        `startup`: {phase: seconds} this node took before registering (runtime/startup.py).
        `agreed`: this node's runconfig.agreement.agreed_values, which the scheduler compares
        with its own: when they differ (or the rank is not one the scheduler's configuration
        has: registration.check_rank), this prints the scheduler's answer (the keys and both
        values) as a config error and exits 2, as a daemon does for a bad config
        (daemon.load_or_exit); any other refusal raises RemoteError."""
        self._registration = Register(
            role=self.role,
            rank=self.rank,
            address=address,
            tensor_specs=tensor_specs or [],
            schema_hash=schema_hash,
            speed=speed,
            host=socket.gethostname(),
            startup=startup or {},
            replica_address=replica_address,
            spare_slots=spare_slots or [],
            agreed=agreed or {},
        )
        try:
            welcome = self.rpc.call(self._registration, timeout_s=self.cluster.startup_timeout_s)
        except RemoteError as exc:
            if exc.status != Status.CONFIG_MISMATCH:
                raise
            print(f"hetps: config error: {exc.message}", file=sys.stderr)
            raise SystemExit(2) from None
        except RequestTimeout:
            raise SchedulerUnreachable(
                f"cannot reach the scheduler at {self.scheduler} within {self.cluster.startup_timeout_s}s "
                "(cluster.startup_timeout_s): is it running, and is that address reachable from this "
                "host?"
            ) from None
        if not isinstance(welcome, Welcome):
            raise UnexpectedReply(self.scheduler, "REGISTER", "WELCOME", welcome)
        self.node_id = welcome.node_id
        self.rpc.src = self.node_id
        # `--rank auto`: the scheduler chose it; keep it on re-registering
        if welcome.rank != self.rank:
            log.info("%s: claimed rank %d", self.role, welcome.rank)
            self.rank = welcome.rank
            self._registration = dataclasses.replace(self._registration, rank=welcome.rank)
        return self.node_id

    def wait_plan(self, after: int = 0, timeout_s: float | None = None) -> ClusterPlan:
        """Block until the scheduler has a plan newer than `after` (at most
        `timeout_s`, default the startup timeout; RequestTimeout after;
        UnexpectedReply if the scheduler answers with anything but a PLAN)."""
        with self._plan_lock:
            reply = self.rpc.call(
                GetPlan(after=after), timeout_s=timeout_s or self.cluster.startup_timeout_s
            )
        if not isinstance(reply, Plan):
            raise UnexpectedReply(self.scheduler, "GET_PLAN", "PLAN", reply)
        self.latest_plan_id = max(self.latest_plan_id, reply.plan_id)
        return reply.plan  # a ClusterPlan, checked at decode (records.read_plan)

    def note_plan(self, plan_id: int) -> None:
        """A server (e.g. a shard's ACK) named plan `plan_id`: `newer_plan` fetches it if newer."""
        self.latest_plan_id = max(self.latest_plan_id, plan_id)

    def newer_plan(self, current: int) -> ClusterPlan | None:
        """The scheduler's newer plan if a heartbeat announced one, else None."""
        if self.latest_plan_id <= current:
            return None
        return self.wait_plan(after=current)

    def add_record(self, record: dict) -> None:
        """Queue a step record for the next heartbeat (thread-safe)."""
        record["_t"] = time.monotonic()
        with self._records_lock:
            self._records.append(record)

    def _take_records(self) -> list[dict]:
        """The queued records, emptied; each still holds its `_t`."""
        with self._records_lock:
            records, self._records = self._records, []
        return records

    @staticmethod
    def _outgoing(records: list[dict]) -> list[dict]:
        """Records as a heartbeat carries them: `ago` (seconds) instead of `_t`."""
        now = time.monotonic()
        return [
            {**{k: v for k, v in r.items() if k != "_t"}, "ago": now - r["_t"]} for r in records
        ]

    def start_heartbeats(self, stats: Callable[[], dict]) -> None:
        """Start the heartbeat thread; `stats()` is called from that thread."""
        self._beat_thread = threading.Thread(
            target=self._beat_loop,
            args=(stats,),
            name=f"heartbeat-{self.role}{self.rank}",
            daemon=True,
        )
        self._beat_thread.start()

    def _beat_loop(self, stats: Callable[[], dict]) -> None:
        grace, period = self.cluster.scheduler_grace_s, self.cluster.heartbeat_s
        timeout_s = min(period * 4, grace)
        # a long poll (scheduler/held_beats.py): the scheduler holds the ACK up to a period, answering at
        # once with news (stop, a newer plan); the next beat goes when the period since this one is over
        hold_s = period if timeout_s >= 2 * period else 0.0
        rpc = RpcClient(
            self.scheduler, src=self.node_id, timeout_s=timeout_s, options=self.transport
        )
        last_answer = time.monotonic()
        try:
            while not self._closing.is_set():
                records = self._take_records()
                sent = time.monotonic()
                try:
                    ack = rpc.call(
                        Heartbeat(
                            node_id=self.node_id,
                            stats=NodeStats.read(stats()),
                            records=read_step_records(self._outgoing(records)),
                            hold_s=0.0 if self._closing.is_set() else hold_s,
                        )
                    )
                    last_answer = time.monotonic()
                    self._on_ack(ack)
                except RequestTimeout:
                    self._requeue(records)
                except RemoteError as exc:
                    self._requeue(records)
                    last_answer = time.monotonic()  # it answered: alive, if forgetful
                    # a restarted scheduler that lost us: register again
                    if exc.status == Status.BAD_STATE:
                        self._register_again(rpc)
                except Exception as exc:  # keep beating; the scheduler may come back
                    log.warning("heartbeat failed: %s", exc)
                if time.monotonic() - last_answer > grace:
                    self._lose_scheduler(time.monotonic() - last_answer)
                    return
                self._closing.wait(max(0.0, sent + period - time.monotonic()))
        finally:
            rpc.close()

    def _lose_scheduler(self, silent_s: float) -> None:
        """Give up on a scheduler that stopped answering: the run cannot end
        cleanly without it, so the daemon stops and exits non-zero."""
        reason = (
            f"lost the scheduler at {self.scheduler}: no answer for {silent_s:.1f}s "
            f"(cluster.scheduler_grace_s={self.cluster.scheduler_grace_s:g})"
        )
        log.error("%s", reason)
        self.scheduler_lost = True
        self.stop_reason = reason
        self.stop_requested.set()

    def _requeue(self, records: list[dict]) -> None:
        """Records of a heartbeat that got no answer go out with the next one
        (the newest MAX_QUEUED, so a long outage cannot grow a heartbeat without bound)."""
        with self._records_lock:
            self._records[:0] = records
            del self._records[:-MAX_QUEUED]

    def _register_again(self, rpc: RpcClient) -> None:
        log.warning("the scheduler does not know node %d: registering again", self.node_id)
        try:
            welcome = rpc.call(dataclasses.replace(self._registration, node_id=self.node_id))
        except (RequestTimeout, RemoteError) as exc:
            log.warning("registering again failed: %s", exc)
            return
        if isinstance(welcome, Welcome) and welcome.node_id != self.node_id:
            self._request_stop(
                f"the scheduler restarted without this run's state (gave node id "
                f"{welcome.node_id}, not {self.node_id})"
            )

    def _on_ack(self, ack) -> None:
        if isinstance(ack, Ack):
            self.latest_plan_id = max(self.latest_plan_id, ack.plan_id)
            if ack.stop:
                dead = ack.info.get("dead_shards", ())
                if isinstance(dead, list):
                    self.dead_shards = tuple(r for r in dead if isinstance(r, int))
                self._request_stop(ack.info.get("reason", "scheduler"))

    def _request_stop(self, reason: str) -> None:
        if not self.stop_requested.is_set():
            self.stop_reason = reason
            self.stop_requested.set()

    @contextlib.contextmanager
    def starting(self, exit_codes: dict[type, int] | None = None) -> Iterator[None]:
        """Wrap a start-up step: an exception in it is printed, reported to the
        scheduler (which ends the run at once, naming this node and quoting the
        error) and ends the process: SystemExit with 1, or with `exit_codes`'
        value for the exception's type."""
        try:
            yield
        except Exception as exc:
            error = describe_failure(exc)
            log.debug("start-up failed", exc_info=True)
            print(
                f"hetps {self.role} {self.rank}: failed at start-up: {error}",
                file=sys.stderr,
                flush=True,
            )
            self.fail(error)
            codes = exit_codes or {}
            raise SystemExit(next((c for t, c in codes.items() if isinstance(exc, t)), 1)) from None

    def fail(self, error: str) -> bool:
        """Tell the scheduler this node cannot start (FAILED). Best effort, blocks
        at most FAIL_REPORT_S; returns whether the scheduler took it."""
        msg = Failed(
            role=self.role,
            rank=self.rank,
            error=error,
            host=socket.gethostname(),
            node_id=self.node_id,
        )
        try:
            self.rpc.call(msg, timeout_s=min(FAIL_REPORT_S, self.cluster.startup_timeout_s))
            return True
        except HetpsError as exc:  # timeout, error reply, a lost scheduler (Aborted): best effort
            log.warning("could not report the failure to the scheduler: %s", exc)
            return False

    def report(self, kind: str, values: dict) -> None:
        """Blocking; raises Aborted once the scheduler is lost. A scheduler
        restarted without this node (before its state file held it) answers
        BAD_STATE: this node registers again and the report goes once more."""
        msg = Report(node_id=self.node_id, kind=kind, values=values)
        try:
            self.rpc.call(msg)
        except RemoteError as exc:
            if exc.status != Status.BAD_STATE or self._registration is None:
                raise
            self._register_again(self.rpc)
            self.rpc.call(msg)

    def bye(self, stats: dict, timeout_s: float = 5.0, error: str = "", refused: int = 0) -> None:
        """Stop heartbeats, flush records in a last heartbeat, say goodbye
        (best effort; nothing is sent to a lost scheduler). `error`: why this
        node leaves before the run stopped; `refused`: the status of the ERROR
        reply behind it."""
        self._closing.set()
        if self.scheduler_lost:
            return
        try:
            # this last heartbeat also has the scheduler answer the beat it may hold for the thread
            records = read_step_records(self._outgoing(self._take_records()))
            self.rpc.call(
                Heartbeat(node_id=self.node_id, stats=NodeStats.read(stats), records=records),
                timeout_s=timeout_s,
            )
            if self._beat_thread is not None:
                self._beat_thread.join(timeout=self.cluster.heartbeat_s * 5 + 1)
            self.rpc.call(
                Bye(
                    node_id=self.node_id,
                    stats=NodeStats.read(stats),
                    error=error,
                    refused=int(refused),
                ),
                timeout_s=timeout_s,
            )
        except Exception as exc:
            log.warning("goodbye to scheduler failed: %s", exc)

    def close(self) -> None:
        self._closing.set()
        self.rpc.close()


def describe_failure(exc: BaseException) -> str:
    """One line for a start-up failure: the exception and where it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = (
        f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    )
    return f"{type(exc).__name__}: {exc}{where}"
