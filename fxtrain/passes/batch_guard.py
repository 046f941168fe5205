"""Per-batch conditions a rewrite relies on, checked before the rewritten graph runs.

Padding elimination computes only real tokens, so a label or a kept row on a padding position would
read a value the rewritten graph never computed. Whether a batch has one is known only from its
values. Asserting inside the graph would stop training in the middle of a step; instead the pass
writes each condition into a small graph of its own (a few integer ops over ``[batch, seq]`` inputs)
that the runtime evaluates before the step (``runtime/dense_route.py``), and a batch that fails it
runs through the graph captured before the passes: eager's numbers, never an exception.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx

from .plans import Plans

Node = torch.fx.Node
_INPLACE_OPERATORS = {getattr(operator, n) for n in ("iadd", "iand", "iconcat", "ifloordiv", "ilshift", "imatmul",
                                                     "imod", "imul", "ior", "ipow", "irshift", "isub",
                                                     "itruediv", "ixor")}


class GuardBuilder:
    """Builds the guard graph: same inputs as the captured graph, one bool per condition out."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.graph = torch.fx.Graph()
        self.env: Dict[Node, Node] = {}
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                self.env[node] = self.graph.placeholder(node.name)
                self.env[node].meta = dict(node.meta)
        self.conditions: List[Tuple[Node, str]] = []

    def node(self, source: Node) -> Optional[Node]:
        """``source`` (a node of the captured graph) in the guard graph, with what it is made from.

        None when its computation is not a pure function of the inputs (an in-place op, a module
        call): copying that into the guard would run it twice.
        """
        if source in self.env:
            return self.env[source]
        needed, stack = set(), [source]
        while stack:
            n = stack.pop()
            if n in needed or n in self.env:
                continue
            if not _pure(n):
                return None
            needed.add(n)
            stack.extend(n.all_input_nodes)
        for n in self.gm.graph.nodes:
            if n in needed:
                self.env[n] = self.graph.node_copy(n, lambda a: self.env[a])
        return self.env[source]

    def call(self, target: Any, *args: Any, method: bool = False) -> Node:
        if method:
            return self.graph.call_method(target, args)
        return self.graph.call_function(target, args)

    def require(self, condition: Node, reason: str) -> None:
        """``condition``: a 0-d bool node of the guard graph that must hold for the rewrite to be exact."""
        self.conditions.append((condition, reason))

    def store(self, plans: "Plans") -> None:
        """Hand the finished guard to the runtime through the capture's plans (nothing if no condition)."""
        if not self.conditions:
            return
        stacked = self.graph.call_function(torch.stack, ([c for c, _ in self.conditions],))
        self.graph.output(stacked)
        guard = torch.fx.GraphModule(self.gm, self.graph)
        plans.guard = BatchGuard(guard, [r for _, r in self.conditions])


class BatchGuard:
    """The conditions of one capture: ``check(*graph_inputs)`` is a bool tensor, one per reason."""

    def __init__(self, check: Callable[..., torch.Tensor], reasons: List[str]) -> None:
        self.check, self.reasons = check, reasons

    def failed(self, args: Tuple[Any, ...]) -> List[str]:
        """The reasons this batch breaks (empty: the rewritten graph serves it). One host sync."""
        ok = self.check(*args)
        if bool(ok.all()):
            return []
        return [r for r, good in zip(self.reasons, ok.tolist()) if not good]


def _pure(node: Node) -> bool:
    if node.op == "placeholder":
        return True
    if node.op not in ("call_function", "call_method"):
        return False
    if node.op == "call_function" and node.target in _INPLACE_OPERATORS:
        return False
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return not (name.endswith("_") and not name.endswith("__"))
