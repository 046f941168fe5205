"""Label sparsity: compute the LM head only for the positions whose label is not ignored.

An MLM batch labels ~15% of its positions (7% in DESIGN §7), yet eager PyTorch projects every
position to the vocabulary and lets ``cross_entropy(ignore_index=-100)`` throw most rows away. The
loss only reads the labelled rows, and every op of a transformer's head (dense, activation,
LayerNorm, decoder, the last layer's FFN and residuals) computes a row from the same row alone, so
the pass selects the labelled rows where the head starts (``rows.find_region``) and replays the head
on them (``rows.replay_on_rows``). The loss is the same sum over the same rows, so loss and
gradients equal eager's up to float reassociation.

The full logits, when the model also returns them, become a ``DeferredTensor``: computed in full on
first use, never when the training loop reads only the loss.
"""
from __future__ import annotations

import inspect
import operator
from typing import Any, List, Optional, Tuple

import torch
import torch.fx
import torch.nn.functional as F

from ..options import Options
from ..torch_private import NN_PAD
from ..runtime.step import PassReport, Plans
from .batch_guard import counted_index
from .density import ExampleSource, add_probe, density_reason
from .defer import can_defer, defer_outputs
from .rows import erase_dead, find_region, flops_at_capture, index_rows, replay_on_rows, value

NAME = "label_sparsity"
_CE_SIGNATURE = inspect.signature(F.cross_entropy)
# Ops a label tensor goes through on its way to the loss (flattening, label shifting, device moves).
_LABEL_METHODS = {"view", "reshape", "contiguous", "to", "long", "flatten"}
_LABEL_FUNCTIONS = {NN_PAD, F.pad, operator.getitem, torch.reshape, torch.flatten}


def cross_entropy_args(node: torch.fx.Node) -> Optional[inspect.BoundArguments]:
    if node.op != "call_function" or node.target is not F.cross_entropy:
        return None
    try:
        bound = _CE_SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound


def unsupported_cross_entropy(bound: inspect.BoundArguments) -> Optional[str]:
    a = bound.arguments
    x, t = value(a["input"]), value(a["target"])
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        return "the loss input is not [rows, classes]"
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point():
        return "the loss target is not one class index per row"
    if a["reduction"] not in ("mean", "sum") or a["size_average"] is not None or a["reduce"] is not None:
        return f"reduction {a['reduction']!r} keeps every row"
    if not isinstance(a["ignore_index"], int):
        return "ignore_index is not a constant"
    w = value(a["weight"])
    if isinstance(w, torch.Tensor) and w.dim() != 1:
        return "class weights are not one per class"
    return None


def _label_placeholder(node: Any) -> Optional[torch.fx.Node]:
    """The model input the loss target is made from (flattened, shifted, moved), if it is one."""
    while isinstance(node, torch.fx.Node) and node.op != "placeholder":
        if not ((node.op == "call_method" and node.target in _LABEL_METHODS)
                or (node.op == "call_function" and node.target in _LABEL_FUNCTIONS)):
            return None
        node = node.args[0]
    return node if isinstance(node, torch.fx.Node) else None


def label_sparsity(gm: torch.fx.GraphModule, examples: ExampleSource, options: Options,
                   plans: Plans) -> PassReport:
    if options.label_sparsity == "off":
        return PassReport(NAME, False, "off by option")
    losses = [(n, b) for n in gm.graph.nodes for b in [cross_entropy_args(n)] if b is not None]
    if not losses:
        return PassReport(NAME, False, "no cross_entropy in the graph")
    reasons: List[str] = []
    applied = False
    saved: Optional[int] = 0
    for node, bound in losses:
        ok, why, flops = _rewrite(gm, node, bound, options, plans, examples)
        applied |= ok
        reasons.append(why)
        saved = None if saved is None or flops is None else saved + flops
    return PassReport(NAME, applied, "; ".join(reasons), saved_flops=saved)


def _rewrite(gm: torch.fx.GraphModule, ce: torch.fx.Node, bound: inspect.BoundArguments,
             options: Options, plans: Plans, examples: ExampleSource) -> Tuple[bool, str, Optional[int]]:
    """(rewritten, why, forward FLOPs skipped on the capturing batch: None if unknown)."""
    blocked = unsupported_cross_entropy(bound)
    if blocked:
        return False, blocked, 0
    x, target, ignore = bound.arguments["input"], bound.arguments["target"], bound.arguments["ignore_index"]
    source = _label_placeholder(target)
    labels = examples.value(source)
    add_probe(gm, plans, "label density", source, ignore)
    density = None if labels is None else float((labels != ignore).float().mean()) if labels.numel() else 0.0
    decision = density_reason("label density", density, options.label_sparsity, options.sparsity_threshold)
    if not decision[0]:
        return decision[0], decision[1], 0
    region = find_region(gm, x, 1, {ce})
    if not region.heavy_ops():
        return False, "no linear layer computes the logits row by row", 0
    blocked = can_defer(gm, plans, region)
    if blocked:
        return False, blocked, 0
    saved = None if density is None else round(sum(flops_at_capture(n) for n in region.lead) * (1 - density))
    graph = gm.graph
    with graph.inserting_before(ce):
        valid = graph.call_function(torch.ne, (target, ignore))
        index = counted_index(gm, plans, valid)  # sized by the batch guard's read-ahead count: no sync of its own
    rows = replay_on_rows(gm, region, index_rows(index), insert_before=ce)
    with graph.inserting_before(ce):
        picked = graph.call_function(torch.index_select, (target, 0, index))
        args = dict(bound.arguments, input=rows[x], target=picked)
        loss = graph.call_function(F.cross_entropy, (), args)
    loss.meta = dict(ce.meta)
    ce.replace_all_uses_with(loss)
    deferred = ""
    if region.outputs:
        defer_outputs(gm, plans, region)
        deferred = "; the logits it also returns are computed on first use"
    erase_dead(gm, [ce] + list(region.lead))
    ops = region.heavy_ops()
    return True, f"{decision[1]}: {ops} matmul(s) run on labelled rows only{deferred}", saved
