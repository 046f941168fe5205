"""``fxtrain.pipe_split()``: a stage boundary written inside ``forward``.

In eager mode the call does nothing. While dynamo captures it must leave a node in the graph at the
exact program point, so the function is allowed into the graph as an opaque call and marked as having
a side effect (dead-code elimination would otherwise drop a call whose result nobody reads).
"""
from __future__ import annotations

import torch
import torch.fx

from ..torch_private import allow_in_graph


@torch.fx.node.has_side_effect
def pipe_split() -> None:
    """Mark a pipeline stage boundary here: everything computed after the call goes to the next stage."""
    return None


allow_in_graph(pipe_split)


def is_marker(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is pipe_split
