"""The inspector's measurements: how much of a batch is real work, read from the capturing call.

A pass measures the batch it is compiled for (densities, the model's own attention mask evaluated on
real data) without any extra step in the training loop. Where those values are depends on who
captures, so the passes get them from an ``ExampleSource`` handed in with the graph: dynamo keeps
the real example of each graph input on its placeholder while the capturing call runs
(``DynamoExamples``, the default); the profiler captures on fake inputs whose values it knows
(profile/session.py); a unit test names them.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import torch
import torch.fx

from ..torch_private import is_fake
from ..runtime.step import Plans
from .rows import ancestors, run_node, value


class ExampleSource:
    """The capturing batch's real values, by placeholder name (none given: nothing is known, and
    each pass decides as it does for a value computed in the graph)."""

    def __init__(self, values: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        self.values: Dict[str, torch.Tensor] = dict(values or {})

    def value(self, node: Any) -> Optional[torch.Tensor]:
        """The real tensor behind placeholder ``node`` on the capturing batch, or None."""
        if not isinstance(node, torch.fx.Node) or node.op != "placeholder":
            return None
        return self.values.get(node.name)

    def evaluate(self, gm: torch.fx.GraphModule, target: Any) -> Optional[Any]:
        """``target``'s value on the capturing batch, computing only its ancestors (None if unknown)."""
        needed = ancestors(target)
        env: Dict[torch.fx.Node, Any] = {}
        for node in gm.graph.nodes:
            if node not in needed:
                continue
            if node.op == "placeholder":
                v = value(node)
                if isinstance(v, torch.SymInt):
                    if v.node.hint is None:
                        return None
                    env[node] = int(v.node.hint)
                    continue
                real = self.value(node)
                if real is None:
                    return None
                env[node] = real
                continue
            try:
                env[node] = run_node(node, env)
            except Exception:
                return None
        return env.get(target)


class DynamoExamples(ExampleSource):
    """What dynamo keeps on each placeholder (``grapharg.example``) while the capturing call runs."""

    @staticmethod
    def example(node: Any) -> Any:
        """Dynamo's example of placeholder ``node``, real or fake (None once it is gone)."""
        if not isinstance(node, torch.fx.Node) or node.op != "placeholder":
            return None
        grapharg = node.meta.get("grapharg")
        try:
            return grapharg.example if grapharg is not None else None
        except Exception:  # the weak reference to the real input is gone
            return None

    def value(self, node: Any) -> Optional[torch.Tensor]:
        example = self.example(node)
        return example if isinstance(example, torch.Tensor) and not is_fake(example) else None


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
