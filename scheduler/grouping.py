"""Grouping-SGD's groups: workers of similar speed, found by k-means on the
1-D log speeds (solved exactly: in one dimension the best clusters are runs
of the sorted values, so dynamic programming over the split points finds the
optimum, with no random starts), with k from the config or chosen automatically:
`choose_k: ratio` (default) takes the smallest k whose groups each span less
than `equal_ratio` fastest/slowest; `choose_k: ch` takes the best
Calinski-Harabasz score, which over-splits small clusters of 1-D speeds
(4 workers at [100, 98, 33, 34] get 3 groups). And data shares proportional to the slowest speed in
each worker's group, so a group's members finish an epoch together.
"""

from __future__ import annotations

import numpy as np

from hetps.runconfig.algorithm_params import GroupingParams


def form_groups(speeds: dict[int, float], params: GroupingParams) -> list[list[int]]:
    """Groups of worker ids, fastest group first, members sorted by id.

    Edge cases: one worker or all speeds within `equal_ratio` (auto mode)
    give one group; k is capped at the number of distinct speeds. The
    k-means is exact (`kmeans_1d`): the same speeds always give the same groups."""
    ids = sorted(speeds)
    if not ids:
        return []
    # k-means on log(speed): "similar speed" is a ratio, so 10 vs 11 is as
    # close as 100 vs 110 and tiers 3x apart stay apart under noise
    values = np.log(np.array([[max(speeds[i], 1e-9)] for i in ids]))
    distinct = len(np.unique(values.round(6)))
    max_k = min(params.max_groups, distinct)
    if params.groups:
        k = min(params.groups, distinct)
    elif max_k <= 1 or np.exp(values.max() - values.min()) < params.equal_ratio:
        k = 1
    elif params.choose_k == "ch":
        k = _best_k(values, max_k)
    else:
        k = _smallest_homogeneous_k(values, max_k, params.equal_ratio)
    labels = kmeans_1d(values, k)
    groups = [[ids[j] for j in range(len(ids)) if labels[j] == c] for c in set(labels)]
    return sorted(groups, key=lambda g: -min(speeds[i] for i in g))


def kmeans_1d(values: np.ndarray, k: int) -> list[int]:
    """The optimal k-means clustering of 1-D `values` (least total squared
    distance to the cluster means): a cluster label per value, in input
    order. Optimal clusters are runs of the sorted values; `cost[m, i]` is
    the least cost of the first i sorted values in m clusters, O(k n^2)
    (a few ms for hundreds of workers). Ties go to the earliest split."""
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    n = len(x)
    k = max(1, min(k, n))
    if k == 1:
        return [0] * n
    order = np.argsort(x, kind="stable")
    ordered = x[order]
    sums = np.concatenate([[0.0], np.cumsum(ordered)])
    squares = np.concatenate([[0.0], np.cumsum(ordered * ordered)])
    cost = np.full((k + 1, n + 1), np.inf)
    cost[0, 0] = 0.0
    split = np.zeros((k + 1, n + 1), dtype=np.int64)
    for m in range(1, k + 1):
        for i in range(m, n + 1):
            starts = np.arange(m - 1, i)  # the m-th cluster is ordered[start:i]
            total = sums[i] - sums[starts]
            sse = np.maximum(squares[i] - squares[starts] - total * total / (i - starts), 0.0)
            candidates = cost[m - 1, starts] + sse
            best = int(np.argmin(candidates))
            cost[m, i], split[m, i] = candidates[best], starts[best]
    labels = np.empty(n, dtype=np.int64)
    end = n
    for m in range(k, 0, -1):
        start = int(split[m, end])
        labels[order[start:end]] = m - 1
        end = start
    return labels.tolist()


def calinski_harabasz(values: np.ndarray, labels: list[int]) -> float:
    """Between-cluster over within-cluster dispersion, each per degree of
    freedom (Calinski and Harabasz, 1974); 1.0 when every cluster is a point."""
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    lab = np.asarray(labels)
    clusters = [x[lab == c] for c in np.unique(lab)]
    n, k = len(x), len(clusters)
    between = sum(len(c) * (c.mean() - x.mean()) ** 2 for c in clusters)
    within = sum(((c - c.mean()) ** 2).sum() for c in clusters)
    return 1.0 if within == 0.0 else float(between * (n - k) / (within * (k - 1)))


def _smallest_homogeneous_k(values: np.ndarray, max_k: int, ratio: float) -> int:
    """The smallest k whose groups each span less than `ratio` (fastest/slowest);
    the Calinski-Harabasz choice when no k up to max_k achieves that."""
    for k in range(2, max_k + 1):
        labels = np.array(kmeans_1d(values, k))
        spans = [
            np.exp(values[labels == c].max() - values[labels == c].min())
            for c in set(labels.tolist())
        ]
        if max(spans) < ratio:
            return k
    return _best_k(values, max_k)


def _best_k(values: np.ndarray, max_k: int) -> int:
    """k in 2..max_k with the best Calinski-Harabasz score (k < n so the score is defined)."""
    n = len(values)
    if n == 2:
        return 2
    best_k, best_score = 2, -1.0
    for k in range(2, min(max_k, n - 1) + 1):
        labels = kmeans_1d(values, k)
        if len(set(labels)) < 2:
            continue
        score = calinski_harabasz(values, labels)
        if score > best_score:
            best_k, best_score = k, score
    return best_k


def data_shares(groups: list[list[int]], speeds: dict[int, float]) -> dict[int, float]:
    """Worker id -> relative data share: the slowest speed in its group."""
    return {w: min(speeds[m] for m in g) for g in groups for w in g}


def drifted(old: dict[int, float], new: dict[int, float], hysteresis: float) -> bool:
    """True when some worker's speed changed by more than `hysteresis`
    (relative), or the worker set changed."""
    if set(old) != set(new):
        return True
    return any(abs(new[w] - old[w]) > hysteresis * max(old[w], 1e-9) for w in old)
