"""What every daemon's command line shares: flags (each also settable from
the environment), config loading with exit code 2 on a bad config, logging,
CurveZMQ from the config (runtime/curve_setup.py), the scheduler address, and
the options every socket of a daemon is made with (`transport_options`).
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import logging
import os
import re
import signal
import sys
import weakref
from pathlib import Path

from hetps.proto.link import Link
from hetps.proto.security import SecurityError
from hetps.proto.transport import TransportOptions
from hetps.runconfig.load import load_config
from hetps.runconfig.schema import ConfigError, NodeConfig, RunConfig

from .curve_setup import KeysSettingError, configure
from .import_path import import_beside

# exit statuses of the shard, worker and evaluator daemons (and the scheduler's 1 when the
# cluster never formed): 0 a clean stop the scheduler asked for; 1 a peer unreachable in time;
# 2 a bad config, flag or key; 3 the scheduler went silent for cluster.scheduler_grace_s
EXIT_SCHEDULER_LOST = 3
# `--rank auto` (or HETPS_RANK=auto): the scheduler gives the node a free rank at registration
AUTO_RANK = -1


def rank_arg(value: str) -> int:
    """A --rank value: a non-negative integer, or `auto` (AUTO_RANK). Raises ArgumentTypeError."""
    if value.strip().lower() == "auto":
        return AUTO_RANK
    try:
        rank = int(value)
    except ValueError:
        rank = -1
    if rank < 0:
        raise argparse.ArgumentTypeError(f"want a rank >= 0 or 'auto', got {value!r}")
    return rank


class DaemonArgumentParser(argparse.ArgumentParser):
    """A daemon's flags: a bad one is one line (`hetps ps: error: ...`, exit 2)
    in the daemon's log, not the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level_arg(value: str) -> str:
    if value.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"want one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return value.upper()


def port_arg(value: str) -> int:
    """A TCP port, 0 (a free one) or -1 (off)."""
    try:
        port = int(value)
    except ValueError:
        port = -2
    if not -1 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"want a port 1-65535, 0 (a free one) or -1 (off), got {value!r}"
        )
    return port


# mem: in-process
_ADDRESS = re.compile(
    r"tcp://(\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})|(ipc|inproc|mem)://.+"
)


def address_arg(value: str) -> str:
    """A ZeroMQ address flag: tcp://HOST:PORT (port 0-65535), ipc://PATH or
    inproc://NAME; `{rank}` may stand for a number (--ranks); empty = unset."""
    found = _ADDRESS.fullmatch(value.replace("{rank}", "0"))
    if value and (found is None or (found.group(2) is not None and int(found.group(2)) > 65535)):
        raise argparse.ArgumentTypeError(
            f"want tcp://HOST:PORT (port 0-65535), ipc://PATH or inproc://NAME, got {value!r}"
        )
    return value


def common_args(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument(
        "--config", default=env("HETPS_CONFIG"), help="YAML experiment ($HETPS_CONFIG)"
    )
    parser.add_argument(
        "--rank",
        type=rank_arg,
        default=env("HETPS_RANK", "0"),
        help="this node's rank among its role, or `auto`: a free one claimed from the scheduler "
        "for launchers without indices ($HETPS_RANK)",
    )
    parser.add_argument(
        "--scheduler",
        type=address_arg,
        default=env("HETPS_SCHEDULER"),
        help="scheduler address tcp://HOST:PORT ($HETPS_SCHEDULER; else cluster.scheduler)",
    )
    log_level_args(parser)
    parser.add_argument(
        "--check",
        action="store_true",
        help="validate flags, environment and config, print them, exit 0 without connecting",
    )
    parser.add_argument(
        "--client-key",
        default=None,
        help="with security.curve: this node's client key, a name under KEYS_DIR/clients or a "
        ".key_secret path ($HETPS_CLIENT_KEY; default client-0)",
    )
    metrics_args(parser)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


def log_level_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        type=log_level_arg,
        default=os.environ.get("HETPS_LOG_LEVEL", "INFO"),
        help=f"{' | '.join(LOG_LEVELS)} ($HETPS_LOG_LEVEL; default INFO)",
    )


def metrics_args(parser: argparse.ArgumentParser) -> None:
    """The Prometheus endpoint's flags (see runtime/metrics.py); every daemon has them."""
    env = os.environ.get
    parser.add_argument(
        "--metrics-port",
        type=port_arg,
        default=env("HETPS_METRICS_PORT", "-1"),
        help="serve Prometheus /metrics on this port ($HETPS_METRICS_PORT; 0 = a free port; "
        "default -1 = off)",
    )
    parser.add_argument(
        "--metrics-host",
        default=env("HETPS_METRICS_HOST"),
        help="address /metrics listens on ($HETPS_METRICS_HOST; default cluster.host)",
    )
    parser.add_argument(
        "--metrics-targets",
        default=env("HETPS_METRICS_TARGETS"),
        help="a Prometheus file_sd JSON file this daemon adds its /metrics address to "
        "($HETPS_METRICS_TARGETS; hetps run --metrics: RUN_DIR/prometheus_targets.json)",
    )


def rank_label(rank: int) -> str:
    """How --check and messages show a rank: the number, or `auto`."""
    return "auto" if rank == AUTO_RANK else str(rank)


def check_and_exit(role: str, **resolved) -> None:
    """For --check: print what the daemon would do, and what --check leaves to
    the model check, and exit 0."""
    print(f"hetps {role}: ok " + " ".join(f"{k}={v}" for k, v in resolved.items()))
    print(
        f"hetps {role}: not checked without the model: that it fits the data and that "
        "cluster.max_message_bytes lets its tensors through (every worker checks both before it "
        "registers; alone: python -m hetps.training.preflight --config CONFIG)"
    )
    raise SystemExit(0)


def not_writable(path: Path) -> str | None:
    """Why the directory `path` cannot be made or written into, or None when
    it can (as far as the nearest existing folder tells, without writing)."""
    probe = path.expanduser().absolute()
    while not probe.exists() and probe != probe.parent:  # the nearest part that exists
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


def run_dir_problem(path: Path) -> str | None:
    """What keeps `path` from being a run directory, as words after its name: `is not
    writable` (it exists), `cannot be made: ...` (`not_writable`'s reason); None when it can
    be made or written into."""
    why = not_writable(path)
    if why is None:
        return None
    return "is not writable" if path.is_dir() else f"cannot be made: {why}"


def load_or_exit(path: str | None, overrides: list[str], import_targets: bool = False) -> RunConfig:
    """Load the config; on errors print one line per problem and exit with status 2.
    `import_targets`: also import `package.module:factory` models and datasets. The config
    file's folder and the current directory come first on the import path, as for the
    `hetps run` commands (import_path.py): `hetps worker --config exp.yaml` on another host
    imports exp.yaml's own modules."""
    if path:
        import_beside(path)
    try:
        return load_config(path, overrides, import_targets)
    except ConfigError as exc:
        for line in exc.errors:
            print(f"hetps: config error: {line}", file=sys.stderr)
        raise SystemExit(2) from None


def transport_options(cfg: RunConfig, node: NodeConfig | None = None) -> TransportOptions:
    """The options for every socket of a daemon (proto/transport.py):
    cluster.max_message_bytes, comm.shm_bytes, and one emulated link of the
    node's `link_mbps` (None, or 0: no cap). Make it once per process and
    pass the same object to every socket, so that they share the link."""
    return TransportOptions(
        max_message_bytes=cfg.cluster.max_message_bytes,
        shm_bytes=cfg.comm.shm_bytes,
        link=Link.capped(node.link_mbps) if node is not None else None,
    )


def security_or_exit(cfg: RunConfig, role: str, client_key: str | None = None) -> None:
    """Turn CurveZMQ on for this process when the config asks (curve_setup.py);
    a missing keys directory or key prints one line naming the setting or the
    file and exits with status 2."""
    try:
        configure(cfg, role, client_key)
    except SecurityError as exc:
        print(f"hetps {role}: {security_problem(exc)}", file=sys.stderr)
        raise SystemExit(2) from None


def security_problem(exc: SecurityError) -> str:
    """One line for a key that cannot be loaded: a keys directory setting that
    names no directory reads like the config's own errors (`load_or_exit`)."""
    return f"{'config error' if isinstance(exc, KeysSettingError) else 'security'}: {exc}"


def dump_stacks_on_usr1() -> None:
    """`kill -USR1 PID` prints every thread's stack to stderr (the daemon's log)
    and the process goes on (SIGUSR1's default action would end it)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def daemon_setup(args: argparse.Namespace, role: str) -> tuple[RunConfig, str]:
    """Config, logging, CurveZMQ keys and the scheduler address for a daemon."""
    rank = "-auto" if args.rank == AUTO_RANK else args.rank
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {role}{rank} %(levelname)s %(name)s: %(message)s",
    )
    dump_stacks_on_usr1()
    # the roles that build the model and the data import their factories now, not at first use
    cfg = load_or_exit(args.config, args.overrides, import_targets=role in ("worker", "evaluator"))
    security_or_exit(cfg, role, args.client_key)
    scheduler = args.scheduler or cfg.cluster.scheduler
    if scheduler.endswith(":0"):
        print(
            f"hetps {role}: no scheduler address: pass --scheduler tcp://HOST:PORT or set "
            "HETPS_SCHEDULER (cluster.scheduler has port 0, which only `hetps run` can fill in)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if args.check and role != "ps":  # the shard adds its own addresses
        check_and_exit(role, rank=rank_label(args.rank), scheduler=scheduler, config=args.config)
    return cfg, scheduler


def scheduler_lost_exit(role: str, rank: int, reason: str) -> int:
    """Print why a daemon gives up on its scheduler (naming its address) and
    return the exit status for it: a supervisor must see a failure, not a clean stop."""
    print(
        f"hetps {role} {rank}: {reason}; exiting with status {EXIT_SCHEDULER_LOST}", file=sys.stderr
    )
    return EXIT_SCHEDULER_LOST


def skip_torch_library_teardown() -> None:
    """Keep torch's per-library finalizers (hundreds of operator registrations
    undone one by one) out of the atexit handlers: ~0.3 s of CPU per process
    that is about to end; every other finalizer still runs at exit."""
    delete = getattr(sys.modules.get("torch.library"), "_del_library", None)
    if delete is None:
        return
    for info in list(getattr(weakref.finalize, "_registry", {}).values()):
        if getattr(info, "func", None) is delete:
            info.atexit = False


def fast_exit(code: int) -> None:
    """End the process with `code` once main() returned: run the atexit
    handlers (logging's flush among them), flush stdout and stderr, then skip
    the interpreter's teardown (os._exit). With torch
    imported that teardown takes 1-9 s of CPU on a loaded 2-core machine,
    and `hetps run` waits for every process before it reports."""
    skip_torch_library_teardown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to lose
            pass
    os._exit(code if isinstance(code, int) else 1)
