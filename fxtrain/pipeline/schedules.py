"""The schedules ``Pipe.build`` accepts, where each puts its stages, and their textbook bubbles.

Every schedule is torch's own class (``runner.SCHEDULES``); this module holds what fxtrain needs
to know about each without importing ``torch.distributed`` (describe, simulate, plot):

- placement: "single" (one stage per rank: GPipe, 1F1B), "loop" (stage s on rank s mod p:
  interleaved 1F1B and interleaved zero bubble) or "v" (rank r holds stages r and 2p-1-r, so the
  first and the last stage share rank 0: ZBV, DualPipeV). These are torch's own mappings
  (``generate_stage_to_rank_mapping``, styles "loop" and "v"); the tests check they agree.
- whether the schedule splits each backward into B (input gradients) and W (weight gradients);
- the textbook bubble (idle share of the step with uniform stages and free communication).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List


@dataclasses.dataclass(frozen=True)
class ScheduleInfo:
    name: str
    torch_class: str
    placement: str                 # "single" | "loop" | "v"
    split_backward: bool           # backward run as B then W
    textbook: str                  # the bubble formula, as text
    bubble: Callable[[int, int, int], float]   # (p ranks, v stages per rank, m microbatches) -> idle share

    def stages_per_rank_ok(self, v: int) -> bool:
        return v == 1 if self.placement == "single" else v == 2 if self.placement == "v" else v >= 1


def _classic(p: int, v: int, m: int) -> float:
    return (p - 1) / (m + p - 1)


def _interleaved(p: int, v: int, m: int) -> float:
    return (p - 1) / (v * m + p - 1)


def _zb1p(p: int, v: int, m: int) -> float:
    # ZB-H1 (Qi et al. 2023): (p-1)(F+B-W) idle per rank, against m(F+B+W) of work; F = B = W.
    return (p - 1) / (3 * m)


def _zero(p: int, v: int, m: int) -> float:
    return 0.0


SCHEDULE_INFO: Dict[str, ScheduleInfo] = {s.name: s for s in (
    ScheduleInfo("gpipe", "ScheduleGPipe", "single", False, "((p-1)/(m+p-1))", _classic),
    ScheduleInfo("1f1b", "Schedule1F1B", "single", False, "((p-1)/(m+p-1))", _classic),
    ScheduleInfo("interleaved-1f1b", "ScheduleInterleaved1F1B", "loop", False, "((p-1)/(v*m+p-1))", _interleaved),
    ScheduleInfo("zb1p", "ScheduleInterleavedZeroBubble", "loop", True, "((p-1)/(3m), ZB-H1)", _zb1p),
    ScheduleInfo("zbv", "ScheduleZBVZeroBubble", "v", True, "(0 with F=B=W, m >= 2p)", _zero),
    ScheduleInfo("dualpipev", "ScheduleDualPipeV", "v", True, "(0 with F=B=W, m >= 2p)", _zero),
)}


def schedule_info(name: str) -> ScheduleInfo:
    try:
        return SCHEDULE_INFO[name]
    except KeyError:
        raise ValueError(f"schedule must be one of {list(SCHEDULE_INFO)}, got {name!r}") from None


def placement(num_stages: int, ranks: int, style: str) -> List[int]:
    """The rank (position in the pipeline group) of every stage."""
    if num_stages % ranks:
        raise ValueError(f"{num_stages} stages cannot be spread evenly over {ranks} ranks")
    if style in ("single", "loop"):
        return [s % ranks for s in range(num_stages)]
    if style != "v":
        raise ValueError(f"unknown placement {style!r}")
    out = []
    for s in range(num_stages):
        lap, pos = divmod(s, ranks)
        out.append(pos if lap % 2 == 0 else ranks - 1 - pos)
    return out


def check_layout(name: str, num_stages: int, ranks: int) -> int:
    """Stages per rank for ``name`` with this many stages and ranks, or a ValueError saying what fits."""
    info = schedule_info(name)
    if num_stages % ranks:
        raise ValueError(f"the plan has {num_stages} stages, which {ranks} ranks cannot share evenly: split "
                         f"with num_stages a multiple of the group size ({ranks})")
    v = num_stages // ranks
    if not info.stages_per_rank_ok(v):
        need = {"single": f"one stage per rank (num_stages = {ranks})",
                "v": f"two stages per rank (num_stages = {2 * ranks})"}[info.placement]
        others = [n for n, i in SCHEDULE_INFO.items() if i.stages_per_rank_ok(v)]
        raise ValueError(f"schedule {name!r} runs {need}; the plan has {num_stages} stages on {ranks} ranks "
                         f"({v} per rank), which {', '.join(others) or 'no schedule'} can run")
    return v
