"""``balance="measured"``: cut where the stages' measured times, not counted costs, are equal.

Why: a pipeline's bubble follows the stages' real times, and every counted cost misses by a
factor that differs per stage. On BERT-MLM, stages that ``sparse_flops`` called equal ran
21 / 16 / 25 / 27 ms per microbatch (forward + backward): CPU attention with a mask and dropout
runs at half a linear layer's rate, the label-sparse decoder streams its whole 31 MB weight for
38 rows, the embedding's gradient is all memory traffic. ZB1P pays the difference as waiting.
Timing nodes one by one does not fix it either (tried: each op alone, cache-hot and in eager
kernels, predicted half of the stage times, and the label-sparse decoder does not scale with
its rows).

So whole stages are timed, as they will run. Each round times a plan, fits per-node costs to
every stage time measured so far (``_Costs.fit``: one factor per segment between the cuts seen,
least squares; forward, backward and weight part apart), cuts again, and stops when a plan
repeats or after ``ROUNDS``; the plan kept is one that was timed, chosen on its measured times
(never an extrapolation). The start is the min-max plan on ``time`` (FLOP-equivalents).

Two ways to time a plan: at ``split`` (no schedule, no process group) ``time_stages`` runs the
stages as the ``TrainModule``s the runner builds, chained in one process, and the plan minimises
the slowest stage; at ``build`` the runner times each candidate as the pipeline itself
(``runner.time_in_pipeline``) on every rank of the group at once (``GroupTimer``: the first rank
decides, times are averaged), and the plan minimises the schedule's simulated step
(``search_cuts``). Timing leaves parameters' gradients as they were and restores the random
state, so training starts as if nothing ran.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .partition import min_max_partition
from ..errors import Error

logger = logging.getLogger("fxtrain")

ROUNDS = 4
WARMUP = 2
REPEATS = 5

StageTimes = List[Tuple[float, float, float]]   # per stage: (forward, backward, its weight part) seconds per call


def _sync(values: Sequence[torch.Tensor]) -> None:
    """Wait for queued device work (nothing to wait for on a host tensor)."""
    for t in values:
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            torch.accelerator.synchronize(t.device)
            return


def time_stages(modules: Sequence[torch.nn.Module], first_inputs: Sequence[torch.Tensor],
                params: Sequence[torch.Tensor], warmup: int = WARMUP, repeats: int = REPEATS,
                before: Optional[Callable[[], None]] = None, split: bool = False) -> StageTimes:
    """Median forward, backward and weight-gradient seconds of each stage, the stages run as a
    chain on one process.

    ``modules[s]`` takes stage ``s``'s inputs and returns what it sends on (the loss for the last);
    its inputs are ``first_inputs`` for the first, the previous stage's outputs otherwise.
    ``split``: run each backward as the zero-bubble schedules do, input gradients first with the
    weight gradients deferred, then those (``runtime.weight_split``); the backward time is their
    sum and the weight part is timed on its own (0 without ``split``).
    ``before`` runs after the warm-up (which compiles) and before the timed runs: a barrier, so
    that the ranks of a pipeline time together, under the load they will train under."""
    saved = [p.grad for p in params]
    devices = sorted({t.device for t in first_inputs if t.device.type != "cpu"}, key=str)
    samples: List[StageTimes] = []
    try:
        with torch.random.fork_rng(devices=devices, device_type=devices[0].type if devices else "cuda"):
            for step in range(warmup + repeats):
                if step == warmup and before is not None:
                    before()
                samples.append(_chain(modules, first_inputs, split))
                if step < warmup:
                    samples.pop()
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    return [tuple(statistics.median(s[i][part] for s in samples) for part in range(3))  # type: ignore[misc]
            for i in range(len(modules))]


def _chain(modules: Sequence[torch.nn.Module], first_inputs: Sequence[torch.Tensor], split: bool) -> StageTimes:
    from ..runtime.weight_split import defer_weight_gradients
    xs: List[torch.Tensor] = list(first_inputs)
    received: List[List[torch.Tensor]] = []
    sent: List[List[torch.Tensor]] = []
    forward: List[float] = []
    for mod in modules:
        xs = [x.detach().requires_grad_(x.is_floating_point() or x.is_complex()) for x in xs]
        received.append(xs)
        _sync(xs)
        start = time.perf_counter()
        out = mod(*xs)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        _sync(outs)
        forward.append(time.perf_counter() - start)
        sent.append(outs)
        xs = outs
    backward = [0.0] * len(modules)
    weight = [0.0] * len(modules)
    grads: Optional[List[Optional[torch.Tensor]]] = None
    for s in reversed(range(len(modules))):
        if grads is None:
            pairs = [(o, None) for o in sent[s][:1]]
        else:
            pairs = [(o, g) for o, g in zip(sent[s], grads) if g is not None and o.requires_grad]
        tensors = [o for o, _ in pairs]
        given = [g for _, g in pairs] if grads is not None else None
        start = time.perf_counter()
        if split:
            with defer_weight_gradients(list(modules[s].parameters())) as pending:
                if pairs:
                    torch.autograd.backward(tensors, given)
            _sync(tensors)
            middle = time.perf_counter()
            pending.run()
            _sync(tensors)
            weight[s] = time.perf_counter() - middle
        elif pairs:
            torch.autograd.backward(tensors, given)
            _sync(tensors)
        backward[s] = time.perf_counter() - start
        grads = [x.grad if x.requires_grad else None for x in received[s]]
    return list(zip(forward, backward, weight))


class _Costs:
    """Forward, backward and weight-gradient (part of backward) cost per position."""

    def __init__(self, forward: Sequence[float], backward: Sequence[float], weight: Sequence[float]) -> None:
        self.forward, self.backward, self.weight = list(forward), list(backward), list(weight)

    def stages(self, cuts: Sequence[int]) -> Tuple[List[float], List[float], List[float]]:
        bounds = [0] + list(cuts) + [len(self.forward)]
        spans = list(zip(bounds, bounds[1:]))
        return tuple([sum(part[a:b]) for a, b in spans]  # type: ignore[return-value]
                     for part in (self.forward, self.backward, self.weight))

    def total(self) -> List[float]:
        return [f + b for f, b in zip(self.forward, self.backward)]

    def fit(self, counted: "_Costs", timed: Dict[Tuple[int, ...], StageTimes]) -> None:
        """Costs that reproduce every stage time measured so far: ``counted`` times one factor per
        segment between the cut positions seen, by least squares over all timed plans (relative
        errors), pulled weakly toward the plans' overall factor where the timings leave a segment
        undetermined. Forward, backward and weight parts get factors of their own (the weight
        part only from timings that measured it).

        Scaling only the last plan's stages would forget earlier timings: a stage that moved
        carries its old neighbour's factor, and the search goes in circles."""
        n = len(self.forward)
        edges = sorted({0, n} | {c for cuts in timed for c in cuts})
        spans = list(zip(edges, edges[1:]))
        parts = ((self.forward, counted.forward), (self.backward, counted.backward), (self.weight, counted.weight))
        for part, (mine, base) in enumerate(parts):
            seg = np.array([sum(base[a:b]) for a, b in spans])
            rows, rhs = [], []
            for cuts, times in timed.items():
                bounds = [0] + list(cuts) + [n]
                for (a, b), t in zip(zip(bounds, bounds[1:]), times):
                    value = t[part]
                    row = np.array([seg[j] if a <= lo and hi <= b else 0.0 for j, (lo, hi) in enumerate(spans)])
                    if value > 0 and row.any():
                        rows.append(row / value)
                        rhs.append(1.0)
            if not rows:
                continue
            A, y = np.array(rows), np.array(rhs)
            ones = A @ np.ones(len(spans))
            overall = float(np.sum(y * ones) / max(float(np.sum(ones ** 2)), 1e-30))
            weak = 1e-3
            A = np.vstack([A, weak * np.eye(len(spans))])
            y = np.concatenate([y, weak * overall * np.ones(len(spans))])
            factor = np.clip(np.linalg.lstsq(A, y, rcond=None)[0], 0.0, None)
            for (a, b), f in zip(spans, factor):
                mine[a:b] = [c * float(f) for c in base[a:b]]
        self.weight = [min(w, b) for w, b in zip(self.weight, self.backward)]


@dataclasses.dataclass(frozen=True)
class Target:
    """The schedule a plan is for: its simulated step is what the plan minimises."""

    schedule: str
    n_microbatches: int
    ranks: int
    group: Any = None    # the pipeline's process group: its ranks time each plan together
    #: how the group times a plan (``runner.time_in_pipeline``: as the pipeline itself); None:
    #: the stages as a chain in each process
    time_cuts: Optional[Callable[[List[int], Callable[[], None]], StageTimes]] = None

    @property
    def split(self) -> bool:
        """Whether the schedule splits each backward into input and weight gradients."""
        from .schedules import schedule_info
        return schedule_info(self.schedule).split_backward

    def step(self, fwd: Sequence[float], bwd: Sequence[float], wgt: Sequence[float]) -> float:
        from .timeline import simulate
        return simulate(fwd, bwd, self.schedule, self.n_microbatches, weight=wgt, ranks=self.ranks).makespan


EXHAUSTIVE = 400_000   # cut sets scored by their lower bound; past it, descent from the seeds


def search_cuts(costs: _Costs, k: int, target: Target, seeds: Sequence[Sequence[int]],
                allowed: Optional[Sequence[bool]] = None) -> List[int]:
    """Cuts whose simulated step under ``target`` is shortest.

    Min-max is the wrong objective once a rank holds several stages or one stage cannot shrink
    (BERT-MLM's decoder alone outweighs a quarter of the model): it leaves the other stages
    anywhere below the largest, and the schedule pays for the uneven ones. The simulated step is
    the right objective but has no structure to exploit. Every cut set has a lower bound, the
    busiest rank's load times the microbatches (a rank runs its actions one at a time), cheap to
    compute for all of them at once; cut sets are simulated in the order of that bound until the
    bound reaches the best step found, which makes the result the optimum. With too many cut sets
    (many stages), one cut at a time moves from each seed while the step shortens (a local optimum).
    """
    from .schedules import placement, schedule_info
    n = len(costs.forward)
    ok = [c for c in range(1, n) if allowed is None or allowed[c]]
    memo: Dict[Tuple[int, ...], float] = {}

    def score(cuts: Tuple[int, ...]) -> float:
        if cuts not in memo:
            memo[cuts] = target.step(*costs.stages(cuts))
        return memo[cuts]

    best = min((tuple(sd) for sd in seeds), key=score)
    if k == 1:
        return []
    if math.comb(len(ok), k - 1) <= EXHAUSTIVE:
        where = placement(k, target.ranks, schedule_info(target.schedule).placement)
        sets = np.array(list(itertools.combinations(ok, k - 1)), dtype=np.int64).reshape(-1, k - 1)
        prefix = np.concatenate([[0.0], np.cumsum(costs.total())])
        edges = np.concatenate([np.zeros((len(sets), 1), dtype=np.int64), sets,
                                np.full((len(sets), 1), n, dtype=np.int64)], axis=1)
        loads = np.zeros((len(sets), target.ranks))
        for st in range(k):
            loads[:, where[st]] += prefix[edges[:, st + 1]] - prefix[edges[:, st]]
        bound = loads.max(axis=1) * target.n_microbatches
        for idx in np.argsort(bound, kind="stable"):
            if bound[idx] >= score(best) * (1 - 1e-9):
                break
            cand = tuple(int(c) for c in sets[idx])
            if score(cand) < score(best):
                best = cand
        return list(best)
    for seed in seeds:
        cur = tuple(seed)
        while True:
            moves = []
            for j in range(k - 1):
                lo = cur[j - 1] if j else 0
                hi = cur[j + 1] if j + 1 < k - 1 else n
                moves.extend(cur[:j] + (c,) + cur[j + 1:] for c in ok if lo < c < hi and c != cur[j])
            nxt = min(moves, key=score, default=cur)
            if score(nxt) >= score(cur) * (1 - 1e-9):
                break
            cur = nxt
        if score(cur) < score(best):
            best = cur
    return list(best)


def calibrate(costs: Sequence[float], k: int, measure: Callable[[List[int]], StageTimes], *,
              forward_share: Sequence[float], weight_share: Sequence[float],
              allowed: Optional[Sequence[bool]] = None, cut_weights: Optional[Sequence[float]] = None,
              target: Optional[Target] = None, rounds: int = ROUNDS) -> Tuple[List[int], StageTimes, int]:
    """Cuts for ``k`` stages from measured stage times, starting from ``costs`` per position.

    ``forward_share[i]``: the part of position ``i``'s cost that is forward (the rest backward),
    ``weight_share[i]`` the part of its backward that computes weight gradients. Without a
    ``target`` the plan minimises the slowest stage; with one, the target's simulated step.
    ``measure(cuts)`` times a plan's stages. Returns (cuts, the chosen plan's stage times, how
    many plans were timed): the chosen plan is one that was timed, scored on its measured times."""
    n = len(costs)
    total = float(sum(costs)) or 1.0
    # Every position carries a little cost, so a stage of nodes the count prices at zero still
    # takes its measured share when it is scaled.
    base = [float(c) + 1e-6 * total / max(n, 1) for c in costs]
    backward = [c * (1 - f) for c, f in zip(base, forward_share)]
    counted = _Costs([c * f for c, f in zip(base, forward_share)], backward,
                     [b * w for b, w in zip(backward, weight_share)])
    model = _Costs(counted.forward, counted.backward, counted.weight)
    timed: Dict[Tuple[int, ...], StageTimes] = {}

    def measured_score(cuts: Tuple[int, ...]) -> float:
        times = timed[cuts]
        if target is None:
            return max(f + b for f, b, _ in times)
        # The weight part as measured, else in the proportion the fitted costs give.
        _, bwd, wgt = model.stages(cuts)
        weights = [w if w > 0 else (b * fw / fb if fb > 0 else 0.0) for (_, b, w), fb, fw in zip(times, bwd, wgt)]
        return target.step([f for f, _, _ in times], [b for _, b, _ in times], weights)

    for _ in range(max(1, rounds)):
        cuts, _ = min_max_partition(model.total(), k, allowed=allowed, cut_weights=cut_weights)
        if target is not None:
            cuts = search_cuts(model, k, target, [cuts] + [list(c) for c in timed], allowed)
        key = tuple(cuts)
        if key in timed:
            break
        timed[key] = measure(list(cuts))
        model.fit(counted, timed)
        logger.info("fxtrain.split balance='measured': cuts %s, stage times F/B/W (ms) %s", list(cuts),
                    ", ".join(f"{f * 1e3:.1f}/{b * 1e3:.1f}/{w * 1e3:.1f}" for f, b, w in timed[key]))
    best = min(timed, key=measured_score)
    return list(best), timed[best], len(timed)


class PlanningFailed(Error, RuntimeError):
    """The first rank of the group failed to make the measured plan (its error in the message)."""


class GroupTimer:
    """Plans timed on every rank of a pipeline group at once; the group's first rank decides.

    Each rank times on its own, and one rank's timing is not another's: run alone, a rank sees a
    quiet machine that training will not give it (its peers compute at the same time), and two
    ranks planning apart can choose different cuts. So the first rank runs the calibration and
    sends each plan it wants timed; every rank builds and times that plan, after a barrier, at
    the same time; the times are averaged over the group, and the first rank sends the final plan.
    A failure on the first rank is sent too, so the others raise instead of waiting."""

    def __init__(self, group: Any, time_cuts: Callable[[List[int], Callable[[], None]], StageTimes],
                 device: torch.device) -> None:
        import torch.distributed as dist
        self.dist, self.group, self.device = dist, group, device
        self.src = dist.get_process_group_ranks(group)[0]
        self.time_cuts = time_cuts

    @property
    def leads(self) -> bool:
        return self.dist.get_rank() == self.src

    def _send(self, message: Any) -> Any:
        box = [message]
        self.dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def _time(self, cuts: List[int]) -> StageTimes:
        local = self.time_cuts(cuts, lambda: self.dist.barrier(group=self.group))
        t = torch.tensor(local, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, group=self.group)
        t /= self.dist.get_world_size(self.group)
        return [(float(f), float(b), float(w)) for f, b, w in t.tolist()]

    def measure(self, cuts: List[int]) -> StageTimes:
        """(first rank) Have every rank time ``cuts``; their mean times."""
        self._send(("time", list(cuts)))
        return self._time(list(cuts))

    def finish(self, result: Any) -> Any:
        """(first rank) Send the final plan to the others."""
        return self._send(("done", result))[1]

    def fail(self, error: BaseException) -> None:
        """(first rank) Tell the others that planning failed."""
        self._send(("error", f"{type(error).__name__}: {error}"))

    def follow(self) -> Any:
        """(other ranks) Time what the first rank asks for until it sends the final plan."""
        while True:
            kind, payload = self._send(None)
            if kind == "time":
                self._time(payload)
            elif kind == "done":
                return payload
            else:
                raise PlanningFailed(f"balance='measured': planning failed on the first rank of the group: {payload}")
