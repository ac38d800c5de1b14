"""Consistency policies: how a shard turns pushes into updates and when it
may answer a pull. One file per family; POLICIES finds a class by the policy
name the algorithm table (hetps.runconfig.algorithms) gives.

- base.py: the interface, the shared push-acceptance path, gradient rounds;
- sync.py: synchronous rounds per group (grouping, sync, balanced);
- ssp.py: pushes applied as they come (async, ssp);
- eager.py: rounds that close on a quorum (eager);
- averaging.py: model averaging (cpsgd, adpsgd, wpsgd and simuparallel);
- diloco.py: pseudo-gradients applied at once by an outer Nesterov optimizer (diloco).
"""

from __future__ import annotations

from . import averaging, diloco, eager
from .base import Accepted, ConsistencyPolicy, Round, Waiting
from .eager import EagerPolicy
from .ssp import AsyncPolicy, SspPolicy
from .sync import BalancedPolicy, GroupingPolicy, SyncPolicy

# policy name -> class (the table's `policy` field)
POLICIES: dict[str, type[ConsistencyPolicy]] = {
    **{p.name: p for p in (SyncPolicy, AsyncPolicy, SspPolicy, GroupingPolicy, BalancedPolicy)},
    **eager.POLICIES,
    **averaging.POLICIES,
    **diloco.POLICIES,
}

__all__ = [
    "POLICIES",
    "Accepted",
    "AsyncPolicy",
    "ConsistencyPolicy",
    "EagerPolicy",
    "GroupingPolicy",
    "Round",
    "SspPolicy",
    "SyncPolicy",
    "Waiting",
]
