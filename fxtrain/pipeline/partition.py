"""Optimal contiguous partition of a cost sequence: the smallest possible largest stage.

Stages of a pipeline run concurrently, so a step takes as long as its slowest stage: the plan to
find is the split of the node sequence into ``k`` contiguous, non-empty pieces whose largest cost
is minimal (the min-max, or bottleneck, partition). Among the plans reaching that optimum, the one
sending the fewest activation bytes between stages is chosen (a cut inside a chain of cheap ops
costs nothing to compute but may send a large tensor).

Both problems are solved exactly by dynamic programming over cut positions (vectorised with numpy,
O(k·n²) simple operations), which is fast for the few thousand nodes of a large model.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np


def stage_costs(costs: Sequence[float], cuts: Sequence[int]) -> List[float]:
    """Cost of each stage for cut positions ``cuts`` (stage i covers [cuts[i-1], cuts[i]))."""
    bounds = [0] + list(cuts) + [len(costs)]
    return [float(sum(costs[a:b])) for a, b in zip(bounds, bounds[1:])]


def min_max_partition(costs: Sequence[float], k: int, *, allowed: Optional[Sequence[bool]] = None,
                      cut_weights: Optional[Sequence[float]] = None) -> Tuple[List[int], float]:
    """Cut positions (k-1 increasing indices in 1..n-1) minimising the largest stage cost.

    ``allowed[c]`` says whether a cut may go before element ``c`` (index 0..n; 0 and n never are);
    ``cut_weights[c]`` is the secondary cost of cutting there (bytes sent), minimised in total among
    the optimal plans. Returns (cuts, the optimal largest stage cost).
    """
    n = len(costs)
    if k < 1:
        raise ValueError(f"number of stages must be >= 1, got {k}")
    ok = np.ones(n + 1, dtype=bool) if allowed is None else np.asarray(allowed, dtype=bool).copy()
    ok[0] = ok[n] = False
    if k - 1 > int(ok.sum()):
        raise ValueError(f"cannot make {k} stages: only {int(ok.sum())} places to cut the graph")
    if k == 1:
        return [], float(sum(costs))
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=np.float64))])
    positions = np.arange(n + 1)
    # best[j][c]: minimal largest cost of splitting elements [0, c) into j+1 stages with a cut at c
    # (c = n for the full sequence). Cuts must be allowed; stages non-empty.
    inf = np.inf
    best = np.where(positions >= 1, prefix, inf)
    best = np.where(ok | (positions == n), best, inf)
    layers = [best]
    for _ in range(1, k):
        prev = layers[-1]
        cur = np.full(n + 1, inf)
        for c in range(2, n + 1):
            if not (ok[c] or c == n):
                continue
            seg = prefix[c] - prefix[:c]                       # cost of stage [c1, c) for every c1 < c
            cand = np.maximum(prev[:c], seg)
            cur[c] = cand.min()
        layers.append(cur)
    optimum = float(layers[-1][n])
    if not np.isfinite(optimum):
        raise ValueError(f"cannot make {k} non-empty stages of this graph")
    # Secondary objective: least total cut weight among plans whose every stage is <= optimum.
    # Compare with a relative tolerance so float rounding of prefix sums cannot exclude the optimum.
    limit = optimum + 1e-9 * max(1.0, abs(optimum))
    w = np.zeros(n + 1) if cut_weights is None else np.asarray(cut_weights, dtype=np.float64)
    total = np.where((positions >= 1) & (prefix <= limit) & (ok | (positions == n)), 0.0, inf)
    tables = [total]
    for _ in range(1, k):
        prev = tables[-1]
        cur = np.full(n + 1, inf)
        for c in range(2, n + 1):
            if not (ok[c] or c == n):
                continue
            feasible = (prefix[c] - prefix[:c]) <= limit
            cand = np.where(feasible, prev[:c] + w[:c], inf)
            cur[c] = cand.min()
        tables.append(cur)
    # Walk back from the end: at each step take the earliest predecessor reaching the optimum.
    cuts: List[int] = []
    c = n
    for j in range(k - 1, 0, -1):
        prev = tables[j - 1]
        feasible = (prefix[c] - prefix[:c]) <= limit
        cand = np.where(feasible, prev[:c] + w[:c], inf)
        c1 = int(np.argmin(cand))
        cuts.append(c1)
        c = c1
    cuts.reverse()
    return cuts, max(stage_costs(costs, cuts))
