"""The inspector's measurements: how much of a batch is real work, read from the capturing call.

Dynamo hands the backend fake tensors, but it keeps the real example of each graph input on the
placeholder (``grapharg.example``) while the capturing call runs, so a pass can measure the first
batch it is compiled for without any extra step in the training loop.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.fx

from ..torch_private import is_fake
from .plans import Plans


def source_example(node: Any) -> Optional[torch.Tensor]:
    """The real tensor behind a placeholder during capture, or None."""
    if not isinstance(node, torch.fx.Node) or node.op != "placeholder":
        return None
    grapharg = node.meta.get("grapharg")
    try:
        example = grapharg.example if grapharg is not None else None
    except Exception:  # the weak reference to the real input is gone
        return None
    if not isinstance(example, torch.Tensor) or is_fake(example):
        return None
    return example


def density_reason(what: str, density: Optional[float], mode: str, threshold: float) -> Tuple[bool, str]:
    """Whether a pass runs ("auto": only below the threshold, where it pays) and why."""
    if mode == "on":
        shown = "unknown" if density is None else f"{density:.2f}"
        return True, f"forced on ({what} {shown})"
    if density is None:
        return True, f"{what} unknown at capture (computed in the graph); exact either way"
    if density < threshold:
        return True, f"{what} {density:.2f} < {threshold}"
    return False, f"{what} {density:.2f} >= {threshold}: nothing worth skipping"


def add_probe(gm: torch.fx.GraphModule, plans: Plans, what: str, placeholder: Any, absent: int) -> None:
    """Remember how to measure ``what`` on later batches: the share of ``placeholder``'s elements
    that differ from ``absent`` (the ignore index, the padding id). Read per call by the runtime, one
    comparison over a [batch, seq] integer tensor: cheap next to the step."""
    if isinstance(placeholder, torch.fx.Node) and placeholder.op == "placeholder":
        index = [n for n in gm.graph.nodes if n.op == "placeholder"].index(placeholder)
        if (what, index, absent) not in plans.probes:
            plans.probes.append((what, index, absent))
