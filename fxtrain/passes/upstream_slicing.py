"""Upstream slicing: compute only the rows a model keeps (``h[:, 0]`` of a classifier head).

A sequence classifier reads one token per sequence from the last layer, yet eager PyTorch runs that
layer's FFN, LayerNorms and attention output projection for every token. The select is moved above
every op that computes a row from the same row alone (``rows.find_region``), so those ops run on
``batch`` rows instead of ``batch x seq``. Values are eager's: the same ops on the same rows.
"""
from __future__ import annotations

import operator
from typing import List, Optional, Tuple

import torch
import torch.fx

from ..options import Options
from ..runtime.step import PassReport, Plans
from .defer import can_defer, defer_outputs
from .density import ExampleSource, density_reason
from .rows import erase_dead, find_region, flops_at_capture, replay_on_rows, value

NAME = "upstream_slicing"


def _row_select(node: torch.fx.Node) -> Optional[Tuple[int, tuple]]:
    """(d, index) when ``node`` is ``x[:, ..., j, ...]``: one integer on dim d, full slices elsewhere."""
    if node.op != "call_function" or node.target is not operator.getitem or not isinstance(node.args[0], torch.fx.Node):
        return None
    x, index = value(node.args[0]), node.args[1]
    if not isinstance(x, torch.Tensor) or not isinstance(index, tuple):
        return None
    ints = [i for i, item in enumerate(index) if isinstance(item, int) and not isinstance(item, bool)]
    full = all(isinstance(item, slice) and item == slice(None) for i, item in enumerate(index) if i not in ints)
    if len(ints) != 1 or not full or ints[0] >= x.dim() - 1:
        return None  # the kept rows must leave at least one feature dim whole
    return ints[0], index


def _kept_fraction(x: torch.Tensor, d: int) -> Optional[float]:
    size = x.shape[d]
    # The capturing batch's size, read without int(): that would guard on it and recapture per length.
    hint = size.node.hint if isinstance(size, torch.SymInt) else size
    return None if hint is None else 1.0 / max(int(hint), 1)


def upstream_slicing(gm: torch.fx.GraphModule, examples: ExampleSource, options: Options,
                     plans: Plans) -> PassReport:
    if options.upstream_slicing == "off":
        return PassReport(NAME, False, "off by option")
    reasons: List[str] = []
    applied = False
    saved: Optional[int] = 0
    for node in list(gm.graph.nodes):
        found = _row_select(node)
        if found is None:
            continue
        d, index = found
        x = node.args[0]
        kept = _kept_fraction(value(x), d)
        ok, why = density_reason("kept row fraction", kept, options.upstream_slicing, options.sparsity_threshold)
        if ok:
            region = find_region(gm, x, d + 1, {node}, regroup=False)
            if not region.heavy_ops():
                continue  # nothing costly computes these rows: not worth a report line
            blocked = can_defer(gm, plans, region)
            if blocked:
                ok, why = False, blocked
            else:
                def select(graph: torch.fx.Graph, f: torch.fx.Node, lead: int, index: tuple = index) -> torch.fx.Node:
                    return graph.call_function(operator.getitem, (f, index))
                flops = sum(flops_at_capture(n) for n in region.lead)
                saved = None if saved is None or kept is None else saved + round(flops * (1 - kept))
                rows = replay_on_rows(gm, region, select, insert_before=node)
                node.replace_all_uses_with(rows[x])
                if region.outputs:
                    defer_outputs(gm, plans, region)
                erase_dead(gm, [node] + list(region.lead))
                why = f"{why}: {region.heavy_ops()} matmul(s) run on the kept rows only"
        applied |= ok
        reasons.append(why)
    if not reasons:
        return PassReport(NAME, False, "no row selection with row-wise work above it")
    return PassReport(NAME, applied, "; ".join(reasons), saved_flops=saved)
