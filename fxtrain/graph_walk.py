"""Reachability in an FX graph, and one node run on values, shared by the passes, PythonOp examples
and the pipeline planner.

Its own module, importing nothing of fxtrain: ``pythonop`` and ``pipeline`` need these walks too, and
reaching them through ``passes`` would tie packages that otherwise do not import each other.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Set, Union

import torch.fx

Node = torch.fx.Node


def _walk(starts: Union[Node, Iterable[Node]], up: bool) -> Set[Node]:
    stack = [starts] if isinstance(starts, Node) else list(starts)
    seen: Set[Node] = set()
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes if up else node.users)
    return seen


def ancestors(starts: Union[Node, Iterable[Node]]) -> Set[Node]:
    """``starts`` and every node they are computed from."""
    return _walk(starts, up=True)


def descendants(starts: Union[Node, Iterable[Node]]) -> Set[Node]:
    """``starts`` and every node computed from them."""
    return _walk(starts, up=False)


def run_node(node: Node, env: Dict[Node, Any]) -> Any:
    """``node``'s op on the values of its inputs in ``env`` (a call_function or call_method node);
    raises ``LookupError`` for other nodes, and whatever the op raises."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    raise LookupError(f"cannot run a {node.op} node")
