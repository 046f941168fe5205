"""Simulated pipeline timeline: when each stage runs each microbatch's forward and backward.

Compute times are taken proportional to each stage's forward and backward FLOPs and communication
is free, so the bubble this shows is the schedule's own (plus imbalance between stages). The action
orders are those of torch's ScheduleGPipe (all forwards, then all backwards) and Schedule1F1B
(``p - 1 - s`` warm-up forwards on stage ``s``, then one forward / one backward, then the rest).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple


@dataclasses.dataclass
class Timeline:
    schedule: str
    n_microbatches: int
    # (stage, kind "F"/"B", microbatch, start, end) in FLOP units
    events: List[Tuple[int, str, int, float, float]]
    makespan: float
    busy: List[float]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all stages' time over the step."""
        if not self.makespan:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def action_order(schedule: str, stage: int, stages: int, m: int) -> List[Tuple[str, int]]:
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"unknown schedule {schedule!r}")
    warmup = min(m, stages - 1 - stage)
    order = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while f < m:
        order.append(("F", f)); f += 1
        order.append(("B", b)); b += 1
    order.extend(("B", i) for i in range(b, m))
    return order


def simulate(forward: Sequence[float], backward: Sequence[float], schedule: str, m: int) -> Timeline:
    p = len(forward)
    # Avoid zero-length actions (a stage with no counted FLOPs still takes some time).
    eps = 1e-3 * max(max(forward), max(backward), 1.0)
    fwd = [max(f, eps) for f in forward]
    bwd = [max(b, eps) for b in backward]
    orders = [action_order(schedule, s, p, m) for s in range(p)]
    done: Dict[Tuple[int, str, int], float] = {}
    pos = [0] * p
    clock = [0.0] * p
    events = []
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                if kind == "F":
                    dep = done.get((s - 1, "F", i)) if s > 0 else 0.0
                else:
                    dep = done.get((s + 1, "B", i)) if s < p - 1 else done.get((s, "F", i))
                if dep is None:
                    break
                start = max(clock[s], dep)
                end = start + (fwd[s] if kind == "F" else bwd[s])
                done[(s, kind, i)] = end
                clock[s] = end
                events.append((s, kind, i, start, end))
                pos[s] += 1
                progress = True
    if any(pos[s] < len(orders[s]) for s in range(p)):
        raise RuntimeError("schedule simulation deadlocked")
    busy = [m * (fwd[s] + bwd[s]) for s in range(p)]
    return Timeline(schedule, m, events, max(clock), busy)


def plot(timeline: Timeline, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = len(timeline.busy)
    fig, ax = plt.subplots(figsize=(10, 0.6 * p + 1.5))
    scale = timeline.makespan or 1.0
    for s, kind, i, start, end in timeline.events:
        color = "#4c72b0" if kind == "F" else "#dd8452"
        ax.broken_barh([(start / scale, (end - start) / scale)], (s - 0.4, 0.8), facecolors=color, edgecolor="white")
        ax.text((start + end) / 2 / scale, s, f"{kind}{i}", ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {s}" for s in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("time (fraction of the simulated step)")
    ax.set_title(f"{timeline.schedule}, {timeline.n_microbatches} microbatches: "
                 f"simulated bubble {timeline.bubble_fraction:.1%}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
