"""Communication overlapped with compute (`comm.overlap: true`) for the
gradient-pushing worker loop (sync, async, ssp, grouping, eager).

Push during backward: a post-accumulate-grad hook on every parameter counts
the gradients each shard is still missing; once a shard has all of its own,
its PUSH leaves at once, with the PULL for the next step right behind it.
Placement puts the top layers on the last shard, and backward produces their
gradients first, so the top shard's push, update and reply travel while the
bottom layers' backward still runs. Whatever backward did not produce (an
unused parameter) goes as zeros when the step ends, as without overlap.

Pull in forward order: a forward pre-hook on every module that holds
tensors waits for the replies of the shards up to the one holding that
module's tensors (shards own contiguous ranges in forward order) and loads
them, so the next forward starts as soon as the bottom shard has answered.
A hook on the whole model loads whatever is left when its forward ends.
Limit: a module that reads a tensor registered after it (weights tied
backwards, on a later shard) would see it before its reply is loaded; when
autograd saved that tensor, backward then fails loudly on the in-place load.
Keep overlap off for such models.

The wire and the shards' policies do not change: one PUSH per shard per step
(with the PULL fused into it under `comm.fuse_pull`, else right behind it),
with the same clocks, so shards count rounds as before.
The pieces that overlap are the shards' ranges: more shards (with
`cluster.chunk_bytes` to cut a large tensor between them) overlap more finely.

Threads: one link thread per shard owns that shard's RpcClient exclusively
from `Overlap(...)` to `close()`; the training thread (and autograd) hand it
work through a queue and never touch the sockets. Every wait has a deadline
and is abandoned (`Aborted`) once `should_abort()` turns true.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from hetps.proto.messages import Ack
from hetps.proto.plan import ClusterPlan
from hetps.proto.rpc import Aborted, RequestTimeout
from hetps.training.state import ModelState

from .client import PSClient
from .trainer import Trainer

log = logging.getLogger(__name__)

JOIN_S = 10.0  # longest wait for a link thread to leave on close
IDLE_CHECK_S = 0.5  # an idle link thread checks this often whether it should leave


@dataclass
class Exchange:
    """One shard's push and pull of one step, filled in by its link thread."""

    shard: int
    tensors: dict[str, torch.Tensor]  # whole model tensors with a part on this shard
    clock: int
    n_samples: int
    queued_at: float = field(default_factory=time.monotonic)
    ack: Ack | None = None
    acked_at: float = 0.0
    values: dict[str, torch.Tensor] | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class ShardLink:
    """A thread that owns one shard's RpcClient: for each queued Exchange it
    builds the PUSH with the client's `_push` (compression included; one
    link at a time, under `build_lock`), sends it (asking for the values in
    it with `comm.fuse_pull`, else with a PULL right behind it), waits for the
    reply or replies and marks the exchange done (errors included)."""

    def __init__(self, client: PSClient, index: int, build_lock: threading.Lock):
        self.client = client
        self.index = index
        self.build_lock = build_lock
        self.jobs: queue.Queue[Exchange | None] = queue.Queue()
        self.leaving = threading.Event()
        self.thread = threading.Thread(
            target=self._serve, name=f"overlap-shard{index}", daemon=True
        )
        self.thread.start()

    def _serve(self) -> None:
        while (job := self._next_job()) is not None:
            try:
                self._exchange(job)
            except BaseException as exc:  # handed to the training thread, which raises it
                job.error = exc
            finally:
                job.done.set()

    def _next_job(self) -> Exchange | None:
        """The next queued exchange, in order; None once asked to leave."""
        while True:
            try:
                return self.jobs.get(timeout=IDLE_CHECK_S)
            except queue.Empty:
                if self.leaving.is_set():
                    return None

    def _exchange(self, job: Exchange) -> None:
        client, i = self.client, self.index
        part = client.split(job.tensors)[i]
        step = client.send_step(i, part, job.clock, job.n_samples, None, self.build_lock)
        job.ack, job.acked_at, reply = client.await_ack(i, step)
        job.values = client.await_values(i, step, reply).tensors

    def stop(self) -> bool:
        """Ask the thread to leave once the exchanges queued so far are done
        (each bounded by its request timeouts); True once it has left."""
        self.leaving.set()
        self.jobs.put(None)
        self.thread.join(timeout=JOIN_S)
        return not self.thread.is_alive()


def tensor_shards(plan: ClusterPlan) -> dict[str, set[int]]:
    """Model tensor name -> the shards holding it (several for a chunked tensor)."""
    whole = {part: name for name, chunk in plan.chunks.items() for part in chunk["parts"]}
    out: dict[str, set[int]] = {}
    for spec in plan.tensors:
        out.setdefault(whole.get(spec.name, spec.name), set()).add(plan.placement[spec.name])
    return out


def module_tensors(model: nn.Module) -> list[tuple[nn.Module, list[str]]]:
    """Every module that holds parameters or buffers itself, with their full names."""
    out = []
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        names = [dot + n for n, _ in module.named_parameters(recurse=False)]
        names += [dot + n for n, b in module.named_buffers(recurse=False) if b is not None]
        if names:
            out.append((module, names))
    return out


class Overlap:
    """The hooks and link threads of overlapped steps for one model.

    Per step, from the training thread: `begin(clock, n_samples)`, then the
    forward and backward (the hooks do the rest), then `finish()`, which
    pushes what backward did not and returns without waiting. `drain()`
    waits for and loads every outstanding reply (before a plan change).
    `close()` removes the hooks and stops the threads. Not re-entrant: one
    training thread. The hooks may run on autograd's threads (CUDA); they
    only queue work, under a lock.
    """

    def __init__(self, client: PSClient, state: ModelState, should_abort: Callable[[], bool]):
        self.client = client
        self.state = state
        self.should_abort = should_abort
        # a push and a pull, each with its timeout
        self.wait_limit_s = 2 * client.shards[0].timeout_s + 10.0
        self.shards_of = tensor_shards(client.plan)
        n = len(client.plan.shards)
        self.sources = [
            [name for name in state.tensors if i in self.shards_of[name]] for i in range(n)
        ]
        self.params = {
            i: {name for name in self.sources[i] if self._hooked(name)} for i in range(n)
        }
        self.pending: list[Exchange | None] = [None] * n  # sent, values not loaded yet
        # received parts of tensors not complete yet
        self.staged: dict[str, torch.Tensor] = {}
        self.loaded: list[Exchange] = []  # this step's exchanges whose values are in
        self.lock = threading.Lock()
        self.armed = False
        self.clock, self.n_samples = 0, 0
        self.missing: list[set[str]] = []
        self.pushed = [False] * n
        self.last_acks: list[Ack] = []  # the ACKs of the last step whose replies were all loaded
        # of that step: seconds its pushes were acked after finish()
        self.last_push_s = 0.0
        # seconds the training thread waited for replies since begin()
        self.wait_s = 0.0
        self.finished_at = 0.0
        build_lock = threading.Lock()
        self.links = [ShardLink(client, i, build_lock) for i in range(n)]
        self.handles = self._install_hooks()

    # ------------------------------------------------------------ hooks
    def _install_hooks(self) -> list:
        handles = []
        for name, (t, _) in self.state.tensors.items():
            if self._hooked(name):
                handles.append(
                    t.register_post_accumulate_grad_hook(functools.partial(self._on_grad, name))
                )
        for module, names in module_tensors(self.state.model):
            last = max(s for n in names for s in self.shards_of[n])
            handles.append(
                module.register_forward_pre_hook(functools.partial(self._before_forward, last))
            )
        handles.append(self.state.model.register_forward_hook(self._after_forward))
        return handles

    def _hooked(self, name: str) -> bool:
        """Whether backward produces a gradient for `name` (one the push waits for)."""
        t, kind = self.state.tensors[name]
        return kind == "param" and t.requires_grad

    def _before_forward(self, last_shard: int, module: nn.Module, args) -> None:
        self.load_through(last_shard)

    def _after_forward(self, module: nn.Module, args, output) -> None:
        self.load_through(len(self.links) - 1)

    def _on_grad(self, name: str, param: torch.Tensor) -> None:
        with self.lock:
            if not self.armed:
                return
            for i in self.shards_of[name]:
                self.missing[i].discard(name)
                if not self.missing[i] and not self.pushed[i]:
                    self._send(i)

    # ------------------------------------------------------------ steps
    def begin(self, clock: int, n_samples: int) -> None:
        """Arm the gradient hooks for the step that has made `clock` pushes."""
        with self.lock:
            self.clock, self.n_samples = clock, n_samples
            self.missing = [set(p) for p in self.params.values()]
            # a shard that holds no dense tensor is not asked (PSClient.dense): counted as pushed
            self.pushed = [i not in self.client.dense for i in range(len(self.links))]
            self.wait_s = 0.0
            self.armed = True

    def finish(self) -> None:
        """After backward: push every shard that has not pushed yet (missing
        gradients as zeros); never blocks on the network."""
        with self.lock:
            for i in range(len(self.links)):
                if not self.pushed[i]:
                    self._send(i)
            self.armed = False
            self.finished_at = time.monotonic()

    def _send(self, i: int) -> None:
        """Queue shard i's push (caller holds the lock)."""
        tensors = {}
        for name in self.sources[i]:
            t, kind = self.state.tensors[name]
            src = t.grad if kind == "param" else t
            src = torch.zeros_like(t) if src is None else src.detach()
            tensors[name] = src if src.device.type == "cpu" else src.to("cpu", copy=True)
        self.pushed[i] = True
        self.pending[i] = job = Exchange(i, tensors, self.clock, self.n_samples)
        self.links[i].jobs.put(job)

    # ------------------------------------------------------------ replies
    def load_through(self, last_shard: int) -> None:
        """Wait for the replies of shards 0..last_shard still outstanding and
        load every tensor that is complete. Raises Aborted, RequestTimeout,
        or the link's error (RemoteError ...)."""
        jobs = [j for j in self.pending[: last_shard + 1] if j is not None]
        if not jobs:
            return
        started = time.monotonic()
        for job in jobs:
            self._await(job)
            self.staged.update(job.values)
            self.pending[job.shard] = None
            self.loaded.append(job)
        self.wait_s += time.monotonic() - started
        self._load_complete()
        if all(j is None for j in self.pending):
            self._note_step()

    def drain(self) -> None:
        self.load_through(len(self.links) - 1)

    def _await(self, job: Exchange) -> None:
        deadline = job.queued_at + self.wait_limit_s
        while not job.done.wait(0.05):
            if self.should_abort():
                raise Aborted(f"overlapped push/pull to shard {job.shard} abandoned")
            if time.monotonic() > deadline:
                raise RequestTimeout(
                    self.client.shards[job.shard].address, "PUSH+PULL", self.wait_limit_s
                )
        if job.error is not None:
            raise job.error

    def _load_complete(self) -> None:
        values = {}
        for name, chunk in self.client.plan.chunks.items():
            if all(p in self.staged for p in chunk["parts"]):
                values[name] = torch.cat([self.staged.pop(p) for p in chunk["parts"]]).view(
                    chunk["shape"]
                )
        for name in [n for n in self.staged if n in self.state.tensors]:
            values[name] = self.staged.pop(name)
        self.state.load(values)

    def _note_step(self) -> None:
        """Every reply of a step is in: keep its ACKs and exposed push time."""
        done, self.loaded = sorted(self.loaded, key=lambda j: j.shard), []
        self.last_acks = [j.ack for j in done]
        self.last_push_s = max(0.0, max(j.acked_at for j in done) - self.finished_at)

    # ------------------------------------------------------------ end
    def close(self) -> bool:
        """Remove the hooks and stop the link threads (blocking, at most
        JOIN_S per thread). False if a thread did not leave: its socket is
        then still in use and must not be closed."""
        for handle in self.handles:
            handle.remove()
        stopped = True
        for link in self.links:
            if not link.stop():
                log.warning("link thread of shard %d did not stop within %.0fs", link.index, JOIN_S)
                stopped = False
        return stopped


class OverlapTrainer(Trainer):
    """The gradient-pushing worker loop with `comm.overlap`: the same steps
    as `Trainer`, pushes leaving during backward and pulls waited for during
    the next forward. A step record's `staleness` (and the push time of the
    speed estimate) is that of the previous step: its ACKs are known once
    the next forward has taken its replies. `wait_s`: seconds the forward
    waited for replies."""

    FLAT = False  # per-tensor gradients (see Trainer.FLAT)

    def __init__(self, *args, **kwargs):
        self.closing = threading.Event()
        self.overlap: Overlap | None = None
        super().__init__(*args, **kwargs)

    def should_abort(self) -> bool:
        return self.closing.is_set() or super().should_abort()

    def start(self) -> None:
        super().start()
        self.overlap = Overlap(self.client, self.state, self.should_abort)

    def use_plan(self, plan: ClusterPlan) -> None:
        # the previous step's replies first, under the plan they were made for
        if self.overlap is not None:
            self.overlap.drain()
        super().use_plan(plan)

    def compute(self) -> float:
        self.overlap.begin(self.clock, self.work.step_samples)
        return super().compute()

    def exchange(self) -> tuple[list[Ack], float]:
        # the row gradients exist only once backward is done: pushed here, on their own
        # connections; the next step's pulls of rows wait at the shards for their round
        if self.rows is not None:
            self.rows.push(self.work.step_samples)
        self.overlap.finish()
        return self.overlap.last_acks, self.overlap.last_push_s

    def record(self, loss: float, compute_s: float, started: float) -> dict:
        return {**super().record(loss, compute_s, started), "wait_s": round(self.overlap.wait_s, 5)}

    def close(self) -> None:
        self.closing.set()
        if self.overlap is None or self.overlap.close():
            super().close()
        else:
            log.warning("shard sockets left open: a link thread is still using one")
