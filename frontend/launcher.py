"""`hetps run`: a whole local cluster as separate processes.

Starts the scheduler (random port), the shards, the workers and the
evaluator as `python -m hetps.<role>` processes (forked from one warm
process that imported torch once, frontend/zygote.py; `HETPS_SPAWN=exec`
execs each instead), shows one live progress
line, and when the scheduler stops the run, writes the plot. Every child runs
in its own session (so a terminal's Ctrl-C reaches only the launcher, which
turns it into a clean stop) and is reaped, killed if need be, on every exit
path. Child output goes to RUN_DIR/logs/<name>.log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hetps.proto.errors import HetpsError
from hetps.proto.security import SecurityError
from hetps.runconfig.algorithms import min_aggregated_group
from hetps.runconfig.load import dump_config
from hetps.runconfig.schema import RunConfig
from hetps.runconfig.targets import stop_target
from hetps.runtime.curve_setup import check_run_keys, keys_for_run
from hetps.runtime.daemon import not_writable, run_dir_problem, security_problem
from hetps.runtime.devices import assign_devices, local_gpu_count
from hetps.runtime.failures import declared_dead
from hetps.runtime.startup import process_age_s
from hetps.scheduler.outcome import EXIT_CODES
from hetps.scheduler.runlog import SummaryFile, read_metrics, steps_recorded
from hetps.scheduler.state import STATE_FILE
from hetps.scheduler.state import read as read_state
from hetps.scheduler.status import saved_summary

from . import result_model
from .faults import FaultInjector
from .local_sockets import LocalSockets, shard_groups, shard_process
from .plots import plot_run
from .report import Progress, format_summary
from .resume import ResumePoint, checkpoints_root, strip_resume
from .shared_forks import PreferShared, SharedForkRefused, fork_server
from .startup_report import startup_line, startup_section
from .watch import configured_metric

ADDR_WAIT_S = 60.0  # longest wait for the scheduler to publish its address
# --metrics: each daemon serves /metrics on a free port and adds it here
TARGETS = "prometheus_targets.json"
# not forked from this run's own fork server: it imports no torch, and starts before that server
# is warm (a shared server, $HETPS_FORK_SERVER, is warm already: it is forked from that one)
EXECUTED = {"hetps.scheduler"}
REAP_WAIT_S = 15.0  # after the scheduler exits, how long the rest may take to leave
# a stopping scheduler waits at most coordinator.EXIT_GRACE_S (40 s) for the nodes to leave, then
# writes its summary: this long, and a margin, for it to exit (the coordinator imports torch, the
# launcher does not; tests/unit/test_failed_summary.py checks the two)
SCHEDULER_STOP_S = 55.0
CHECK_WAIT_S = 600.0  # the dry step loads the dataset: a generous upper bound


class LaunchError(HetpsError, RuntimeError):
    """A process failed; the message names it and quotes its last log lines."""


class CheckFailed(LaunchError):
    """The model does not fit the dataset (the dry step before training); one line."""


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log_path: Path
    module: str = ""
    args: tuple = ()

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def client_names(cfg: RunConfig) -> list[str]:
    """The processes of a local run that connect to a server (named as in `LocalCluster.start`)."""
    names = [f"ps{r}" for r in range(len(cfg.cluster.shards))] + [
        f"spare{r}" for r in range(cfg.cluster.spare_shards)
    ]
    names += [f"worker{r}" for r in range(len(cfg.cluster.workers))]
    return names + ["evaluator"] if cfg.eval.enabled else names


def progress_for(cfg: RunConfig, run_dir: Path) -> Progress:
    """The progress line of a local run of `cfg` in `run_dir` (`hetps run`'s, `hetps.run`'s)."""
    return Progress(
        run_dir / "metrics.jsonl",
        expected=client_names(cfg),
        target=(stop_target(cfg.stop) or (None, None))[1],
        max_seconds=cfg.stop.max_seconds,
        max_steps=cfg.stop.max_steps,
        metric=configured_metric(cfg),
        reduced_from=min_aggregated_group(cfg),
    )


def with_local_devices(cfg: RunConfig) -> RunConfig:
    """`cfg` with each `auto` worker device resolved for this machine: round-robin
    over its visible GPUs (runtime/devices.py), so config.yaml says where each ran."""
    requested = [n.device for n in cfg.cluster.workers]
    if "auto" not in requested:
        return cfg
    devices = assign_devices(requested, local_gpu_count())
    workers = [dataclasses.replace(n, device=d) for n, d in zip(cfg.cluster.workers, devices)]
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, workers=workers))


def prestart_problems(cfg: RunConfig, run_dir: Path) -> list[str]:
    """What would make a process of the run fail at start, found before any
    starts, one line each: keys CurveZMQ cannot load (security.keys_dir), a
    run directory or checkpoint.dir that cannot be written."""
    out = []
    try:
        check_run_keys(cfg, run_dir / "keys")
    except SecurityError as exc:
        out.append(security_problem(exc))
    if problem := run_dir_problem(run_dir):
        out.append(f"the run directory {run_dir} {problem} (choose another with --out)")
    if cfg.checkpoint.dir and (why := not_writable(Path(cfg.checkpoint.dir))):
        out.append(
            f"config error: checkpoint.dir: shards cannot write to {cfg.checkpoint.dir}: {why}"
        )
    return out


def default_run_dir(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(cfg.out_dir) / f"{cfg.name}-{cfg.algorithm.name}-{stamp}"


class LocalCluster:
    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        quiet: bool = False,
        metrics: bool = False,
        resume: ResumePoint | None = None,
    ):
        self.cfg = cfg
        self.run_dir = run_dir
        self.quiet = quiet
        self.resume = resume
        # shards checkpoint into RUN_DIR/checkpoints unless checkpoint.dir says elsewhere
        self.checkpoint_root = (
            Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else checkpoints_root(run_dir)
        )
        self.metrics_args = (
            ("--metrics-port", "0", "--metrics-targets", str(run_dir / TARGETS)) if metrics else ()
        )
        self.children: list[Child] = []
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        # security.curve without a keys directory: fresh keys in RUN_DIR/keys, one client key per process
        self.cfg, self.own_keys = keys_for_run(
            with_local_devices(self.cfg), run_dir / "keys", client_names(self.cfg)
        )
        self.config_path = run_dir / "config.yaml"
        # comm.local_transport: ipc sockets, or tcp loopback
        self.sockets = LocalSockets(self.cfg, run_dir)
        dump_config(self.cfg, self.config_path)
        self.interrupted = 0
        self.failed_as: tuple[str, str] | None = None  # (node, error) once a process failed
        self.check: subprocess.Popen | None = None
        # every daemon imports torch: fork them from one warm process instead of importing it in each
        # (shared by many runs with $HETPS_FORK_SERVER, frontend/shared_forks.py)
        self.forks = fork_server()
        # wall times (startup_report.py)
        self.timeline: dict[str, float] = {"launch": time.time() - process_age_s()}

    # ------------------------------------------------------------ processes
    def spawn(self, name: str, module: str, *args: str) -> Child:
        log_path = self.run_dir / "logs" / f"{name}.log"
        argv = [
            "--config",
            str(self.config_path),
            *self.metrics_args,
            *self.client_key_args(name),
            *args,
        ]
        child = Child(
            name, self._start(module, argv, log_path, append=True), log_path, module, args
        )
        self.children.append(child)
        return child

    def _start(self, module: str, argv: list[str], log_path: Path, append: bool):
        """`python -m module *argv` in its own session, output to `log_path`:
        forked from the warm server, or exec'd (HETPS_SPAWN=exec)."""
        env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        if self.forks is not None and module not in EXECUTED:
            if not append:
                log_path.write_text("")
            return self.forks.start(module, argv, log_path, env)
        if isinstance(self.forks, PreferShared) and self.forks.own is None:
            # forked from the warm shared server, it is spared its ~0.4 s of imports
            with contextlib.suppress(SharedForkRefused):
                if not append:
                    log_path.write_text("")
                return self.forks.shared.start(module, argv, log_path, env)
        with open(log_path, "a" if append else "w") as log_file:
            return subprocess.Popen(
                [sys.executable, "-m", module, *argv],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **env},
                start_new_session=True,
            )

    def run_tool(self, module: str, argv: list[str], name: str) -> tuple[int | None, str]:
        """Run `python -m module *argv` as the daemons start (forked from the warm server) and
        wait for it, at most CHECK_WAIT_S; its output goes to RUN_DIR/logs/NAME.log. Returns
        its exit status (None: killed at the time limit) and its last line of output."""
        log_path = self.run_dir / "logs" / f"{name}.log"
        proc = self._start(module, argv, log_path, append=False)
        try:
            code: int | None = proc.wait(timeout=CHECK_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5.0)
            return None, f"{name} took longer than {CHECK_WAIT_S}s"
        lines = [line for line in log_path.read_text().splitlines() if line.strip()]
        return code, lines[-1] if lines else f"{name} exited with {code}"

    def respawn(self, name: str, address: str) -> None:
        """Start the process `name` again, bound to `address` (its old one)."""
        index = next(i for i, c in enumerate(self.children) if c.name == name)
        old = self.children.pop(index)
        args = strip_resume(old.args)  # a restarted shard goes on from its own newest checkpoint
        args = (*args, "--bind", address) if address else args
        self.spawn(name, old.module, *args)
        self.children.insert(index, self.children.pop())

    def client_key_args(self, name: str) -> tuple[str, ...]:
        """With keys made for this run, every process but the scheduler uses its own client key."""
        # a process of co-located shards (ps0-1) uses its first rank's key
        return ("--client-key", name.split("-")[0]) if self.own_keys and name != "scheduler" else ()

    def start_check(self) -> subprocess.Popen:
        """Start the dry forward+backward of the model on one batch (hetps.training.preflight)."""
        self.check = self._start(
            "hetps.training.preflight",
            ["--config", str(self.config_path)],
            self.run_dir / "logs" / "check.log",
            append=False,
        )
        return self.check

    def wait_check(self) -> None:
        """Raises CheckFailed with the check's own line when the model does not fit the data."""
        try:
            code = self.check.wait(timeout=CHECK_WAIT_S)
        except subprocess.TimeoutExpired:
            raise LaunchError(f"the model check did not finish within {CHECK_WAIT_S}s") from None
        lines = (
            (self.run_dir / "logs" / "check.log").read_text(errors="replace").strip().splitlines()
        )
        if code == 2 and lines:
            # its one line: a model that does not fit, or a setting it cannot work with
            own = lines[-1].startswith(("hetps: check", "hetps: config error"))
            raise CheckFailed("\n".join(lines[-1:] if own else lines[-5:]))
        if code != 0:
            # summary.json says failed, not the `interrupted` of the stop that follows
            self.failed_as = ("check", f"the model check exited with {code}")
            tail = "\n".join(lines[-15:]) or f"(nothing in {self.run_dir / 'logs' / 'check.log'})"
            raise LaunchError(f"the model check exited with {code}:\n{tail}")

    def start(self) -> str:
        """Start every process; returns the scheduler address. Everything
        starts while the model is checked, so that the seconds of imports
        overlap; a failed check stops them all (raises CheckFailed, LaunchError)."""
        run_id = ("--run-id", self.resume.run_id, "--resume") if self.resume else ()
        (self.run_dir / "scheduler.addr").unlink(missing_ok=True)
        if not self.resume:  # a new run in a reused directory must not carry an old one on
            (self.run_dir / STATE_FILE).unlink(missing_ok=True)
        # the scheduler (no torch; exec'd unless a shared server is warm) starts while the first fork
        # waits for the fork server's imports
        scheduler = self.spawn(
            "scheduler",
            "hetps.scheduler",
            "--run-dir",
            str(self.run_dir),
            *run_id,
            *self.sockets.bind_args("scheduler"),
        )
        self.start_check()
        # the check is forked once the fork server imported torch
        self.timeline["fork_server"] = time.time()
        addr = self._scheduler_address(scheduler)
        if not self.interrupted:  # Ctrl-C before the scheduler was up: it stops; start nobody else
            self._spawn_nodes(addr)
            self.wait_check()
            self.timeline["checked"] = time.time()
        return addr

    def _spawn_nodes(self, addr: str) -> None:
        """Start the shards, the workers and the evaluator (each waits for the plan)."""
        # cluster.shard_processes: several ranks in one process
        for ranks in shard_groups(self.cfg):
            name, args = shard_process(
                ranks, self.sockets, self.resume.versions if self.resume else None
            )
            self.spawn(
                name,
                "hetps.ps",
                *args,
                "--scheduler",
                addr,
                "--checkpoint-dir",
                str(self.checkpoint_root),
            )
        # idle until a failover names them (ps/spare.py)
        for rank in range(self.cfg.cluster.spare_shards):
            self.spawn(
                f"spare{rank}",
                "hetps.ps",
                "--spare",
                *("--rank", str(rank), "--scheduler", addr),
                "--checkpoint-dir",
                str(self.checkpoint_root),
            )
        for rank in range(len(self.cfg.cluster.workers)):
            self.spawn(f"worker{rank}", "hetps.worker", "--rank", str(rank), "--scheduler", addr)
        if self.cfg.eval.enabled:
            # the evaluator writes the final model it measured: RUN_DIR/model.safetensors, model.json
            self.spawn(
                "evaluator",
                "hetps.worker",
                "--evaluator",
                "--scheduler",
                addr,
                "--model-out",
                str(self.run_dir),
            )

    def _scheduler_address(self, scheduler: Child) -> str:
        path = self.run_dir / "scheduler.addr"
        deadline = time.monotonic() + ADDR_WAIT_S
        while not path.exists():
            if scheduler.popen.poll() is not None:
                raise LaunchError(exited_before_binding(scheduler))
            if time.monotonic() > deadline:
                raise LaunchError(f"scheduler did not publish its address within {ADDR_WAIT_S}s")
            time.sleep(0.05)
        # when it bound, not when this loop looked
        self.timeline["scheduler_up"] = path.stat().st_mtime
        return path.read_text().strip()

    # ------------------------------------------------------------ watching
    def watch(self, on_poll: Callable[[LocalCluster], None] | None = None) -> None:
        """Show progress until the scheduler exits. Raises LaunchError when a
        process fails (after asking the scheduler to stop the others). `on_poll`
        is called with the cluster each time metrics.jsonl is read (4 times a second)."""
        progress = progress_for(self.cfg, self.run_dir)
        last_print = 0.0
        tolerated: set[str] = set()
        # may die in training
        tolerable = ("worker", "ps", "spare") if self.cfg.cluster.replicas else ("worker",)
        faults = FaultInjector(
            self.cfg.cluster.kill, self.run_dir, self.checkpoint_root, self.respawn
        )
        while self.children[0].popen.poll() is None or faults.restarting("scheduler"):
            time.sleep(0.25)
            faults.fire(self.children)
            for child in self.children[1:]:
                code = child.popen.poll()
                if (
                    code in (None, 0)
                    or child.name in tolerated
                    or child.name in faults.killed
                    # after Ctrl-C, nodes waiting for a plan exit with an error
                    or self.interrupted
                ):
                    continue
                if child.name.startswith(tolerable) and (self.run_dir / "plan.json").exists():
                    # training began: the scheduler notices the silence and re-plans (or fails over) without it
                    tolerated.add(child.name)
                    print(
                        f"\nhetps run: {child.name} exited with {code}; the cluster goes on without it",
                        file=sys.stderr,
                    )
                    continue
                raise LaunchError(self.failure(child.name, f"{child.name} exited with {code}"))
            progress.poll()
            if on_poll is not None:
                on_poll(self)
            if not self.quiet and time.monotonic() - last_print > (
                0.5 if sys.stderr.isatty() else 5.0
            ):
                end = "\r" if sys.stderr.isatty() else "\n"
                print(progress.line(), end=end, file=sys.stderr, flush=True)
                last_print = time.monotonic()
        if not self.quiet:
            progress.poll()
            print(progress.line(), file=sys.stderr)
        scheduler = self.children[0]
        if scheduler.popen.returncode not in (0, EXIT_CODES["diverged"]):
            raise LaunchError(
                self.failure("scheduler", f"scheduler exited with {scheduler.popen.returncode}")
            )
        self._wait_rest(tolerated, faults.killed)

    def failure(self, name: str, what: str) -> str:
        """Stop the run after the process `name` failed (`what`); returns the error
        message for the user. The scheduler's summary, when it names the node that
        failed (reported by that node), wins over the first exit the launcher saw.
        summary.json says `status: failed` whatever the scheduler managed to write."""
        self.stop_scheduler()
        # it stops at once before training began; after, it may wait for the nodes to leave, a
        # dead one until declared dead, and writes its summary only then: killed any sooner
        # (kill_all), it would leave none
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.children[0].popen.wait(timeout=SCHEDULER_STOP_S)
        summary_file = SummaryFile(self.run_dir)
        summary = summary_file.read() or {}
        if not summary.get("status") and name == "scheduler":
            # it died for good: what it saved in its state file, not the launcher's stub alone
            saved = read_state(self.run_dir)
            if saved is not None:
                fields = saved_summary(saved)
                # its step records may be newer than its last save (every SAVE_EVERY_S)
                steps, last_t = steps_recorded(read_metrics(self.run_dir / "metrics.jsonl"))
                fields["global_steps"] = max(fields["global_steps"], steps)
                fields["wall_s"] = max(fields.get("wall_s", 0.0), last_t)
                summary = summary_file.update(**fields)
        node = summary.get("failed_node") or name
        # the scheduler's own words when it failed the run (a node's report, or the cluster never formed)
        detail = (
            summary.get("detail")
            if summary.get("status") == "failed" and summary.get("detail")
            else what
        )
        child = next((c for c in self.children if c.name == node), None)
        self.failed_as = (node, detail)
        summary_file.mark_failed(node, detail)
        tail = f"; last log lines of {node}:\n{child.tail()}" if child else ""
        return f"{node} failed: {detail}{tail}"

    def _wait_rest(self, tolerated: set[str], faults_killed: set[str]) -> None:
        # before any plan there is nothing to flush: nodes still starting are terminated soon
        trained = (self.run_dir / "plan.json").exists()
        # a node the scheduler declared dead (silent past cluster.dead_after_s, e.g. frozen) will
        # not leave: killed now, not waited for (SIGKILL: a stopped process ignores SIGTERM)
        dead = declared_dead((SummaryFile(self.run_dir).read() or {}).get("failures") or [])
        for child in self.children[1:]:
            if child.name in dead and child.popen.poll() is None:
                child.popen.kill()
                if not self.quiet:
                    print(f"hetps run: {child.name} was declared dead; killed", file=sys.stderr)
        deadline = time.monotonic() + (REAP_WAIT_S if trained else 2.0)
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):  # the caller kills what is left
                child.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        self.timeline["exited"] = time.time()
        # [0]: checked by watch
        failed = [
            c
            for c in self.children[1:]
            if c.popen.returncode not in (0, None)
            and c.name not in tolerated | faults_killed | dead
        ]
        # stopped before the plan, nodes exit with "run stopped"
        if failed and not self.interrupted:
            c = failed[0]
            raise LaunchError(self.failure(c.name, f"{c.name} exited with {c.popen.returncode}"))

    def stop_scheduler(self, signum: int = signal.SIGTERM) -> None:
        if self.children and self.children[0].popen.poll() is None:
            self.children[0].popen.send_signal(signum)

    def on_interrupt(self, signum, frame) -> None:
        """First Ctrl-C: clean stop through the scheduler (the summary says
        `interrupted`, the exit status is 130). Second: kill everything."""
        if self.interrupted == 0:
            print("\nhetps run: stopping (Ctrl-C again to kill)", file=sys.stderr)
            self.stop()
        else:
            self.interrupted += 1
            self.kill_all()

    def stop(self) -> None:
        """Stop the run cleanly, as the first Ctrl-C does (the summary says `interrupted`)."""
        self.interrupted += 1
        self.stop_scheduler(signal.SIGINT)

    def kill_all(self) -> None:
        """Terminate, then kill, then reap every child that is still running."""
        if self.check is not None and self.check.poll() is None:
            self.check.kill()
            self.check.wait(timeout=5.0)
        for child in self.children:
            if child.popen.poll() is None:
                child.popen.terminate()
        deadline = time.monotonic() + 5.0
        for child in self.children:
            try:
                child.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.popen.kill()
                child.popen.wait(timeout=5.0)
        self.sockets.close()


def exited_before_binding(child: Child) -> str:
    """Why `child` (exited) never bound: its exit, then its own last line (its
    error) on the same line, and the lines before it when there are more."""
    code = child.popen.returncode
    try:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
    except ValueError:  # not a known signal number
        how = f"exited with {code}"
    lines = [line for line in child.tail().splitlines() if line.strip()]
    if not lines:
        return f"{child.name} {how} before binding and wrote nothing to {child.log_path}"
    earlier = f"\nearlier in {child.log_path}:\n" + "\n".join(lines[:-1]) if lines[:-1] else ""
    return f"{child.name} {how} before binding: {lines[-1]}{earlier}"


def run_local(
    cfg: RunConfig,
    run_dir: Path,
    quiet: bool = False,
    metrics: bool = False,
    resume: ResumePoint | None = None,
    on_poll: Callable[[LocalCluster], None] | None = None,
) -> int:
    """Run one experiment end to end; returns the process exit status:
    0 completed, 1 failed, 3 diverged, 130 interrupted (see outcome.py).
    `metrics`: every daemon serves Prometheus /metrics on a free port;
    `resume`: continue the stopped run in `run_dir` from its checkpoints;
    `on_poll`: see `LocalCluster.watch` (the Python API's callbacks).
    Returns 2, starting nothing, on a problem `prestart_problems` finds.
    Ctrl-C and SIGTERM stop the run cleanly when it runs in the main thread
    (signal handlers can be set only there)."""
    problems = prestart_problems(cfg, run_dir)
    for line in problems:
        print(f"hetps run: {line}", file=sys.stderr)
    if problems:
        return 2
    cluster = LocalCluster(cfg, run_dir, quiet, metrics, resume)
    handling = threading.current_thread() is threading.main_thread()
    if handling:
        previous = signal.signal(signal.SIGINT, cluster.on_interrupt)
        previous_term = signal.signal(signal.SIGTERM, cluster.on_interrupt)
    error = refused = None
    try:
        cluster.start()
        cluster.watch(on_poll)
    except CheckFailed as exc:
        refused = exc
    except LaunchError as exc:
        error = exc
    finally:
        cluster.kill_all()
        if handling:
            signal.signal(signal.SIGINT, previous)
            signal.signal(signal.SIGTERM, previous_term)
    if refused is not None:
        # once the stopped scheduler wrote its summary (`interrupted`): the check's line instead
        SummaryFile(run_dir).mark_failed("check", str(refused))
        print(refused, file=sys.stderr)
        return 2
    if error is not None and not cluster.interrupted:
        # again: a scheduler stopped late may have written its own summary since
        if cluster.failed_as:
            SummaryFile(run_dir).mark_failed(*cluster.failed_as)
        print(f"hetps run: {error}\nrun directory: {run_dir}", file=sys.stderr)
        return EXIT_CODES["failed"]
    summary_file = SummaryFile(run_dir)
    summary = summary_file.read() or {}
    if summary:
        summary = summary_file.update(startup=startup_section(run_dir, cluster.timeline))
    if cluster.interrupted and summary.get("status") != "failed":
        summary_file.mark_interrupted()
    status = "interrupted" if cluster.interrupted else summary.get("status", "completed")
    if summary.get("evals") or summary.get("global_steps"):
        draw_plots(cluster, title=f"{cfg.name}: {cfg.algorithm.name}")
    if (
        status in ("completed", "interrupted")
        and summary.get("global_steps")
        and not (run_dir / "model.safetensors").exists()
    ):
        export_model(cluster, quiet)
    model_line = result_model.check(run_dir) if summary.get("global_steps") else None
    if not quiet and summary:
        print(f"{startup_line(summary['startup'])}\n{format_summary(summary, run_dir)}")
    if model_line:
        print(model_line, file=sys.stderr)
    if status == "diverged":
        print(f"hetps run: training diverged: {summary.get('detail')}", file=sys.stderr)
    return EXIT_CODES.get(status, EXIT_CODES["failed"])


def draw_plots(cluster: LocalCluster, title: str) -> None:
    """The run's plots (plots.plot_run). Drawn in a process forked from the shared fork server
    when this run forks from one ($HETPS_FORK_SERVER: it imported pyplot once for every run,
    ~0.6 s of CPU each run spares), else in this process. A plot that fails is reported, not fatal."""
    forks = cluster.forks
    if not (isinstance(forks, PreferShared) and forks.own is None):
        plot_run(cluster.run_dir, title=title)
        return
    # `hetps plot RUN_DIR`: the title, as plot_run's, from the summary
    code, last = cluster.run_tool("hetps.frontend.cli", ["plot", str(cluster.run_dir)], "plot")
    if code != 0:
        print(f"hetps run: the plots were not drawn: {last}", file=sys.stderr)


def export_model(cluster: LocalCluster, quiet: bool) -> None:
    """Without an evaluator (eval.enabled: false) nobody wrote the final model:
    build RUN_DIR/model.safetensors from the shards' last checkpoints
    (`hetps export`, which evaluates it once; forked from the warm server like a daemon).
    Best effort: a failure is reported, not fatal."""
    out = cluster.run_dir / "model.safetensors"
    argv = [str(cluster.checkpoint_root), "--out", str(out), "--config", str(cluster.config_path)]
    code, last = cluster.run_tool("hetps.training.export", argv, "export")
    if code != 0:
        print(f"hetps run: {out} not written: {last}", file=sys.stderr)
    elif not quiet:
        print(last, file=sys.stderr)
