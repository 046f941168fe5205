"""The plan as a table a person reads (``Pipe.describe``, ``fxtrain split``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, List

if TYPE_CHECKING:
    from .pipe import Pipe


def _si(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}".rstrip()


def _bytes(n: float) -> str:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def describe_plan(pipe: "Pipe", n_microbatches: int = 4) -> str:
    rows = pipe.stage_table()
    total = sum(r["flops"] for r in rows) or 1
    mean = total / len(rows)
    header = f"{'stage':>5}  {'modules':<58} {'params':>10} {'train FLOPs':>12} {'share':>6} {'sends':>5} {'bytes sent':>11}"
    what = "one microbatch" if pipe.example_is_microbatch else "the example batch"
    lines = [f"pipeline plan: {pipe.plan.how}; FLOPs are forward + backward of {what}", pipe.example_text(),
             header, "-" * len(header)]
    for r in rows:
        span = r["first_module"] if r["first_module"] == r["last_module"] else f"{r['first_module']} .. {r['last_module']}"
        if len(span) > 58:
            span = span[:27] + "..." + span[-28:]
        lines.append(f"{r['stage']:>5}  {span:<58} {_si(r['params']):>10} {_si(r['flops'], 'FLOP'):>12} "
                     f"{100 * r['flops'] / total:>5.1f}% {r['sends']:>5} {_bytes(r['send_bytes']) if r['stage'] < len(rows) - 1 else '-':>11}")
    peak = max(r["flops"] for r in rows)
    lines.append(f"balance: max/mean stage FLOPs = {peak / mean:.3f}; parameters total "
                 f"{_si(sum(r['params'] for r in rows))} (shared parameters counted per stage)")
    if pipe.plan.balance != "flops":
        costs = [r["cost"] for r in rows]
        cmean = sum(costs) / len(costs) or 1
        shown = [f"{c * 1e3:.1f} ms" for c in costs] if pipe.plan.balance == "measured" else [_si(c) for c in costs]
        lines.append(f"balanced on {pipe.plan.balance}: " + ", ".join(shown)
                     + f" per stage{' (forward + backward, measured)' if pipe.plan.balance == 'measured' else ''}, "
                       f"max/mean = {max(costs) / cmean:.3f}")
    lines.extend(schedule_lines(pipe, n_microbatches))
    return "\n".join(lines)


def schedule_lines(pipe: "Pipe", m: int) -> List[str]:
    """Per schedule this plan can run: its layout and its simulated bubble beside the textbook one."""
    from .schedules import SCHEDULE_INFO
    n = pipe.num_stages
    source = "measured stage times" if pipe.plan.balance == "measured" else "stage FLOPs"
    lines = [f"schedules for these {n} stages, {m} microbatches (simulated from {source}, free communication):"]
    for name, info in SCHEDULE_INFO.items():
        v = 1 if info.placement == "single" else 2
        if n % v or (v == 2 and n < 4):
            continue
        p = n // v
        layout = f"{p} ranks x {v}" + ("" if info.placement == "single" else f" ({info.placement})")
        try:
            sim = pipe.simulate(name, m, ranks=p)
        except (ValueError, AssertionError) as e:   # torch's own limits (e.g. DualPipeV: m >= stages)
            lines.append(f"  {name:<17} {layout:<18} not simulated: {e}")
            continue
        lines.append(f"  {name:<17} {layout:<18} bubble {sim.bubble_fraction:>5.1%}  textbook "
                     f"{info.bubble(p, v, m):>5.1%} {info.textbook}"
                     + ("; B split into I (input grads) + W (weight grads)" if info.split_backward else ""))
    return lines
