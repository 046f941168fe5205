"""What every pass is: a function of the graph, the batch, the options and the plans it fills."""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.fx

from ..options import Options
from .density import ExampleSource
from ..runtime.step import PassReport, Plans


def bytes_of(shape: Sequence[object], dtype: torch.dtype) -> int:
    """Size of a tensor with a possibly symbolic shape, at the sizes it was captured with."""
    n = 1
    for d in shape:
        if isinstance(d, torch.SymInt):
            d = d.node.hint if d.node.hint is not None else 1
        n *= int(d)  # type: ignore[call-overload]
    return n * dtype.itemsize


Pass = Callable[[torch.fx.GraphModule, ExampleSource, Options, Plans], PassReport]
