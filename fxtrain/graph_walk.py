"""Reachability in an FX graph, shared by the passes, PythonOp examples and the pipeline planner.

Its own module, importing nothing of fxtrain: ``pythonop`` and ``pipeline`` need these walks too, and
reaching them through ``passes`` would tie packages that otherwise do not import each other.
"""
from __future__ import annotations

from typing import Iterable, Set, Union

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
