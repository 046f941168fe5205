"""Graph passes. A pass is a function ``(GraphModule, example_inputs, Options) -> PassReport``.

Passes run on the dynamo-level graph, before AOTAutograd, so their rewrites are differentiated by
autograd like any other torch code and the backward graph shrinks with the forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

import torch.fx

from ..options import Options


@dataclass
class PassReport:
    name: str
    applied: bool
    reason: str

    def __str__(self) -> str:
        return f"{'on' if self.applied else 'off'}: {self.reason}"


Pass = Callable[[torch.fx.GraphModule, Sequence[object], Options], PassReport]

# Filled in the order the passes must run; empty until the FLOP-reduction passes land.
PASSES: List[Pass] = []


def run_passes(gm: torch.fx.GraphModule, example_inputs: Sequence[object], options: Options) -> Dict[str, str]:
    reports: Dict[str, str] = {}
    for p in PASSES:
        report = p(gm, example_inputs, options)
        reports[report.name] = str(report)
    if PASSES:
        gm.graph.lint()
        gm.recompile()
    return reports
