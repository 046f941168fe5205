"""Take a rewritten region's graph outputs out of the graph: they are computed on first use.

A rewrite that computes only some rows of a tensor the model also returns must still return the
whole tensor. The graph instead returns what that tensor is made from, and the runtime hands the
caller a ``DeferredTensor`` (runtime/deferred.py) that runs the original ops when first used.
"""
from __future__ import annotations

import torch.fx

from ..runtime.deferred import DeferredPlan
from .rows import Region, copy_subgraph, value

META_KEY = "fxtrain_deferred"


def can_defer(gm: torch.fx.GraphModule, region: Region) -> bool:
    """One deferred computation per graph: a second rewrite that needs one leaves its outputs alone."""
    return not region.outputs or META_KEY not in gm.meta


def defer_outputs(gm: torch.fx.GraphModule, region: Region) -> None:
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0])
    sub, inputs = copy_subgraph(gm, region.outputs, set(region.lead))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    plan_inputs, extra = [], []
    for node in inputs:
        if node.op == "placeholder":
            plan_inputs.append(("arg", placeholders.index(node)))
        else:
            plan_inputs.append(("extra", len(extra)))
            extra.append(node)
    direct = [o for o in outs if o not in region.outputs]
    deferred = [(i, region.outputs.index(o), value(o)) for i, o in enumerate(outs) if o in region.outputs]
    output.args = (tuple(direct + extra),)
    gm.meta[META_KEY] = DeferredPlan(gm=sub, n_direct=len(direct), inputs=plan_inputs, deferred=deferred,
                                     placeholders=placeholders)
