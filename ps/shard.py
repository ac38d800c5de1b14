"""The parameter-server shard: a Service that holds the tensors the plan
assigned to it and applies pushes through the algorithm's consistency policy.

One loop, one thread; a pull that may not be answered yet is parked and
answered after a later push makes it ready. The shard never imports model
code: it knows tensor names, dtypes, shapes and kinds from the plan, and
values from the first INIT.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hetps.proto.codec import Envelope, ProtocolError
from hetps.proto.config import NodeConfig, RunConfig
from hetps.proto.emulation import Slowdown, work_clock
from hetps.proto.messages import Ack, Params, Status
from hetps.proto.plan import ClusterPlan
from hetps.proto.rpc import Service
from hetps.proto.transport import ServerTransport

from . import averaging, eager, policies
from .optim import Updater
from .policies import ConsistencyPolicy
from .store import TensorStore

# algorithm name -> consistency policy; each policy module exports its own POLICIES
POLICIES: dict[str, type[ConsistencyPolicy]] = {**policies.POLICIES, **eager.POLICIES, **averaging.POLICIES}

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParkedPull:
    peer: bytes
    req_id: int
    worker: int
    clock: int


class Shard(Service):
    def __init__(self, server: ServerTransport, node_id: int, plan: ClusterPlan, cfg: RunConfig,
                 slowdown: Slowdown | None = None):
        super().__init__(server, node_id)
        self.cfg = cfg
        self.plan = plan
        self.slowdown = slowdown or Slowdown(NodeConfig())
        self.store = TensorStore(plan.owned(plan.shard_index(node_id)))
        self.policy: ConsistencyPolicy | None = None
        self.parked: list[ParkedPull] = []
        self.plan_source = None  # callable(after) -> a newer plan or None, briefly blocking; set by the daemon
        self.counts = {"pushes": 0, "pulls": 0, "nonfinite": 0, "busy_s": 0.0}

    # ------------------------------------------------------------ Service hooks
    def catalog(self):
        return self.store.catalog

    def max_tensor_bytes(self) -> int:
        return self.cfg.cluster.max_message_bytes

    def stats(self) -> dict:
        policy = self.policy.stats() if self.policy else {}
        return {"version": self.store.version, "parked": len(self.parked), "plan_id": self.plan.plan_id,
                "malformed": self.malformed, "tensors": len(self.store.specs),
                "lr": self.policy.updater.lr if self.policy else 0.0, **self.counts, **policy}

    def adopt(self, plan: ClusterPlan) -> None:
        """Switch to a newer plan (same placement): open rounds are closed first."""
        if plan.placement_id != self.plan.placement_id:
            raise ValueError(f"plan {plan.plan_id} moves tensors; live re-placement is not supported")
        log.info("adopting plan %d (groups %s)", plan.plan_id, plan.groups)
        self.plan = plan
        if self.policy is not None:
            self.policy.adopt(plan)
        self._serve_parked()

    # ------------------------------------------------------------ handlers
    def on_init(self, peer: bytes, env: Envelope):
        first = self.store.initialize(env.msg.tensors)
        if first:
            updater = Updater(self.store.tensors, self.store.param_names(), self.cfg.optimizer)
            self.policy = POLICIES[self.plan.algorithm](self.store, updater, self.plan,
                                                        self.cfg.algorithm.params)
            log.info("initialized %d tensors from node %d", len(self.store.specs), env.src)
            self._serve_parked()
        return Ack(version=self.store.version, plan_id=self.plan.plan_id, info={"first": first})

    def on_push(self, peer: bytes, env: Envelope):
        push = env.msg
        if self.policy is None:
            raise ProtocolError(Status.NOT_READY, "no INIT has reached this shard yet")
        if push.plan_id < self.plan.placement_id:  # made for a placement that no longer holds
            raise ProtocolError(Status.STALE_PLAN, f"plan {push.plan_id} predates placement of plan "
                                                   f"{self.plan.placement_id}")
        self._check_finite(push.tensors)
        if push.plan_id > self.plan.plan_id and self.plan_source is not None:
            # the sender already follows a newer plan: switch first, so its push joins the
            # new plan's rounds here as on every other shard
            newer = self.plan_source(self.plan.plan_id)
            if newer is not None:
                self.adopt(newer)
        started = work_clock()
        staleness = self.policy.on_push(env.src, push)
        self._stretch(work_clock() - started)
        self.counts["pushes"] += 1
        self._serve_parked()
        return Ack(version=self.store.version, staleness=max(0, staleness), plan_id=self.plan.plan_id,
                   info=self.policy.reply_info(env.src))

    def on_pull(self, peer: bytes, env: Envelope):
        pull = ParkedPull(peer, env.req_id, env.src, env.msg.clock)
        if self._ready(pull):
            return self._params()
        self.parked.append(pull)
        return None

    # ------------------------------------------------------------ internals
    def _check_finite(self, tensors: dict) -> None:
        for name, t in tensors.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                self.counts["nonfinite"] += 1
                raise ProtocolError(Status.NONFINITE, f"tensor {name!r} holds NaN or Inf")

    def _stretch(self, busy_s: float) -> None:
        """Emulate a slower server: make this update take slowdown x its time."""
        self.counts["busy_s"] += self.slowdown.stretch(busy_s)

    def _ready(self, pull: ParkedPull) -> bool:
        return self.policy is not None and self.policy.pull_ready(pull.worker, pull.clock)

    def _params(self) -> Params:
        self.counts["pulls"] += 1
        return Params(version=self.store.version, tensors=self.store.snapshot())

    def _serve_parked(self) -> None:
        waiting = []
        for pull in self.parked:
            if self._ready(pull):
                self.reply(pull.peer, pull.req_id, self._params())
            else:
                waiting.append(pull)
        self.parked = waiting


def profile_update_speed(slowdown: Slowdown, numel: int = 1 << 18, steps: int = 5) -> float:
    """Bytes per second this shard updates: SGD-with-momentum steps on a
    scratch tensor, stretched by the emulated slowdown."""
    param = torch.zeros(numel)
    grad = torch.ones(numel)
    opt = torch.optim.SGD([param], lr=0.01, momentum=0.9)
    param.grad = grad
    opt.step()  # warm-up: allocates the momentum buffer
    started = work_clock()
    for _ in range(steps):
        opt.step()
    busy = (work_clock() - started) * slowdown.factor()
    return steps * numel * 4 / max(busy, 1e-9)
