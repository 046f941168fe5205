"""Graph passes. A pass is a function ``(GraphModule, example_inputs, Options) -> PassReport``.

Passes run on the dynamo-level graph, before AOTAutograd, so their rewrites are differentiated by
autograd like any other torch code and the backward graph shrinks with the forward.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch.fx

from ..options import Options
from .base import Pass, PassReport
from .label_sparsity import label_sparsity
from .padding_elimination import padding_elimination
from .upstream_slicing import upstream_slicing

# In the order they must run.
# Padding elimination runs last: it keeps the row selections the others inserted, and checks them.
PASSES: List[Pass] = [label_sparsity, upstream_slicing, padding_elimination]


def run_passes(gm: torch.fx.GraphModule, example_inputs: Sequence[object], options: Options) -> Dict[str, str]:
    reports: Dict[str, str] = {}
    changed = False
    for p in PASSES:
        report = p(gm, example_inputs, options)
        reports[report.name] = str(report)
        changed |= report.applied
    if changed:
        gm.graph.lint()
        gm.recompile()
    return reports


__all__ = ["PASSES", "Pass", "PassReport", "run_passes"]
