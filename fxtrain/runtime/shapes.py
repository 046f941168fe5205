"""What the runtime reads of a graph node's value, and the sizes a run's inputs give its symbols.

Shared by the backward that accepts absent gradients, deferred outputs and the cache, which stores
these instead of fake tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import sympy
import torch
import torch.fx

Size = Union[int, sympy.Expr]
VALUE_KEY = "fxtrain_value"


@dataclass(frozen=True)
class ValueInfo:
    """What this runtime reads of a node's value: a size's expression, or a tensor's shape (ints and
    size expressions), dtype and device. The cache stores these instead of fake tensors, which cost
    milliseconds each to rebuild."""

    size: Optional[Size] = None                      # a SymInt or int node
    shape: Optional[Tuple[Size, ...]] = None         # a tensor node
    dtype: Optional[torch.dtype] = None
    device: Optional[torch.device] = None


def _expr(size: Any) -> Size:
    return size.node.expr if isinstance(size, torch.SymInt) else int(size)


def value_info(node: torch.fx.Node) -> Optional[ValueInfo]:
    info = node.meta.get(VALUE_KEY)
    if info is not None:
        return info
    # "val" on AOTAutograd's graphs, "example_value" on dynamo's.
    val = node.meta.get("val", node.meta.get("example_value"))
    if isinstance(val, torch.Tensor):
        return ValueInfo(shape=tuple(_expr(d) for d in val.shape), dtype=val.dtype, device=val.device)
    if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
        return ValueInfo(size=_expr(val))
    return None


class ShapeSolver:
    """Evaluates symbolic tangent shapes from the concrete sizes of the other backward inputs."""

    def __init__(self, placeholders: Sequence[torch.fx.Node]) -> None:
        self.sources: List[Tuple[int, Optional[int], sympy.Symbol]] = []
        for i, node in enumerate(placeholders):
            info = value_info(node)
            if info is None:
                continue
            if isinstance(info.size, sympy.Symbol):
                self.sources.append((i, None, info.size))
            for d, size in enumerate(info.shape or ()):
                if isinstance(size, sympy.Symbol):
                    self.sources.append((i, d, size))
        self.known = {s for _, _, s in self.sources}

    def can_solve(self, shape: Sequence[Size]) -> bool:
        return all(not isinstance(size, sympy.Expr) or size.free_symbols <= self.known for size in shape)

    def solve(self, shape: Sequence[Size], args: Sequence[Any]) -> List[int]:
        env: Dict[sympy.Symbol, int] = {}
        for i, d, sym in self.sources:
            if sym not in env and args[i] is not None:
                env[sym] = int(args[i]) if d is None else int(args[i].shape[d])
        return [int(s.xreplace(env)) if isinstance(s, sympy.Expr) else int(s) for s in shape]
