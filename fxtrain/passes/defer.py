"""Take a rewritten region's graph outputs out of the graph: they are computed on first use.

A rewrite that computes only some rows of a tensor the model also returns must still return the
whole tensor. The graph instead returns what that tensor is made from, and the runtime hands the
caller a ``DeferredTensor`` (runtime/deferred.py) that runs the original ops when first used.

Two flavours. ``defer_outputs`` (label sparsity, upstream slicing) recomputes only the skipped head
from activations the graph already has, so a read costs one head. ``defer_dense`` (padding
elimination) has no such activations: every layer skipped the padding rows, so a read re-runs the
graph's original ops from the graph's inputs. Either way a read gives eager's values everywhere.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Set, Tuple

import torch.fx

from ..capture_state import ENTRY_PREFIXES, compiled_frame_name
from ..runtime.deferred import DeferredPlan
from ..runtime.direct import direct
from ..runtime.step import Plans
from .rows import Node, Region, copy_subgraph, value

def can_defer(gm: torch.fx.GraphModule, plans: Plans, region: Region) -> Optional[str]:
    """Why the region's outputs cannot be deferred (None: they can, or there are none).

    One head deferral per graph: a second rewrite that needs one leaves its outputs alone. And a
    graph that ends at a graph break returns values the rest of the model reads at once (in the
    code dynamo resumes after the break): deferring them would only move the work there.
    """
    if not region.outputs:
        return None
    if plans.deferred is not None:
        return "another rewrite already defers this graph's outputs"
    return feeds_resumed_code(gm)


def feeds_resumed_code(gm: torch.fx.GraphModule) -> Optional[str]:
    """Why this graph's outputs are read by model code right away (None: they go to the caller).

    Only a graph of fxtrain's own entry frame (or of its resumption after a break) that ends with
    the frame's return hands its outputs to the training loop. A graph that ends at a graph break,
    or one of a frame dynamo compiles separately after a break (an inner ``forward``), returns
    values the model's Python code reads at once: deferring them would only move the work there,
    into code dynamo traces again.
    """
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is not None and getattr(reason, "graph_break", False):
        return "the graph ends at a graph break, so what it returns feeds the rest of the model"
    frame = compiled_frame_name()
    if frame is not None and not frame.startswith(ENTRY_PREFIXES):
        return f"the graph is of {frame}, a frame compiled apart after a graph break, so what it returns " \
               f"feeds the rest of the model"
    return None


def defer_outputs(gm: torch.fx.GraphModule, plans: Plans, region: Region) -> None:
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
    plans.deferred = DeferredPlan(gm=sub, n_direct=len(direct), inputs=plan_inputs, deferred=deferred,
                                     placeholders=placeholders, n_outputs=len(region.outputs))


class _DenseThenHead:
    """Recompute some tensors from the graph inputs, then run an earlier plan's head on them."""

    def __init__(self, dense: torch.fx.GraphModule, n_dense_in: int, head: Optional[Callable[..., Any]],
                 head_inputs: List[Tuple[str, int]], dense_outputs: List[int]) -> None:
        self.dense, self.n_dense_in, self.head = dense, n_dense_in, head
        self.head_inputs, self.dense_outputs = head_inputs, dense_outputs

    def __call__(self, *args: Any) -> Tuple[Any, ...]:
        dense = direct(self.dense)(*args[:self.n_dense_in])
        rest = args[self.n_dense_in:]
        head_out: Tuple[Any, ...] = ()
        if self.head is not None:
            head_out = tuple(direct(self.head)(*[dense[i] if kind == "dense" else rest[i] for kind, i in self.head_inputs]))
        return head_out + tuple(dense[i] for i in self.dense_outputs)


def defer_dense(gm: torch.fx.GraphModule, plans: Plans, affected: Set[Node]) -> int:
    """Return the graph outputs in ``affected`` as deferred, recomputed from the graph's inputs.

    Call before rewriting, while the graph still computes them densely. Outputs that an earlier
    deferral reads as extras are recomputed the same way and fed to its head. Returns how many
    outputs (or extras) were taken out of the graph.
    """
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0])
    old: Optional[DeferredPlan] = plans.deferred
    n_direct = old.n_direct if old else len(outs)
    direct, extras = outs[:n_direct], outs[n_direct:]
    hit_direct = [i for i, o in enumerate(direct) if o in affected]
    hit_extra = [j for j, o in enumerate(extras) if o in affected]
    if not hit_direct and not hit_extra:
        return 0
    roots = list(dict.fromkeys([direct[i] for i in hit_direct] + [extras[j] for j in hit_extra]))
    computed = {n for n in graph.nodes if n.op != "placeholder"}
    dense, dense_in = copy_subgraph(gm, roots, computed)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    inputs: List[Tuple[str, int]] = [("arg", placeholders.index(n)) for n in dense_in]

    # Where the original (dynamo-facing) output positions of the direct outputs are.
    n_total = n_direct + (len(old.deferred) if old else 0)
    taken = {p for p, _, _ in old.deferred} if old else set()
    position = [p for p in range(n_total) if p not in taken]

    keep_extra = [j for j in range(len(extras)) if j not in hit_extra]
    head_inputs: List[Tuple[str, int]] = []
    if old is not None:
        for kind, i in old.inputs:
            if kind == "extra" and i in hit_extra:
                head_inputs.append(("dense", roots.index(extras[i])))
            elif kind == "extra":
                head_inputs.append(("rest", len(inputs) - len(dense_in)))
                inputs.append(("extra", keep_extra.index(i)))
            else:
                head_inputs.append(("rest", len(inputs) - len(dense_in)))
                inputs.append((kind, i))
    n_head_out = old.n_outputs if old else 0
    deferred = list(old.deferred) if old else []
    deferred.extend((position[i], n_head_out + k, value(direct[i])) for k, i in enumerate(hit_direct))
    deferred.sort(key=lambda d: d[0])
    fn = _DenseThenHead(dense, len(dense_in), old.gm if old else None, head_inputs,
                        [roots.index(direct[i]) for i in hit_direct])
    new_direct = [o for i, o in enumerate(direct) if i not in hit_direct]
    output.args = (tuple(new_direct + [extras[j] for j in keep_extra]),)
    plans.deferred = DeferredPlan(gm=fn, n_direct=len(new_direct), inputs=inputs, deferred=deferred,
                                     placeholders=placeholders, n_outputs=n_head_out + len(hit_direct))
    return len(hit_direct) + len(hit_extra)
