"""Simulated pipeline timeline: when each rank runs each stage's forward and backward pieces.

Compute times are taken proportional to each stage's forward and backward FLOPs and communication
is free, so the bubble this shows is the schedule's own (plus imbalance between stages). A
backward is one action "B", or for the zero-bubble schedules two: "I" (input gradients) and "W"
(weight gradients), in the proportion of the stage's weight-gradient FLOPs. The action orders are
torch's: ScheduleGPipe (all forwards, then all backwards) and Schedule1F1B (``p - 1 - s`` warm-up
forwards on stage ``s``, then one forward / one backward, then the rest) written out here; the
multi-stage schedules' orders are read from torch's own classes (``pipeline_order``), so the
simulation runs exactly the order the runner will. As torch does, the first stage's "I" is empty
(it has no input gradient to send) and its "W" is the whole backward.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Dict, List, Optional, Sequence, Tuple

from ..extras import require
from .schedules import check_layout, placement, schedule_info


@dataclasses.dataclass
class Timeline:
    schedule: str
    n_microbatches: int
    # (rank, stage, kind "F"/"B"/"I"/"W", microbatch, start, end) in FLOP units
    events: List[Tuple[int, int, str, int, float, float]]
    makespan: float
    busy: List[float]               # per rank
    stages: int = 0

    @property
    def ranks(self) -> int:
        return len(self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time over the step."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


Action = Tuple[str, int, int]   # (kind, stage, microbatch)


def action_order(schedule: str, stage: int, stages: int, m: int) -> List[Tuple[str, int]]:
    """One stage's actions under GPipe or 1F1B (one stage per rank)."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"unknown single-stage schedule {schedule!r}")
    warmup = min(m, stages - 1 - stage)
    order = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while f < m:
        order.append(("F", f)); f += 1
        order.append(("B", b)); b += 1
    order.extend(("B", i) for i in range(b, m))
    return order


def rank_orders(schedule: str, stages: int, ranks: int, m: int) -> List[List[Action]]:
    """Every rank's compute actions in the order the schedule runs them (kept per layout: building
    torch's order takes milliseconds, and plan searches simulate one layout many times)."""
    return [list(order) for order in _orders(schedule, stages, ranks, m)]


@functools.lru_cache(maxsize=64)
def _orders(schedule: str, stages: int, ranks: int, m: int) -> Tuple[Tuple[Action, ...], ...]:
    info = schedule_info(schedule)
    if info.placement == "single":
        if stages != ranks:
            raise ValueError(f"{schedule} runs one stage per rank: {stages} stages need {stages} ranks")
        return tuple(tuple((k, s, i) for k, i in action_order(schedule, s, stages, m)) for s in range(stages))
    from ..torch_private import schedule_actions
    return tuple(tuple(order) for order in schedule_actions(info.torch_class, ranks, m, stages // ranks))


def simulate(forward: Sequence[float], backward: Sequence[float], schedule: str, m: int,
             weight: Optional[Sequence[float]] = None, ranks: Optional[int] = None) -> Timeline:
    """``forward[s]``/``backward[s]``: stage ``s``'s time per microbatch; ``weight[s]`` the part of
    its backward that computes weight gradients (default half). ``ranks``: the group size (default
    one rank per stage for GPipe/1F1B, two stages per rank otherwise)."""
    n = len(forward)
    info = schedule_info(schedule)
    if ranks is None:
        ranks = n if info.placement == "single" else max(1, n // 2)
    check_layout(schedule, n, ranks)
    # Avoid zero-length actions (a stage with no counted FLOPs still takes some time).
    # (A thousandth of the largest action: costs may be FLOPs or seconds.)
    scale = max(max(forward), max(backward))
    eps = 1e-3 * scale if scale > 0 else 1e-3
    fwd = [max(f, eps) for f in forward]
    bwd = [max(b, eps) for b in backward]
    wgt = [min(max(w, 0.0), b) for w, b in zip(weight or [b / 2 for b in bwd], bwd)]
    where = placement(n, ranks, info.placement)
    orders = rank_orders(schedule, n, ranks, m)

    def duration(kind: str, s: int) -> float:
        if kind == "F":
            return fwd[s]
        if kind == "B":
            return bwd[s]
        if s == 0:   # torch runs the first stage's whole backward as its W
            return 0.0 if kind == "I" else bwd[s]
        return bwd[s] - wgt[s] if kind == "I" else wgt[s]

    def ready(kind: str, s: int, i: int) -> Optional[float]:
        if kind == "F":
            return done.get(("F", s - 1, i)) if s > 0 else 0.0
        if kind == "W":
            return done.get(("I", s, i))
        own = done.get(("F", s, i))
        if own is None or s == n - 1:
            return own
        after = done.get(("B", s + 1, i), done.get(("I", s + 1, i)))
        return None if after is None else max(own, after)

    done: Dict[Tuple[str, int, int], float] = {}
    pos = [0] * ranks
    clock = [0.0] * ranks
    busy = [0.0] * ranks
    events = []
    progress = True
    while progress:
        progress = False
        for r in range(ranks):
            while pos[r] < len(orders[r]):
                kind, s, i = orders[r][pos[r]]
                if where[s] != r:
                    raise RuntimeError(f"{schedule}: stage {s} runs on rank {r}, placed on rank {where[s]}")
                dep = ready(kind, s, i)
                if dep is None:
                    break
                start = max(clock[r], dep)
                end = start + duration(kind, s)
                done[(kind, s, i)] = end
                clock[r] = end
                busy[r] += end - start
                events.append((r, s, kind, i, start, end))
                pos[r] += 1
                progress = True
    if any(pos[r] < len(orders[r]) for r in range(ranks)):
        raise RuntimeError("schedule simulation deadlocked")
    return Timeline(schedule, m, events, max(clock), busy, n)


def measured(schedule: str, n_microbatches: int, actions: Sequence[Sequence[Tuple[int, str, int, float, float]]],
             stats: Sequence[Dict[str, float]], stages: int) -> Timeline:
    """A Timeline of what ran: ``actions[r]`` and ``stats[r]`` are rank r's ``runner.last_actions``
    and ``runner.last_stats``. Ranks' times are aligned on their step starts (``perf_counter``, one
    clock for all processes of a Linux machine)."""
    origin = min(st["step_start"] for st in stats)
    shift = [st["step_start"] - origin for st in stats]
    events = [(r, s, kind, i, a + shift[r], b + shift[r]) for r, acts in enumerate(actions) for s, kind, i, a, b in acts]
    busy = [sum(b - a for _, _, _, a, b in acts) for acts in actions]
    makespan = max(st["step_time"] + d for st, d in zip(stats, shift))
    return Timeline(schedule, n_microbatches, events, makespan, busy, stages)


def idle_breakdown(timeline: Timeline) -> Dict[str, float]:
    """Where the ranks' idle time went, as shares of all ranks' time (they add up to the bubble).

    "schedule": waiting for a dependency's compute to finish on another rank (the schedule's own
    bubble, imbalance included); "transfer": from the moment an action could start (its inputs
    computed, the rank free) to its start: sending and receiving the activation or gradient and
    the scheduler's own dispatch; "after": from the rank's last action to the end of its step:
    the all-reduce of parameters shared across ranks and waiting for the last sends."""
    n = timeline.stages
    done = {(kind, s, i): b for _, s, kind, i, _, b in timeline.events}
    wait = transfer = after = 0.0
    ranks = timeline.ranks
    last = [0.0] * ranks
    for r, s, kind, i, a, b in sorted(timeline.events, key=lambda e: e[4]):
        if kind == "F":
            dep = done.get(("F", s - 1, i), 0.0) if s > 0 else 0.0
        elif kind == "W":
            dep = done.get(("I", s, i), 0.0)
        else:
            dep = done.get(("F", s, i), 0.0)
            if s < n - 1:
                dep = max(dep, done.get(("B", s + 1, i), done.get(("I", s + 1, i), 0.0)))
        wait += max(0.0, min(dep, a) - last[r])
        transfer += max(0.0, a - max(dep, last[r]))
        last[r] = b
    after = sum(max(0.0, timeline.makespan - t) for t in last)
    total = ranks * timeline.makespan or 1.0
    return {"schedule": wait / total, "transfer": transfer / total, "after": after / total}


def action_times(timeline: Timeline) -> Tuple[List[float], List[float], List[float]]:
    """Per stage, the median forward, backward (B, or I + W) and weight-gradient (W) time of a
    measured timeline: what ``simulate`` needs to replay the schedule with the real compute times."""
    import statistics
    n = timeline.stages
    per: Dict[Tuple[int, str], List[float]] = {}
    for _, s, kind, _, a, b in timeline.events:
        per.setdefault((s, kind), []).append(b - a)

    def med(s: int, kind: str) -> float:
        return statistics.median(per[(s, kind)]) if (s, kind) in per else 0.0
    fwd = [med(s, "F") for s in range(n)]
    wgt = [med(s, "W") for s in range(n)]
    bwd = [med(s, "B") or med(s, "I") + med(s, "W") for s in range(n)]
    return fwd, bwd, wgt


COLORS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}


def plot(timeline: Timeline, path: str, title: str = "simulated") -> str:
    matplotlib = require("matplotlib", "the pipeline timeline plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = timeline.ranks
    fig, ax = plt.subplots(figsize=(12, 0.7 * p + 1.6))
    scale = timeline.makespan or 1.0
    several = timeline.stages > p
    for r, s, kind, i, start, end in timeline.events:
        if end <= start:
            continue
        ax.broken_barh([(start / scale, (end - start) / scale)], (r - 0.4, 0.8), facecolors=COLORS[kind],
                       edgecolor="white", alpha=1.0 if not several or s < timeline.stages // 2 else 0.7)
        label = f"{kind}{i}" + (f"\ns{s}" if several else "")
        ax.text((start + end) / 2 / scale, r, label, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("time (fraction of the step); F forward, B backward, I input grads, W weight grads")
    ax.set_title(f"{timeline.schedule}, {timeline.stages} stages on {p} ranks, {timeline.n_microbatches} "
                 f"microbatches: {title} bubble {timeline.bubble_fraction:.1%}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
