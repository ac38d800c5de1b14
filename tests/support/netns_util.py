"""A small virtual network of Linux network namespaces, for tests that run the
hetps daemons as if on separate hosts.

    with virtual_network(["scheduler", "ps0", "worker0"]) as net:
        net.ip("ps0")                      # "10.199.0.2"
        net.popen("ps0", [...], log)       # a process inside ps0's namespace
        net.tc("worker0", "qdisc", "add", "dev", net.veth("worker0"), "root", ...)

Layout: one "hub" namespace holding a Linux bridge, and one namespace per node
with its loopback up and one end of a veth pair (the other end is a port of
the bridge in the hub) carrying the node's address 10.199.0.N/24, N = 1, 2, ...
in the order the nodes are given. Every link is created directly inside its
namespace (`ip link add ... netns NS`), so nothing ever touches the host's
own interfaces or routes; deleting the namespaces destroys every link.

Names are unique per run: namespaces `hetps-<pid>-<run id>-<node>`, interfaces
`hp<run id>n<i>` (node side), `hp<run id>h<i>` (hub side), `hp<run id>br`
(bridge), all within the 15-character limit on interface names.

Teardown always runs (the context manager's `finally`, an `atexit` hook, and
SIGTERM turned into SystemExit while a network is up): it kills every process
still inside the namespaces (`ip netns pids`), deletes every namespace, then
checks that none is left. Networks left behind by a test process that was
killed outright (SIGKILL) are swept when the next network is built: their
names carry the pid of the process that made them, and that pid is dead.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Iterator

from hetps.frontend.shared_forks import pid_alive

SUBNET = "10.199.0"  # 10.199.0.0/24: node i (from 0) is SUBNET.(i + 1)
PREFIX_LEN = 24
NS_PREFIX = "hetps-"  # every namespace this module makes starts with this

_OPEN: list["VirtualNetwork"] = []  # networks not yet torn down (for atexit)


class NetnsError(RuntimeError):
    """An `ip`/`tc` command failed while building the network."""


def _run(
    cmd: list[str], timeout_s: float = 20.0, check: bool = True
) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if check and result.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _namespaces() -> list[str]:
    """Names of the existing network namespaces (`ip netns list`)."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def skip_reason(need_tc: bool = False) -> str | None:
    """Why the namespace tests cannot run here (None: they can). Probes the
    real thing: a namespace with a bridge and a veth pair (and a tbf qdisc)."""
    if os.geteuid() != 0:
        return "network namespace tests need root (ip netns add); run as root, as CI does"
    for tool in ("ip", "tc") if need_tc else ("ip",):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: install iproute2 (apt-get install -y iproute2)"
    probe = f"{NS_PREFIX}{os.getpid()}-probe{secrets.token_hex(2)}"
    steps = [
        ["ip", "netns", "add", probe],
        ["ip", "-n", probe, "link", "add", "pbr", "type", "bridge"],
        ["ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb"],
    ]
    if need_tc:
        steps.append(
            [
                "ip",
                "netns",
                "exec",
                probe,
                "tc",
                "qdisc",
                "add",
                "dev",
                "pa",
                "root",
                "tbf",
                "rate",
                "8mbit",
                "burst",
                "32kbit",
                "latency",
                "400ms",
            ]
        )
    try:
        for cmd in steps:
            result = _run(cmd, check=False)
            if result.returncode != 0:
                return f"no network namespace support here: `{' '.join(cmd)}` failed: {result.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no network namespace support here: {exc}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def _kill_namespace_processes(ns: str) -> list[int]:
    """SIGKILL every process inside namespace `ns` (all of them were started
    there by these tests); returns their pids."""
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    pids = [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def sweep_stale() -> list[str]:
    """Delete namespaces this module made in test processes that are gone
    (killed before their teardown could run)."""
    swept = []
    for ns in _namespaces():
        if not ns.startswith(NS_PREFIX):
            continue
        owner = ns[len(NS_PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and int(owner) != os.getpid() and not pid_alive(int(owner)):
            _kill_namespace_processes(ns)
            _run(["ip", "netns", "del", ns], check=False)
            swept.append(ns)
    return swept


class VirtualNetwork:
    """Namespaces `hub` + one per node, wired to one bridge; see the module doc."""

    def __init__(self, nodes: list[str]):
        if len(set(nodes)) != len(nodes) or not 0 < len(nodes) < 250:
            raise ValueError(f"need 1..249 distinct node names, got {nodes}")
        self.nodes = list(nodes)
        self.run_id = secrets.token_hex(3)  # 6 hex chars
        self.base = f"{NS_PREFIX}{os.getpid()}-{self.run_id}"
        self.hub = f"{self.base}-hub"
        self.bridge = f"hp{self.run_id}br"
        self.created: list[str] = []  # namespaces, in creation order
        self.procs: list[subprocess.Popen] = []
        self.closed = False

    # ------------------------------------------------------------ names and addresses
    def index(self, node: str) -> int:
        return self.nodes.index(node)

    def ns(self, node: str) -> str:
        return f"{self.base}-{node}"

    def ip(self, node: str) -> str:
        return f"{SUBNET}.{self.index(node) + 1}"

    def veth(self, node: str) -> str:
        """The node's interface, inside the node's namespace."""
        return f"hp{self.run_id}n{self.index(node)}"

    def hub_port(self, node: str) -> str:
        """The other end of the node's veth: a bridge port in the hub namespace."""
        return f"hp{self.run_id}h{self.index(node)}"

    # ------------------------------------------------------------ building
    def _add_ns(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self.created.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def build(self) -> "VirtualNetwork":
        _OPEN.append(self)
        self._add_ns(self.hub)
        _run(["ip", "-n", self.hub, "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "-n", self.hub, "link", "set", self.bridge, "up"])
        for node in self.nodes:
            ns = self.ns(node)
            self._add_ns(ns)
            _run(
                [
                    "ip",
                    "link",
                    "add",
                    self.veth(node),
                    "netns",
                    ns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    self.hub_port(node),
                    "netns",
                    self.hub,
                ]
            )
            _run(["ip", "-n", self.hub, "link", "set", self.hub_port(node), "master", self.bridge])
            _run(["ip", "-n", self.hub, "link", "set", self.hub_port(node), "up"])
            _run(
                [
                    "ip",
                    "-n",
                    ns,
                    "addr",
                    "add",
                    f"{self.ip(node)}/{PREFIX_LEN}",
                    "dev",
                    self.veth(node),
                ]
            )
            _run(["ip", "-n", ns, "link", "set", self.veth(node), "up"])
        self._wait_reachable()
        return self

    def _wait_reachable(self, timeout_s: float = 15.0) -> None:
        """Wait until every node's veth reports carrier (both ends up); the
        bridge runs no STP, so its ports forward as soon as they are up."""
        deadline = time.monotonic() + timeout_s
        pending = set(self.nodes)
        while pending and time.monotonic() < deadline:
            for node in sorted(pending):
                state = _run(
                    ["ip", "-n", self.ns(node), "-o", "link", "show", self.veth(node)], check=False
                ).stdout
                if "LOWER_UP" in state and "state UP" in state:
                    pending.discard(node)
            if pending:
                time.sleep(0.05)
        if pending:
            raise NetnsError(f"links not up after {timeout_s}s: {sorted(pending)}")

    # ------------------------------------------------------------ using
    def exec_prefix(self, node: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(node)]

    def run(self, node: str, cmd: list[str], timeout_s: float = 20.0, check: bool = True):
        """Run a short command inside the node's namespace."""
        return _run([*self.exec_prefix(node), *cmd], timeout_s=timeout_s, check=check)

    def tc(self, node: str, *args: str, hub: bool = False) -> None:
        """`tc ARGS` inside the node's namespace (hub=True: inside the hub,
        where the node's hub_port lives)."""
        _run(["ip", "netns", "exec", self.hub if hub else self.ns(node), "tc", *args])

    def limit_link(
        self,
        node: str,
        rate: str,
        burst: str = "32kbit",
        latency: str = "400ms",
        both_ways: bool = True,
    ) -> None:
        """A token-bucket cap on the node's link: egress on its veth, and (both_ways)
        on the bridge port that sends to it, i.e. the node's ingress."""
        tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        self.tc(node, "qdisc", "add", "dev", self.veth(node), *tbf)
        if both_ways:
            self.tc(node, "qdisc", "add", "dev", self.hub_port(node), *tbf, hub=True)

    def popen(
        self, node: str, cmd: list[str], log: IO, env: dict | None = None, cwd: Path | None = None
    ) -> subprocess.Popen:
        """Start `cmd` inside the node's namespace, in a session of its own
        (`ip netns exec` execs the command, so the pid is the command's)."""
        proc = subprocess.Popen(
            [*self.exec_prefix(node), *cmd],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    # ------------------------------------------------------------ teardown
    def close(self) -> list[str]:
        """Kill every process started here or still inside the namespaces,
        delete every namespace (which destroys the bridge and the veths);
        idempotent. Returns problems found (empty when all is clean)."""
        if self.closed:
            return []
        self.closed = True
        problems = []
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for ns in reversed(self.created):
            try:
                _kill_namespace_processes(ns)
                _run(["ip", "netns", "del", ns], check=False)
            except (OSError, subprocess.TimeoutExpired) as exc:
                problems.append(f"deleting {ns}: {exc}")
        left = [ns for ns in _namespaces() if ns.startswith(self.base + "-")]
        for ns in left:  # a second try, then report
            _run(["ip", "netns", "del", ns], check=False)
        left = [ns for ns in _namespaces() if ns.startswith(self.base + "-")]
        if left:
            problems.append(f"namespaces left: {left}")
        # nothing is ever created in the host's namespace; make sure of it
        root_links = _run(["ip", "-o", "link", "show"], check=False).stdout
        stray = [
            line.split(":")[1].strip().split("@")[0]
            for line in root_links.splitlines()
            if f"hp{self.run_id}" in line
        ]
        for link in stray:
            _run(["ip", "link", "del", link], check=False)
        if stray:
            problems.append(f"links left in the host namespace: {stray}")
        if self in _OPEN:
            _OPEN.remove(self)
        return problems


@atexit.register
def _close_all() -> None:
    for net in list(_OPEN):
        net.close()


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def virtual_network(nodes: list[str]) -> Iterator[VirtualNetwork]:
    """Build the network, yield it, and always tear it down (see module doc)."""
    sweep_stale()
    net = VirtualNetwork(nodes)
    previous = signal.getsignal(signal.SIGTERM)
    hooked = previous in (signal.SIG_DFL, None) and _main_thread()
    if hooked:
        signal.signal(signal.SIGTERM, _raise_exit)  # `kill PID` still runs the teardown
    try:
        net.build()
        yield net
    finally:
        problems = net.close()
        if hooked:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert not problems, f"virtual network teardown: {problems}"


class NetDaemons:
    """hetps daemons started one by one, each inside its node's namespace with
    `ip netns exec NS python -m hetps.frontend.cli ROLE ...`, each logging to
    LOG_DIR/NAME.log."""

    def __init__(self, net: VirtualNetwork, log_dir: Path, hetps: list[str], overrides: list[str]):
        self.net = net
        self.log_dir = log_dir
        self.hetps = hetps
        self.overrides = overrides
        self.names: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("HETPS_")}
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, node: str, name: str, args: list[str]) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "w") as log:  # the child keeps its own descriptor
            proc = self.net.popen(
                node, [*self.hetps, *args, *self.overrides], log, env=self.env, cwd=self.log_dir
            )
        self.names.append(name)
        self.procs.append(proc)
        return proc

    def wait_file(self, path: Path, timeout_s: float, what: str) -> str:
        """The contents of `path` once it exists; fails early when a daemon died."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().strip():
                return path.read_text().strip()
            dead = [
                (n, p.returncode) for n, p in zip(self.names, self.procs) if p.poll() is not None
            ]
            if dead:
                raise AssertionError(
                    f"daemons exited while waiting for {what}: {dead}\n{self.tails()}"
                )
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n{self.tails()}")

    def wait(self, timeout_s: float) -> dict[str, int | None]:
        """Exit codes by daemon name, waiting at most timeout_s in all (None:
        still running at the deadline)."""
        deadline = time.monotonic() + timeout_s
        codes: dict[str, int | None] = {}
        for name, proc in zip(self.names, self.procs):
            try:
                codes[name] = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        return codes

    def tails(self, chars: int = 2000) -> str:
        out = []
        for name in self.names:
            path = self.log_dir / f"{name}.log"
            text = path.read_text(errors="replace") if path.exists() else "(no log)"
            out.append(f"--- {name}.log\n{text[-chars:]}")
        return "\n".join(out)
