"""Work in proportion to speed: how much each worker does per round so that
every worker takes about the same time. Pure functions, used by the
scheduler (`balanced`: per-worker batch sizes in the plan) and by workers
(`diloco`: local steps per round from the plan's speeds).
"""

from __future__ import annotations

import math


def proportional_sizes(speeds: dict[int, float], total: int, low: int, high: int) -> dict[int, int]:
    """Worker id -> an integer size proportional to its speed (samples/s),
    each within [`low`, `high`] (`high` 0: no upper bound), summing to `total`
    whenever the bounds allow it (len × low <= total <= len × high; otherwise
    every size sits at the bound that was violated).

    Water-filling: sizes that fall outside a bound are pinned to it and the
    rest of `total` is shared among the others in proportion to speed; then
    largest-remainder rounding keeps the integer sum exact. Equal speeds give
    equal sizes (differing by at most one when `total` is not divisible).
    A speed that is not a positive finite number counts as the slowest
    positive one (or 1.0 when none is)."""
    if not speeds:
        return {}
    high = high or total
    positive = [s for s in speeds.values() if math.isfinite(s) and s > 0]
    floor = min(positive) if positive else 1.0
    speed = {w: s if math.isfinite(s) and s > 0 else floor for w, s in speeds.items()}
    pinned: dict[int, float] = {}
    free = dict(speed)
    while free:
        left = total - sum(pinned.values())
        scale = left / sum(free.values())
        out = {w: s * scale for w, s in free.items()}
        over = {w for w, v in out.items() if v > high}
        under = {w for w, v in out.items() if v < low}
        if not over and not under:
            pinned.update(out)
            break
        for w in over:
            pinned[w] = float(high)
        for w in under:
            pinned[w] = float(low)
        for w in over | under:
            del free[w]
    return _round_keeping_sum(pinned, low, high)


def _round_keeping_sum(values: dict[int, float], low: int, high: int) -> dict[int, int]:
    """Integers near `values` whose sum is round(sum(values)), within [low, high]."""
    target = round(sum(values.values()))
    sizes = {w: max(low, min(high, math.floor(v + 1e-9))) for w, v in values.items()}
    # hand out what the floors left over, biggest fractional part first (ties: lower id)
    order = sorted(values, key=lambda w: (-(values[w] - math.floor(values[w] + 1e-9)), w))
    for w in order:
        if sum(sizes.values()) >= target:
            break
        if sizes[w] < high:
            sizes[w] += 1
    return sizes


def local_steps(speed: float, fastest: float, period: int, min_period: int = 1) -> int:
    """Local steps per round for a worker of `speed` when the fastest worker
    (`fastest`) takes `period`: period × speed / fastest, at least
    `min_period` (Dynamic Local Updates, arXiv 2401.09135). Unknown speeds
    (not positive) give `period`."""
    if not (speed > 0 and fastest > 0 and math.isfinite(speed) and math.isfinite(fastest)):
        return period
    return max(min_period, min(period, round(period * speed / fastest)))
