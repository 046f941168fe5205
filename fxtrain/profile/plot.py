"""The report as a picture: where the FLOPs and saved bytes go per module, and memory over the step."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

from ..extras import require

_PHASE_COLOURS = {"start": "#7f7f7f", "forward": "#1f77b4", "backward": "#d62728", "optimizer": "#2ca02c",
                  "end": "#7f7f7f"}


def _unit(top: float, base: int, names: tuple) -> tuple:
    scale, i = 1, 0
    while top / scale >= base and i < len(names) - 1:
        scale *= base
        i += 1
    return scale, names[i]


def plot_report(path: str, title: str, group: Callable[[int], Dict[str, Any]], timeline: List[Tuple[str, int]],
                peak_bytes: int, rows: int = 16) -> str:
    """Write a PNG to ``path``: per-module bars (left) and the live-bytes timeline (right).

    ``group(depth)``: the costs per module at that depth (``ProfileReport.group``); the report
    passes what is drawn, so that this view does not import the report that calls it."""
    matplotlib = require("matplotlib", "ProfileReport.plot")   # optional: everything else works without it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depth = 1
    while depth < 12 and len(group(depth + 1)) <= rows and len(group(depth + 1)) > len(group(depth)):
        depth += 1
    grouped = sorted(group(depth).items(), key=lambda kv: kv[1].flops_forward + kv[1].flops_backward)
    grouped = [(n or "(root)", c) for n, c in grouped if c.flops_forward + c.flops_backward or c.saved_bytes][-rows:]

    fig, (bars, line) = plt.subplots(1, 2, figsize=(15, max(4.0, 0.35 * len(grouped) + 1.5)))
    names = [n for n, _ in grouped]
    top = max([c.flops_forward + c.flops_backward for _, c in grouped] + [1])
    scale, unit = _unit(top, 1000, ("FLOPs", "KFLOPs", "MFLOPs", "GFLOPs", "TFLOPs", "PFLOPs", "EFLOPs"))
    fwd = [c.flops_forward / scale for _, c in grouped]
    bwd = [c.flops_backward / scale for _, c in grouped]
    ys = range(len(names))
    bars.barh(ys, fwd, color=_PHASE_COLOURS["forward"], label="forward")
    bars.barh(ys, bwd, left=fwd, color=_PHASE_COLOURS["backward"], label="backward")
    bars.set_yticks(list(ys))
    bars.set_yticklabels(names, fontsize=8)
    bars.set_xlabel(unit)
    bars.set_title(title)
    bars.legend(loc="lower right", fontsize=8)

    points = timeline
    gib, mem_unit = _unit(max([b for _, b in points] + [peak_bytes, 1]), 1024,
                          ("B", "KiB", "MiB", "GiB", "TiB", "PiB"))
    xs = list(range(len(points)))
    for phase, colour in _PHASE_COLOURS.items():
        sel = [(x, b / gib) for x, (p, b) in zip(xs, points) if p == phase]
        if sel:
            line.plot([x for x, _ in sel], [y for _, y in sel], ".", ms=2, color=colour, label=phase)
    line.plot(xs, [b / gib for _, b in points], "-", lw=0.6, color="black", alpha=0.4)
    line.axhline(peak_bytes / gib, color="black", ls="--", lw=0.8,
                 label=f"peak {peak_bytes / gib:.4g} {mem_unit}")
    line.set_xlabel("allocation events over the step")
    line.set_ylabel(f"live tensor {mem_unit}")
    line.set_title("memory over one training step")
    line.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
