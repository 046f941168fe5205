"""The real values a Function's tensor arguments have on the capturing call.

A Function dynamo cannot trace is shaped by its real run on the capturing call (which is that
step's run, pending.py). Its arguments are usually intermediate values (``lin(x)``), which dynamo
only holds as fakes; but the graph traced so far and the real example behind each graph input
(``grapharg.example``, kept while the capturing call runs) are enough to compute them: evaluate
just the ancestors of the arguments, without autograd.

The evaluation must leave no trace of its own on the step: the random number generators are put
back (a dropout above the Function then draws, when the graph runs, the mask it drew here, and the
run matches), graph inputs other than parameters are copies (a batch norm above it updates a copy
of its running statistics, not the module's a second time), and an earlier PythonOp of the graph
keeps the run it makes for the graph's first run (pending.evaluation).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.fx

from ..graph_walk import ancestors, run_node
from ..torch_private import FakeTensor, unset_fake_temporarily
from . import pending


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
        return real if isinstance(real, torch.nn.Parameter) else real.detach().clone()
    return None


def _device(node: torch.fx.Node) -> Any:
    example = node.meta.get("example_value")
    return example.device if isinstance(example, torch.Tensor) else None


def _evaluate(nodes: Sequence[torch.fx.Node], needed: Any) -> Optional[List[torch.Tensor]]:
    env: Dict[torch.fx.Node, Any] = {}
    with unset_fake_temporarily(), torch.no_grad(), pending.evaluation():
        for node in nodes[0].graph.nodes:
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
            try:
                env[node] = run_node(node, env)
            except Exception:
                return None
    values = [env.get(n) for n in nodes]
    if not all(isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor) for v in values):
        return None
    return values


def real_values(nodes: Sequence[torch.fx.Node], then: Callable[[List[torch.Tensor]], Any]) -> Any:
    """``then(values)``, the real tensors ``nodes`` evaluate to on the capturing call, or None when
    those are unknowable (an input without a real example, e.g. inside a higher-order op's subgraph).

    ``then`` runs with the random generators as the evaluation left them (a Function that draws
    random numbers draws them after the dropout above it, as in eager); they are put back as they
    were before the evaluation when it returns."""
    needed = ancestors(nodes)
    devices = sorted({d.index or 0 for n in needed for d in [_device(n)] if d is not None and d.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        values = _evaluate(nodes, needed)
        return None if values is None else then(values)
