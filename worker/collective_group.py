"""A gloo process group for a few workers, built without a global
`torch.distributed.init_process_group` (as torchft's `configure` and vLLM's
stateless groups do): a `TCPStore` somewhere the members can reach, a
`PrefixStore` over it with one prefix per plan and group (so one store serves
many groups, and a rebuilt group never reads an old one's keys), and a
`ProcessGroupGloo` backend on it. Nothing global is touched, so a process may
hold several groups, and close one without the others (issue 40).

    store = open_store("10.0.0.5", 0, is_owner=True, timeout_s=30)   # the owner: a free port
    # ... tell the members store.port ...
    group = gloo_group("10.0.0.5", store.port, "plan3/group1", rank, size, 30, store=store)
    group.allreduce_sum(tensor)   # blocking; the sum lands in `tensor`
    group.close()

Every member calls `gloo_group` with the same prefix and size and its own
rank; the call blocks until all `size` members have joined (gloo's
rendezvous through the store), or raises after `timeout_s`. A collective
that a member never joins (dead, frozen) raises `CollectiveError` in the
others after `timeout_s`. Gloo cannot abort a collective in flight; a caller
that must survive a hang beyond that runs it where it can be killed.

Which address a member's gloo pairs bind (`host`): given, or 127.0.0.1 when
the store is on a loopback address (every member is then on this host), or
else gloo's default device (the host name's address; `GLOO_SOCKET_IFNAME`
picks an interface). Across hosts pass each member's own reachable address.

Not thread-safe: one thread per group issues its collectives.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A group could not be built, or a collective failed or timed out; names the group and rank."""


def open_store(host: str, port: int, is_owner: bool, timeout_s: float) -> dist.TCPStore:
    """The TCPStore at host:port. The owner serves it (port 0: a free port,
    read back as `.port`) and must outlive every group built on it; the
    others connect as clients, waiting up to `timeout_s` for it to listen.
    Blocking; raises CollectiveError when the store cannot be reached or served."""
    try:
        return dist.TCPStore(
            host,
            port,
            is_master=is_owner,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as e:
        role = "serve" if is_owner else "reach"
        raise CollectiveError(f"cannot {role} the collective store at {host}:{port}: {e}") from e


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class GlooGroup:
    """One member's view of a gloo group: `size` members, this one `rank`."""

    backend: dist.ProcessGroupGloo
    store: dist.TCPStore  # kept: the group's pairs were exchanged through it, a rebuild reuses it
    prefix: str
    rank: int
    size: int

    def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` (CPU, contiguous) over the members, in place; returns it.
        Blocking; raises CollectiveError on a member's failure or the group's timeout."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        try:
            self.backend.allreduce([tensor], opts).wait()
        except RuntimeError as e:
            raise CollectiveError(
                f"all-reduce of group {self.prefix!r} failed at rank {self.rank}: {e}"
            ) from e
        return tensor

    def barrier(self) -> None:
        """Return when every member has reached it. Blocking; raises CollectiveError as allreduce_sum."""
        try:
            self.backend.barrier(dist.BarrierOptions()).wait()
        except RuntimeError as e:
            raise CollectiveError(
                f"barrier of group {self.prefix!r} failed at rank {self.rank}: {e}"
            ) from e

    def close(self) -> None:
        """Release the group's pairs (idempotent); the store is left to its owner."""
        shutdown = getattr(self.backend, "shutdown", None)  # absent in older torch
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:
                pass  # a group whose peers are gone: nothing left to release cleanly


def gloo_group(
    store_host: str,
    store_port: int,
    prefix: str,
    rank: int,
    size: int,
    timeout_s: float,
    is_store_owner: bool = False,
    *,
    store: dist.TCPStore | None = None,
    host: str | None = None,
) -> GlooGroup:
    """Join the gloo group `prefix` as member `rank` of `size`: connects to
    (or with `is_store_owner` serves) the store at store_host:store_port,
    unless an open `store` is given (the owner that opened it on port 0 to
    learn a free port passes it here). `timeout_s` bounds the rendezvous and
    every later collective. Blocking until all members have joined; raises
    CollectiveError (naming the group) on a timeout or a store that cannot be
    reached, ValueError on a bad rank, size or owner port."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"gloo group {prefix!r}: rank {rank} of size {size}")
    if store is None:
        if is_store_owner and store_port == 0:
            raise ValueError(
                f"gloo group {prefix!r}: the store owner needs a known port "
                "(open_store(..., 0, is_owner=True) first, then pass store=)"
            )
        store = open_store(store_host, store_port, is_store_owner, timeout_s)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    if host is None and is_loopback(store_host):
        host = "127.0.0.1"
    device = (
        dist.ProcessGroupGloo.create_device(hostname=host)
        if host is not None
        else dist.ProcessGroupGloo.create_default_device()
    )
    opts._devices = [device]
    try:
        backend = dist.ProcessGroupGloo(
            dist.PrefixStore(prefix.rstrip("/") + "/", store), rank, size, opts
        )
    except RuntimeError as e:
        raise CollectiveError(
            f"gloo group {prefix!r}: rank {rank} of {size} could not join "
            f"through the store at {store_host}:{store.port}: {e}"
        ) from e
    return GlooGroup(backend, store, prefix, rank, size)
