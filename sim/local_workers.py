"""Simulated workers of the local-step loops: model averaging (cpsgd,
adpsgd, wpsgd, simuparallel: `worker/local.py`) and diloco
(`worker/diloco.py`). The per-step and per-round logic is the real loops'
(worker/step.py's `LocalRounds` and `DilocoRounds`: local optimizer step,
when a round is due, what a round pushes, how its reply is taken: the
mean, adpsgd's next period, diloco's H_i from the plan's speeds); the
simulator (engine.py) carries the messages on its clock and each local
step costs the worker's compute time.

Unlike a gradient worker, each keeps its own model and local optimizer
state between steps (memory grows with the number of workers).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from hetps.proto.messages import Ack, Params, Pull, Push
from hetps.proto.plan import ClusterPlan
from hetps.proto.records import PushInfo
from hetps.runconfig.schema import NodeConfig, RunConfig
from hetps.training.data import Datasets
from hetps.training.parts import ack_of
from hetps.training.state import ModelState
from hetps.training.step import DilocoRounds, LocalRounds

from .workers import SimMember, SimWorker


class SimLocalWorker(SimWorker):
    """cpsgd, adpsgd, wpsgd, simuparallel: local steps, then a push of the
    model and a pull (unfused, as the real client sends them) of the mean."""

    fused = False

    def __init__(
        self,
        cfg: RunConfig,
        node: NodeConfig,
        member: SimMember,
        plan: ClusterPlan,
        state: ModelState,
        data: Datasets,
        *,
        clock: Callable[[], float],
    ):
        """`state`: the engine's model, which this worker copies as its own;
        `clock`: the virtual clock (seconds), for time-based periods."""
        own = ModelState(copy.deepcopy(state.model), state.device)
        super().__init__(cfg, node, member, plan, own, data)
        self.rounds = self.make_rounds(plan, clock)
        self.acks: dict[int, Ack] = {}
        self.record: dict | None = None  # the step whose round is in flight
        self.finished = False  # pushed its final model: replies are not awaited

    def make_rounds(self, plan: ClusterPlan, clock: Callable[[], float]) -> LocalRounds:
        """The local optimizer and the rounds' logic (worker/step.py), on the virtual clock."""
        return LocalRounds(self.cfg, self.work, clock)

    def follow_plan(self, newest: ClusterPlan) -> bool:
        return True  # the real averaging loop keeps the plan it started with

    def start_step(self, now: float, newest: ClusterPlan) -> float | None:
        """One local step on its own model (real forward, backward and
        optimizer step); returns its virtual compute seconds, or None when it stops."""
        if not self.follow_plan(newest):
            return None
        self.step_started = now
        # before the step: the straggler is drawn on its clock
        self.compute_s = self.step_compute_s(now)
        self.loss = self.rounds.step()
        self.clock += 1
        return self.compute_s

    def pushes(self, now: float) -> list[tuple[int, Push | Pull]]:
        """After a local step: nothing (the next step follows) or, when a round
        is due, the round's push (and pull) to every shard."""
        self.record = {
            "t": now,
            "worker": self.member.rank,
            "step": self.clock,
            "loss": round(self.loss, 5),
            "staleness": self.staleness,
            "compute_s": round(self.compute_s, 5),
            **self.work.norm_record(),
        }
        if not self.rounds.due():
            self._account(now, 0.0)
            return []
        self.pushed_at = now
        return self.round_messages(*self.rounds.request(), final=False)

    def round_messages(
        self, tensors: dict, clock: int, n_samples: int, info: dict, final: bool
    ) -> list[tuple[int, Push | Pull]]:
        """A round's request (LocalRounds.request or final_request) as messages
        to every shard: pushes, and pulls of the result unless fused or final."""
        plan = self.client.plan
        out = []
        for i, part in enumerate(self.client.split(tensors)):
            out.append(
                (
                    i,
                    Push(
                        plan_id=plan.plan_id,
                        clock=clock,
                        base_version=self.client.versions[i],
                        n_samples=n_samples,
                        info=PushInfo.read(info),
                        pull=self.fused and not final,
                        tensors=part,
                    ),
                )
            )
            if not self.fused and not final:
                out.append((i, Pull(plan_id=plan.plan_id, clock=clock + 1)))
        return out

    def final_pushes(self) -> list[tuple[int, Push]]:
        """The run stopped: with `final_average`, between rounds and after local
        steps, push the model once more without waiting for the mean
        (LocalSgdTrainer.push_final)."""
        if not self.rounds.final_due():
            return []
        self.finished = True
        return self.round_messages(*self.rounds.final_request(), final=True)

    def take_reply(self, i: int, reply: Ack | Params, nbytes: int) -> bool:
        """Keep shard `i`'s ACK or values; True once every shard's values (and,
        in a round, ACK) have come."""
        self.client.bytes_received += nbytes
        if self.finished:
            return False
        if isinstance(reply, Ack):
            self.acks[i] = reply
            return False
        self.client.versions[i] = reply.version
        self.replies[i] = reply
        if reply.ack:
            self.acks[i] = ack_of(reply)[0]
        n = len(self.client.plan.shards)
        return len(self.replies) == n and (self.record is None or len(self.acks) == n)

    def finish_step(self, now: float) -> None:
        """Every shard answered: the first values, or the round's mean (or new global model)."""
        replies, self.replies = self.replies, {}
        acks, self.acks = [a for _, a in sorted(self.acks.items())], {}
        values = {}
        for reply in replies.values():
            values.update(reply.tensors)
        values = self.client.join(values)
        if self.record is None:  # the first pull
            self.state.load(values)
            self.rounds.begin()
            return
        # fused (diloco): the seconds the values waited
        held = [ack_of(r)[1] for r in replies.values() if r.ack]
        push_s = max(0.0, max(now - h for h in held) - self.pushed_at) if held else 0.0
        self.record.update(self.take_round(acks, values))
        self._account(now, push_s)

    def take_round(self, acks: list[Ack], values: dict) -> dict:
        """Take the round's result (LocalRounds.take); fields for the step record."""
        return self.rounds.take(acks, values)

    def _account(self, now: float, push_s: float) -> None:
        step_s = now - self.step_started
        self.timer.update(self.compute_s, push_s, step_s)
        self.records.append({**self.record, "step_s": round(step_s, 5)})

    def stats(self) -> dict:
        return {**super().stats(), "rounds": self.rounds.round, "period": self.rounds.period}


class SimDilocoWorker(SimLocalWorker):
    """diloco: H_i local steps (from the plan's speeds), then a fused push of
    the pseudo-gradient and pull of the new global model; follows new plans
    between steps as the real DilocoTrainer does."""

    fused = True
    rounds: DilocoRounds

    def make_rounds(self, plan: ClusterPlan, clock: Callable[[], float]) -> DilocoRounds:
        return DilocoRounds(self.cfg, self.work, clock, plan)

    def follow_plan(self, newest: ClusterPlan) -> bool:
        return SimWorker.follow_plan(self, newest)  # not SimLocalWorker's: diloco follows plans

    def use_plan(self, plan: ClusterPlan) -> None:
        """Switch to a newer `plan` between steps: share and batch, and H_i."""
        super().use_plan(plan)
        self.rounds.use_plan(plan)

    def take_round(self, acks: list[Ack], values: dict) -> dict:
        """The new global model (DilocoRounds.take); the ACKs' staleness and
        newest plan, as the real DilocoTrainer notes them."""
        fields = self.rounds.take(acks, values)
        if acks:
            self.staleness = max(a.staleness for a in acks)
            self.known_plan_id = max(self.known_plan_id, max(a.plan_id for a in acks))
        return {**fields, "staleness": self.staleness}
