"""Graphs marked node by node, so that the cost tracker knows which node, hence which module, the
next ops belong to: before every op the generated code calls :func:`enter_node`, a plain Python
call (no tensor op), so freeing order is that of the unmarked graph."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.fx


@dataclass(frozen=True)
class NodeInfo:
    """What the tracker attributes the next ops to."""

    graph: str              # "forward" | "backward"
    name: str               # FX node name
    module: str             # qualified module name ("" for the root)
    module_type: str


_local = threading.local()
_NODES: List[Optional[NodeInfo]] = [None]
_nodes_lock = threading.Lock()


def current_node() -> Optional[NodeInfo]:
    return getattr(_local, "node", None)


def enter_node(index: int) -> None:
    """Called by the marked graphs before each op (index 0: between ops, outside any node)."""
    _local.node = _NODES[index]


def _module_of(node: torch.fx.Node, backward: bool) -> tuple:
    stack = node.meta.get("fwd_nn_module_stack" if backward else "nn_module_stack") or {}
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    return _clean_path(path), getattr(cls, "__name__", str(cls).rsplit(".", 1)[-1].rstrip("'>"))


def _clean_path(path: str) -> str:
    """dynamo's ``L['self'].bert.encoder.layer[0]`` / ``L__self___bert...`` -> ``bert.encoder.layer.0``."""
    for prefix in ("L['self'].", "L['self']", "L['module'].", "L['module']", "self.", "module."):
        if path.startswith(prefix):
            path = path[len(prefix):]
            break
    path = path.replace("[", ".").replace("]", "").replace("'", "").replace('"', "")
    path = path.replace("._modules.", ".").replace("_modules.", "")
    while ".." in path:
        path = path.replace("..", ".")
    return path.strip(".")


def mark(gm: torch.fx.GraphModule, graph: str) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose code announces each op's node to the tracker."""
    return torch.fx.GraphModule(gm, _marked_graph(gm.graph, graph))


def _marked_graph(source: torch.fx.Graph, graph: str) -> torch.fx.Graph:
    out = torch.fx.Graph()
    env: Dict[torch.fx.Node, torch.fx.Node] = {}
    backward = graph == "backward"
    for node in source.nodes:
        if node.op == "call_function":
            module, module_type = _module_of(node, backward)
            with _nodes_lock:
                _NODES.append(NodeInfo(graph, node.name, module, module_type))
                index = len(_NODES) - 1
            out.call_function(enter_node, (index,))
        elif node.op == "output":
            out.call_function(enter_node, (0,))
        env[node] = out.node_copy(node, lambda n: env[n])
    return out
