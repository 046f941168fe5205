"""Graph passes. A pass is a function ``(GraphModule, example_inputs, Options) -> PassReport``.

Passes run on the dynamo-level graph, before AOTAutograd, so their rewrites are differentiated by
autograd like any other torch code and the backward graph shrinks with the forward.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import torch.fx

from ..options import Options
from .base import Pass, PassReport
from .cross_entropy_grad import cross_entropy_grad
from .embedding_grad import tied_embedding_grad
from .label_sparsity import label_sparsity
from .padding_elimination import padding_elimination
from .upstream_slicing import upstream_slicing

# In the order they must run.
# Padding elimination runs last: it keeps the row selections the others inserted, and checks them.
PASSES: List[Pass] = [label_sparsity, upstream_slicing, padding_elimination]
# On the aten backward graph AOTAutograd partitions out (the "eager" executor runs it as is).
BACKWARD_PASSES: List[Callable[[torch.fx.GraphModule], PassReport]] = [cross_entropy_grad, tied_embedding_grad]


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


__all__ = ["BACKWARD_PASSES", "PASSES", "Pass", "PassReport", "run_passes"]
