"""How the scheduler forms the workers' synchronous groups, by the algorithm
table's `groups` trait: `all` (one group of every worker), `each` (every
worker alone), `by_speed` (Grouping-SGD's k-means on measured speeds, with
data shares and re-grouping while training). FORMATIONS is the scheduler's
one registry of algorithm traits; it never branches on an algorithm's name.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .grouping import data_shares, form_groups


@dataclass(frozen=True)
class Formation:
    plan_fields: Callable[[dict, object, int], dict]  # (node id -> speed, algorithm params, seed) -> plan fields
    regroups: bool = False  # may be re-formed while training when speeds drift (if the params' `regroup`)

    def may_regroup(self, params) -> bool:
        return self.regroups and params.regroup


def one_group(speeds: dict[int, float], params, seed: int) -> dict:
    return {"groups": [sorted(speeds)], "shares": {}}


def each_alone(speeds: dict[int, float], params, seed: int) -> dict:
    return {"groups": [[w] for w in sorted(speeds)], "shares": {}}


def by_speed(speeds: dict[int, float], params, seed: int) -> dict:
    groups = form_groups(speeds, params, seed)
    return {"groups": groups, "shares": {str(w): s for w, s in data_shares(groups, speeds).items()}}


# the table's `groups` -> how the scheduler forms them
FORMATIONS: dict[str, Formation] = {"all": Formation(one_group), "each": Formation(each_alone),
                                    "by_speed": Formation(by_speed, regroups=True)}
