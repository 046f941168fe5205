"""The real values a Function's tensor arguments have on the capturing call.

A Function whose forward cannot run on fake tensors and that has no ``infer_shape`` is shaped by
running it once for real. Its arguments are usually intermediate values (``lin(x)``), which dynamo
only holds as fakes; but the graph traced so far and the real example behind each graph input
(``grapharg.example``, kept while the capturing call runs) are enough to compute them: evaluate
just the ancestors of the arguments, without autograd.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.fx

from ..graph_walk import ancestors
from ..torch_private import FakeTensor, unset_fake_temporarily


def _placeholder_value(node: torch.fx.Node) -> Any:
    example = node.meta.get("example_value")
    if isinstance(example, torch.SymInt):
        hint = getattr(example.node, "hint", None)
        return None if hint is None else int(hint)
    grapharg = node.meta.get("grapharg")
    try:
        real = grapharg.example if grapharg is not None else None
    except Exception:  # the weak reference to the real input is gone
        return None
    if isinstance(real, torch.Tensor) and not isinstance(real, FakeTensor):
        return real
    return None


def real_values(nodes: Sequence[torch.fx.Node]) -> Optional[List[torch.Tensor]]:
    """The real tensors ``nodes`` evaluate to on the capturing call, or None when unknowable
    (an input without a real example, e.g. inside a higher-order op's subgraph)."""
    needed = ancestors(nodes)
    env: Dict[torch.fx.Node, Any] = {}
    graph = nodes[0].graph
    with unset_fake_temporarily(), torch.no_grad():
        for node in graph.nodes:
            if node not in needed:
                continue
            if node.op == "placeholder":
                value = _placeholder_value(node)
                if value is None:
                    return None
                env[node] = value
                continue
            if node.op not in ("call_function", "call_method"):
                return None
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            try:
                if node.op == "call_function":
                    env[node] = node.target(*args, **kwargs)
                else:
                    env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
            except Exception:
                return None
    values = [env.get(n) for n in nodes]
    if not all(isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor) for v in values):
        return None
    return values
