"""What every pass returns: whether it rewrote the graph and why (``capture_info().optimizations``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.fx

from ..options import Options
from .density import ExampleSource
from .plans import Plans


@dataclass
class PassReport:
    name: str
    applied: bool
    reason: str
    # Backward passes: memory traffic the rewrite removes per step (bytes, at the capture's sizes),
    # which the runtime weighs against the cost of replaying the backward graph (runtime/runner.py).
    saved_bytes: int = 0

    def __str__(self) -> str:
        return f"{'on' if self.applied else 'off'}: {self.reason}"


def bytes_of(shape: Sequence[object], dtype: torch.dtype) -> int:
    """Size of a tensor with a possibly symbolic shape, at the sizes it was captured with."""
    n = 1
    for d in shape:
        if isinstance(d, torch.SymInt):
            d = d.node.hint if d.node.hint is not None else 1
        n *= int(d)  # type: ignore[call-overload]
    return n * dtype.itemsize


Pass = Callable[[torch.fx.GraphModule, ExampleSource, Options, Plans], PassReport]
