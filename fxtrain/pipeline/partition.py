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

from typing import Callable, List, Optional, Sequence, Tuple

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
    inf = np.inf
    ends = ok | (positions == n)   # where a stage may end

    def tables(first: np.ndarray, candidates: Callable[[np.ndarray, int], np.ndarray]) -> List[np.ndarray]:
        """``first``, then per further stage and end ``c`` the least of ``candidates(previous, c)``,
        one per start ``c1 < c`` (``prefix[c] - prefix[:c]``: the cost of stage [c1, c) for each)."""
        out = [first]
        for _ in range(1, k):
            cur = np.full(n + 1, inf)
            for c in range(2, n + 1):
                if ends[c]:
                    cur[c] = candidates(out[-1], c).min()
            out.append(cur)
        return out

    # best[j][c]: minimal largest cost of splitting elements [0, c) into j+1 stages with a cut at c
    # (c = n for the full sequence). Cuts must be allowed; stages non-empty.
    best = tables(np.where((positions >= 1) & ends, prefix, inf),
                  lambda prev, c: np.maximum(prev[:c], prefix[c] - prefix[:c]))
    optimum = float(best[-1][n])
    if not np.isfinite(optimum):
        raise ValueError(f"cannot make {k} non-empty stages of this graph")
    # Secondary objective: least total cut weight among plans whose every stage is <= optimum.
    # Compare with a relative tolerance so float rounding of prefix sums cannot exclude the optimum.
    limit = optimum + 1e-9 * max(1.0, abs(optimum))
    w = np.zeros(n + 1) if cut_weights is None else np.asarray(cut_weights, dtype=np.float64)

    def weighted(prev: np.ndarray, c: int) -> np.ndarray:
        return np.where(prefix[c] - prefix[:c] <= limit, prev[:c] + w[:c], inf)
    total = tables(np.where((positions >= 1) & (prefix <= limit) & ends, 0.0, inf), weighted)
    # Walk back from the end: at each step take the earliest predecessor reaching the optimum.
    cuts: List[int] = []
    c = n
    for j in range(k - 1, 0, -1):
        c1 = int(np.argmin(weighted(total[j - 1], c)))
        cuts.append(c1)
        c = c1
    cuts.reverse()
    return cuts, max(stage_costs(costs, cuts))
