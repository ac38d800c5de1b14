"""Simulated group aggregation (`comm.aggregate`, worker/group_reduce.py): the
members of a synchronous group wait for each other after their compute, reduce
(charged as gloo's ring all-reduce on their virtual links, sim/costs.py
`group_allreduce_s`), and shard i gets one PUSH carrying the group's mean and
its members, sent by member i mod k; that member's reply is shared with the
others (a broadcast, sim/costs.py `group_broadcast_s`) before each loads it. The shards run the real policies on these pushes, exactly as in a real run.

What a real group does on a failure is modelled by its outcome: a group with a
dead member does not reduce; its members push on their own (the unaggregated
path) until the plan no longer holds the dead one. Members switch plans at the
same step, the newest plan any of them had heard of when they last reduced, as
the real members agree in their reduction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hetps.proto.messages import Push
from hetps.proto.plan import ClusterPlan

from .costs import group_allreduce_s, group_broadcast_s


def group_of(plan: ClusterPlan, node_id: int) -> tuple[int, ...]:
    """The members of `node_id`'s synchronous group in `plan` (sync, balanced: every worker)."""
    return next((tuple(g) for g in plan.groups if node_id in g), (node_id,))


def group_mean(
    outgoing: list[dict[str, torch.Tensor]],
    samples: list[int],
    weighted: bool,
    buffers: frozenset[str],
) -> dict[str, torch.Tensor]:
    """What the members' all-reduce gives (GroupReduce.reduce): gradients' mean (weighted by
    samples where `weighted`), float buffers' plain mean, integer tensors' maximum."""
    total = sum(samples)
    weighted = weighted and total > 0 and all(n > 0 for n in samples)
    out = {}
    for name in outgoing[0]:
        ts = [o[name] for o in outgoing]
        if not ts[0].is_floating_point():
            out[name] = torch.stack(ts).amax(0)
        elif weighted and name not in buffers:
            out[name] = sum(t * float(n) for t, n in zip(ts, samples)) / float(total)
        else:
            out[name] = sum(t.clone() for t in ts) / float(len(ts))
    return out


@dataclass
class Gathering:
    """A group's members that finished their compute for one round, waiting for the rest."""

    members: tuple[int, ...]
    arrived: dict = field(default_factory=dict)  # node id -> its SimWorker, in arrival order


@dataclass
class Shared:
    """A reduced round in flight: who pushes which shard, and the members to share replies with."""

    members: list  # SimWorkers, in group order
    pushers: dict  # shard position -> SimWorker


class GroupRounds:
    """The engine's bookkeeping of aggregated rounds (engine.py calls `arrive`, `reply_to`)."""

    def __init__(self, weighted: bool, buffers: frozenset[str], min_group: int = 2):
        self.weighted = weighted
        self.min_group = min_group
        self.buffers = buffers
        self.gathering: dict[tuple[int, ...], Gathering] = {}
        self.in_flight: dict[int, Shared] = {}  # pusher node id -> its round
        self.rounds = 0
        self.pushes_saved = 0
        self.collective_s = 0.0

    def group(self, w, workers: dict) -> tuple[int, ...] | None:
        """`w`'s group if it reduces this step: `min_group` or more members, all alive."""
        members = group_of(w.client.plan, w.member.node_id)
        if len(members) < self.min_group or any(
            m not in workers or not workers[m].alive for m in members
        ):
            return None
        return members

    def arrive(self, w, members: tuple[int, ...]) -> list | None:
        """`w` finished its compute; the group's SimWorkers (in group order) once all have."""
        g = self.gathering.setdefault(members, Gathering(members))
        g.arrived[w.member.node_id] = w
        if set(g.arrived) != set(members):
            return None
        del self.gathering[members]
        return [g.arrived[m] for m in members]

    def release(self, dead: int) -> list:
        """A member died: the SimWorkers waiting in a gathering that holds it (they push alone)."""
        out = []
        for key in [k for k in self.gathering if dead in k]:
            out += list(self.gathering.pop(key).arrived.values())
        return out

    def reduce(self, group: list, now: float, newest: ClusterPlan) -> tuple[float, list]:
        """The group's reduction: (seconds it takes, [(pusher, shard position, Push)]). Every
        member's next plan is agreed here: `newest` if any member had heard of it."""
        mean = group_mean(
            [w.outgoing for w in group], [w.work.step_samples for w in group],
            self.weighted, self.buffers,
        )  # fmt: skip
        seconds = group_allreduce_s(
            sum(t.nbytes for t in mean.values()) + 24 * len(group), [w.link for w in group]
        )
        current = group[0].client.plan.plan_id
        agreed = newest if any(w.known_plan_id >= newest.plan_id > current for w in group) else None
        for w in group:
            w.agreed_plan = agreed
        members = [(w.member.node_id, w.clock) for w in group]
        total = sum(w.work.step_samples for w in group)
        pusher_plan = group[0].client.plan
        parts = group[0].client.split(mean)
        pushes, pushers = [], {}
        for i, part in enumerate(parts):
            w = group[i % len(group)]
            pushers[i] = w
            pushes.append(
                (
                    w,
                    i,
                    Push(
                        plan_id=pusher_plan.plan_id,
                        clock=w.clock,
                        base_version=w.client.versions[i],
                        n_samples=total,
                        pull=True,
                        tensors=part,
                        members=members,
                    ),
                )
            )
        for w in group:
            w.pushed_at = now
            w.in_group = True
            c = w.collective = w.collective or CollectiveCounts()
            c.aggregate, c.group_size = True, len(group)
            c.collective_s += seconds
            c.group_rounds += 1
            c.pushes_saved += sum(1 for p in pushers.values() if p is not w)
        shared = Shared(group, pushers)
        for w in set(pushers.values()):
            self.in_flight[w.member.node_id] = shared
        self.rounds += 1
        self.pushes_saved += len(parts) * (len(group) - 1)
        self.collective_s += seconds
        return seconds, pushes

    def orphaned(self, dead: int) -> list[tuple[int, list]]:
        """A pusher died: (shard position, the members waiting for its reply) of each reply
        it will never share; its rounds are dropped."""
        shared = self.in_flight.pop(dead, None)
        if shared is None:
            return []
        lost = [i for i, w in shared.pushers.items() if w.member.node_id == dead]
        for i in lost:
            del shared.pushers[i]
        return [(i, [w for w in shared.members if w.alive]) for i in lost]

    def reply_to(self, pusher_id: int, i: int, reply, nbytes: int) -> tuple[float, list]:
        """The pusher's reply from shard position `i`: (seconds its broadcast takes, the
        members to give it to), or (0, []) when `pusher_id` pushed no aggregated round."""
        shared = self.in_flight.get(pusher_id)
        if shared is None or shared.pushers.get(i) is None:
            return 0.0, []
        del shared.pushers[i]
        if not any(w.member.node_id == pusher_id for w in shared.pushers.values()):
            del self.in_flight[pusher_id]
        seconds = group_broadcast_s(
            nbytes_of_reply(reply, nbytes), [w.link for w in shared.members]
        )
        self.collective_s += seconds
        for w in shared.members:
            if w.collective is not None:
                w.collective.collective_s += seconds
        return seconds, shared.members


@dataclass
class CollectiveCounts:
    """One simulated member's collective counts, once it first reduced; `stats` is what a
    real worker's GroupReduce.stats reports (a simulated collective never fails)."""

    aggregate: bool = True  # its last push was its group's (engine.py sets it every push)
    group_size: int = 1
    collective_s: float = 0.0  # all-reduces and shared replies' broadcasts
    group_rounds: int = 0
    pushes_saved: int = 0  # the shards another member pushed for it

    def stats(self) -> dict:
        return {
            "aggregate": self.aggregate,
            "group_size": self.group_size if self.aggregate else 1,
            "collective_s": round(self.collective_s, 6),
            "collective_group_rounds": self.group_rounds,
            "collective_pushes_saved": self.pushes_saved,
            "collective_failures": 0,
            "collective_partial_rounds": 0,
        }


def nbytes_of_reply(reply, nbytes: int) -> int:
    """The bytes a shared reply's broadcast carries: its values (or the message's size)."""
    tensors = getattr(reply, "tensors", None)
    return sum(t.nbytes for t in tensors.values()) if tensors else nbytes
