"""Grouping-SGD's groups: workers of similar speed, found by k-means on the
1-D log speeds (scikit-learn), with k from the config or chosen automatically:
`choose_k: ratio` (default) takes the smallest k whose groups each span less
than `equal_ratio` fastest/slowest; `choose_k: ch` takes the best
Calinski-Harabasz score, which over-splits small clusters of 1-D speeds
(4 workers at [100, 98, 33, 34] get 3 groups). And data shares proportional to the slowest speed in
each worker's group, so a group's members finish an epoch together.
"""
from __future__ import annotations

import importlib
import warnings

import numpy as np

from hetps.proto.algorithm_params import GroupingParams


def form_groups(speeds: dict[int, float], params: GroupingParams, seed: int = 0) -> list[list[int]]:
    """Groups of worker ids, fastest group first, members sorted by id.

    Edge cases: one worker or all speeds within `equal_ratio` (auto mode)
    give one group; k is capped at the number of distinct speeds."""
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
        k = _best_k(values, max_k, seed)
    else:
        k = _smallest_homogeneous_k(values, max_k, params.equal_ratio, seed)
    labels = _kmeans(values, k, seed)
    groups = [[ids[j] for j in range(len(ids)) if labels[j] == c] for c in set(labels)]
    return sorted(groups, key=lambda g: -min(speeds[i] for i in g))


def preload() -> None:
    """Import scikit-learn's k-means now: the first import takes about a
    second, which the first plan would otherwise wait for."""
    for module in ("sklearn.cluster", "sklearn.metrics"):
        importlib.import_module(module)


def _kmeans(values: np.ndarray, k: int, seed: int) -> list[int]:
    if k <= 1:
        return [0] * len(values)
    from sklearn.cluster import KMeans

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate points: fewer distinct clusters than k
        return KMeans(n_clusters=k, n_init=10, random_state=seed).fit(values).labels_.tolist()


def _smallest_homogeneous_k(values: np.ndarray, max_k: int, ratio: float, seed: int) -> int:
    """The smallest k whose groups each span less than `ratio` (fastest/slowest);
    the Calinski-Harabasz choice when no k up to max_k achieves that."""
    for k in range(2, max_k + 1):
        labels = np.array(_kmeans(values, k, seed))
        spans = [np.exp(values[labels == c].max() - values[labels == c].min()) for c in set(labels.tolist())]
        if max(spans) < ratio:
            return k
    return _best_k(values, max_k, seed)


def _best_k(values: np.ndarray, max_k: int, seed: int) -> int:
    """k in 2..max_k with the best Calinski-Harabasz score (k < n so the score is defined)."""
    from sklearn.metrics import calinski_harabasz_score

    n = len(values)
    if n == 2:
        return 2
    best_k, best_score = 2, -1.0
    for k in range(2, min(max_k, n - 1) + 1):
        labels = _kmeans(values, k, seed)
        if len(set(labels)) < 2:
            continue
        score = calinski_harabasz_score(values, labels)
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
