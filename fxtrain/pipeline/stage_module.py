"""One stage of a plan (``StagePlan``: what ``plan.py`` cuts) as a standalone ``GraphModule`` over the
model's own parameters.

The stage's graph takes the values its plan receives as positional inputs and returns the values
it sends on (the loss, for the last stage). Parameters and buffers are attributes under their
original qualified names, bound to the very tensors of the user's model: ``named_parameters()``
of a stage reads like the model's, and an optimizer over it updates the model.
Values passed through unchanged and views are cloned, so no stage output aliases a stage input
(autograd and AOTAutograd treat such aliases specially, the pipeline would accumulate their
gradient into the received buffer, and the stage would leave fxtrain's graph runtime);
non-contiguous outputs are made contiguous to be sent.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Dict, List

import torch
import torch.fx

from .capture import CapturedGraph


@dataclasses.dataclass
class StagePlan:
    index: int
    nodes: List[torch.fx.Node]           # the activation nodes this stage computes, in order
    replicated: List[torch.fx.Node]      # parameter-only nodes it recomputes for itself
    inputs: List[torch.fx.Node]          # values received (user-input placeholders for stage 0)
    outputs: List[torch.fx.Node]         # values sent on (the graph's outputs for the last stage)
    params: List[str]                    # qualified names of the parameters it reads
    param_numel: int = 0
    flops: int = 0                       # forward + backward
    forward_flops: int = 0
    weight_flops: int = 0                # the backward's weight-gradient products (W of zero bubble)
    send_bytes: int = 0                  # activation bytes sent to the next stage per call
    first_module: str = ""
    last_module: str = ""
    cost: float = 0.0                    # what the plan balanced (FLOPs unless balance= says otherwise)
    forward_time: float = 0.0            # balance="measured": seconds per call measured (0: not measured)
    backward_time: float = 0.0
    weight_time: float = 0.0             # the backward's weight-gradient part, when timed apart (zero bubble)


def stage_module(captured: CapturedGraph, stage: StagePlan, last: bool) -> torch.fx.GraphModule:
    """The stage as a GraphModule; the last stage returns its single output (the loss) bare."""
    kinds = captured.by_node()
    graph = torch.fx.Graph()
    env: Dict[torch.fx.Node, torch.fx.Node] = {}
    attrs: Dict[str, torch.Tensor] = {}
    for i, v in enumerate(stage.inputs):
        p = graph.placeholder(f"in_{i}_{v.name}")
        p.meta = dict(v.meta)
        env[v] = p

    def lookup(n: torch.fx.Node) -> torch.fx.Node:
        if n in env:
            return env[n]
        info = kinds.get(n)
        if info is None:
            raise RuntimeError(f"stage {stage.index}: value {n.name} is neither computed nor received here")
        name = info.name
        attrs[name] = info.value
        node = graph.get_attr(name)
        node.meta = dict(n.meta)
        env[n] = node
        return node

    wanted = set(stage.nodes) | set(stage.replicated)
    for n in captured.gm.graph.nodes:
        if n in wanted:
            if n.op == "get_attr":
                # Submodules of the captured graph (bodies of higher-order ops such as an inlined
                # autograd.Function or a checkpointed region) and constant tensors it holds.
                attrs[n.target] = operator.attrgetter(n.target)(captured.gm)
            env[n] = graph.node_copy(n, lookup)
    results = []
    received = set(stage.inputs)
    for v in stage.outputs:
        node = lookup(v)
        ex = v.meta.get("example_value")
        if v in received or isinstance(ex, torch.Tensor) and ex._is_view():
            # A view may alias a stage input (``input_ids.view(...)``): AOTAutograd then keeps the
            # stage on its own runtime, whose backward fxtrain cannot split for zero bubble.
            node = graph.call_method("clone", (node,), {"memory_format": torch.contiguous_format})
        elif isinstance(ex, torch.Tensor) and not ex.is_contiguous():
            node = graph.call_method("contiguous", (node,))
        results.append(node)
    graph.output(results[0] if last and len(results) == 1 else tuple(results))
    graph.lint()
    # A dict root binds each get_attr target to that very tensor (parameters stay parameters,
    # other tensors become buffers), creating the submodules along dotted names.
    return torch.fx.GraphModule(attrs, graph, class_name=f"Stage{stage.index}")
