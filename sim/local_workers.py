"""Simulated workers of the local-step loops: model averaging (cpsgd,
adpsgd, wpsgd, simuparallel: `worker/local.py`) and diloco
(`worker/diloco.py`). The per-step and per-round logic is the real
trainers' (their methods are borrowed: local optimizer step, `due`, what a
round pushes, how its reply is taken: the mean, adpsgd's next period,
diloco's H_i from the plan's speeds); the simulator (engine.py) carries the
messages on its clock and each local step costs the worker's compute time.

Unlike a gradient worker, each keeps its own model and local optimizer
state between steps (memory grows with the number of workers).
"""
from __future__ import annotations

import copy

from hetps.proto.messages import Ack, Params, Pull, Push
from hetps.proto.plan import ClusterPlan
from hetps.worker.client import ack_of
from hetps.worker.diloco import DilocoTrainer
from hetps.worker.local import LocalSgdTrainer
from hetps.worker.state import ModelState
from hetps.worker.trainer import clipped_params

from .workers import SimWorker


class SimLocalWorker(SimWorker):
    """cpsgd, adpsgd, wpsgd, simuparallel: local steps, then a push of the
    model and a pull (unfused, as the real client sends them) of the mean."""

    init_local = LocalSgdTrainer.init_local
    optimizer_step = LocalSgdTrainer.optimizer_step
    model_values = LocalSgdTrainer.model_values
    info = LocalSgdTrainer.info
    due = LocalSgdTrainer.due
    round_request = LocalSgdTrainer.average_request
    take_round = LocalSgdTrainer.take_average
    fused = False

    def __init__(self, *args, clock):
        """`clock`: the virtual clock (seconds), for time-based periods."""
        super().__init__(*args)
        self.state = ModelState(copy.deepcopy(self.state.model), self.state.device)  # its own model
        self.clipped = clipped_params(self.cfg, self.state)
        self.now = clock
        self.init_local()
        self.acks: dict[int, Ack] = {}
        self.record: dict | None = None   # the step whose round is in flight
        self.finished = False             # pushed its final model: replies are not awaited

    def follow_plan(self, newest: ClusterPlan) -> bool:
        return True  # the real averaging loop keeps the plan it started with

    def start_step(self, now: float, newest: ClusterPlan) -> float | None:
        """One local step on its own model (real forward, backward and
        optimizer step); returns its virtual compute seconds, or None when it stops."""
        if not self.follow_plan(newest):
            return None
        self.step_started = now
        self.compute_s = self.step_compute_s(now)  # before the step: the straggler is drawn on its clock
        self.loss = self.optimizer_step()
        return self.compute_s

    def pushes(self, now: float) -> list[tuple[int, Push | Pull]]:
        """After a local step: nothing (the next step follows) or, when a round
        is due, the round's push (and pull) to every shard."""
        self.record = {"t": now, "worker": self.member.rank, "step": self.clock, "loss": round(self.loss, 5),
                       "staleness": self.staleness, "compute_s": round(self.compute_s, 5), **self.norm_record()}
        if not self.due():
            self._account(now, 0.0)
            return []
        self.in_flight, self.pushed_at = True, now
        return self.round_messages(*self.round_request(), final=False)

    def round_messages(self, tensors: dict, clock: int, n_samples: int, info: dict,
                       final: bool) -> list[tuple[int, Push | Pull]]:
        plan = self.client.plan
        info = {**info, "final": True} if final else info
        out = []
        for i, part in enumerate(self.client.split(tensors)):
            out.append((i, Push(plan_id=plan.plan_id, clock=clock, base_version=self.client.versions[i],
                                n_samples=n_samples, info=info, pull=self.fused and not final, tensors=part)))
            if not self.fused and not final:
                out.append((i, Pull(plan_id=plan.plan_id, clock=clock + 1)))
        return out

    def final_pushes(self) -> list[tuple[int, Push]]:
        """The run stopped: with `final_average`, between rounds and after local
        steps, push the model once more without waiting for the mean
        (LocalSgdTrainer.push_final)."""
        if not (self.final_average and not self.in_flight and self.steps_in_round):
            return []
        self.finished = True
        tensors, clock, n_samples, info = self.round_request()
        return self.round_messages(tensors, clock, n_samples, info, final=True)

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
        if self.record is None:   # the first pull
            self.state.load(values)
            self.after_first_pull()
            return
        held = [ack_of(r)[1] for r in replies.values() if r.ack]  # fused (diloco): seconds the values waited
        push_s = max(0.0, max(now - h for h in held) - self.pushed_at) if held else 0.0
        self.record.update(self.take_round(acks, values))
        self._account(now, push_s)

    def after_first_pull(self) -> None:
        self.round_started = self.now()

    def _account(self, now: float, push_s: float) -> None:
        step_s = now - self.step_started
        self.timer.update(self.compute_s, push_s, step_s)
        self.records.append({**self.record, "step_s": round(step_s, 5)})

    def stats(self) -> dict:
        return {**super().stats(), "rounds": self.round, "period": self.period}


class SimDilocoWorker(SimLocalWorker):
    """diloco: H_i local steps (from the plan's speeds), then a fused push of
    the pseudo-gradient and pull of the new global model; follows new plans
    between steps as the real DilocoTrainer does."""

    period_for = DilocoTrainer.period_for
    use_plan = DilocoTrainer.use_plan
    params = DilocoTrainer.params
    pseudo_gradient = DilocoTrainer.pseudo_gradient
    due = DilocoTrainer.due
    round_request = DilocoTrainer.round_request
    take_round = DilocoTrainer.take_round
    fused = True

    def __init__(self, *args, clock):
        super().__init__(*args, clock=clock)
        self.period = self.period_for(self.client.plan)
        self.start_values = self.params()

    def follow_plan(self, newest: ClusterPlan) -> bool:
        self.known_plan_id = max(self.known_plan_id, self.member.plan_id)
        return SimWorker.follow_plan(self, newest)

    def after_first_pull(self) -> None:
        self.start_values = self.params()
