"""How the scheduler forms the workers' synchronous groups, by the algorithm
table's `groups` trait: `all` (one group of every worker), `each` (every
worker alone), `by_speed` (Grouping-SGD's k-means on measured speeds, with
data shares and re-grouping while training), `balanced` (one group whose
batch sizes are proportional to speed, re-sized while training). FORMATIONS is the scheduler's
one registry of algorithm traits; it never branches on an algorithm's name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from hetps.runtime.speed_shares import proportional_sizes

from .grouping import data_shares, form_groups


@dataclass(frozen=True)
class Formation:
    # (node id -> speed, algorithm params) -> plan fields
    plan_fields: Callable[[dict, object], dict]
    # may be re-formed while training when speeds drift (if the params' `regroup`)
    regroups: bool = False
    # (plan fields, params) -> what re-forming votes on: a new plan when it differs from the current plan's
    proposal: Callable[[dict, object], object] = lambda fields, params: sorted(
        map(sorted, fields["groups"])
    )

    def may_regroup(self, params) -> bool:
        return self.regroups and params.regroup


def one_group(speeds: dict[int, float], params) -> dict:
    return {"groups": [sorted(speeds)], "shares": {}}


def each_alone(speeds: dict[int, float], params) -> dict:
    return {"groups": [[w] for w in sorted(speeds)], "shares": {}}


def by_speed(speeds: dict[int, float], params) -> dict:
    groups = form_groups(speeds, params)
    return {"groups": groups, "shares": {str(w): s for w, s in data_shares(groups, speeds).items()}}


def balanced(speeds: dict[int, float], params) -> dict:
    """One group; batch sizes proportional to speed summing to the global
    batch (`proportional_sizes`); data shares follow the batches, so every
    worker goes through its share in the same number of rounds."""
    batches = proportional_sizes(speeds, params.global_batch, params.min_batch, params.max_batch)
    return {
        "groups": [sorted(speeds)],
        "shares": {str(w): float(b) for w, b in batches.items()},
        "batches": {str(w): float(b) for w, b in batches.items()},
    }


def batch_buckets(fields: dict, params) -> list:
    """Balanced re-sizing votes on each worker's batch on a log scale whose
    step is the hysteresis: noise of a few samples does not count as a change."""
    step = math.log1p(params.hysteresis)
    return sorted((w, round(math.log(max(b, 1.0)) / step)) for w, b in fields["batches"].items())


# the table's `groups` -> how the scheduler forms them
FORMATIONS: dict[str, Formation] = {
    "all": Formation(one_group),
    "each": Formation(each_alone),
    "by_speed": Formation(by_speed, regroups=True),
    "balanced": Formation(balanced, regroups=True, proposal=batch_buckets),
}
