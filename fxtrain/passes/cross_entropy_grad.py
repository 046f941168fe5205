"""Backward pass: the gradient of cross-entropy with respect to the logits, without a one-hot.

AOTAutograd differentiates ``log_softmax`` + ``nll_loss`` as two kernels: ``nll_loss_backward``
zero-fills a ``[rows, classes]`` tensor and writes one value per row, then
``_log_softmax_backward_data`` reads it back to form ``g - exp(logp) * sum(g)``. For a language
model's head that is a vocabulary-wide fill and an extra read (2048 x 50257 floats: ~0.2 s per step
of GPT-2 here) to move one number per row. Since each row of ``g`` holds a single ``-s`` at its
target (``s`` = upstream gradient / total weight, 0 for ignored rows), the same gradient is
``exp(logp) * s`` with ``s`` subtracted at the target: one pass over the logits instead of three.
Values equal eager's operation for operation (``exp*s - s`` is ``-s - exp*(-s)`` reordered).
"""
from __future__ import annotations

import torch
import torch.fx

from ..runtime.step import PassReport
from .base import bytes_of

NAME = "cross_entropy_grad"
aten = torch.ops.aten
OPS = (aten.nll_loss_backward.default, aten._log_softmax_backward_data.default)
# Below this many classes the one-hot fill is noise next to the rest of the step, and a rewrite that
# only reorders roundings is not worth making (a zero-true gradient, e.g. a bias before BatchNorm,
# would then differ from eager's rounding noise, which AdamW scales up to full steps).
MIN_CLASSES = 256


def cross_entropy_grad(bw: torch.fx.GraphModule) -> PassReport:
    graph = bw.graph
    rewritten, skipped, saved = 0, False, 0
    for nll in list(graph.nodes):
        if nll.op != "call_function" or nll.target is not aten.nll_loss_backward.default or len(nll.users) != 1:
            continue
        grad, logp, target, weight, reduction, ignore, total = nll.args[:7]
        (lsm,) = nll.users
        if lsm.op != "call_function" or lsm.target is not aten._log_softmax_backward_data.default \
                or lsm.args[0] is not nll:
            continue
        lv, tv = logp.meta.get("val"), target.meta.get("val")
        if weight is not None or reduction not in (1, 2) or lv is None or tv is None or lv.dim() != 2 \
                or tv.dim() != 1 or lsm.args[2] not in (1, -1) or lsm.args[3] != lv.dtype:
            continue
        if isinstance(lv.shape[1], int) and lv.shape[1] < MIN_CLASSES:
            skipped = True
            continue
        output = lsm.args[1]  # the saved log_softmax output, what eager's kernel reads too
        with graph.inserting_before(lsm):
            valid = graph.call_function(aten.ne.Scalar, (target, ignore))
            scale = graph.call_function(aten.div.Tensor, (grad, total)) if reduction == 1 else grad
            # where, not valid * scale: a batch whose labels are all ignored has total 0, so scale is
            # inf, and 0 * inf would put NaN where eager's kernel leaves its zero fill.
            # prims' dtype conversion: what code generators lower directly (aten._to_copy they decompose).
            per_row = graph.call_function(torch.ops.prims.convert_element_type.default, (graph.call_function(
                aten.where.ScalarOther, (valid, scale, 0.0)), lv.dtype))
            # exp allocates the result; scaling and the target column update it in place (an
            # out-of-place chain would cost two more passes over the logits than it saves).
            probs = graph.call_function(aten.exp.default, (output,))
            out = graph.call_function(aten.mul_.Tensor, (probs, graph.call_function(aten.unsqueeze.default, (per_row, 1))))
            column = graph.call_function(aten.unsqueeze.default, (graph.call_function(
                aten.where.ScalarOther, (valid, target, 0)), 1))
            minus = graph.call_function(aten.unsqueeze.default, (graph.call_function(aten.neg.default, (per_row,)), 1))
            result = graph.call_function(aten.scatter_add_.default, (out, 1, column, minus))
        result.meta = dict(lsm.meta)
        lsm.replace_all_uses_with(result)
        graph.erase_node(lsm)
        graph.erase_node(nll)
        rewritten += 1
        saved += 3 * bytes_of(lv.shape, lv.dtype)   # the one-hot's fill, write and the product's read
    if not rewritten:
        why = f"fewer than {MIN_CLASSES} classes: nothing worth removing" if skipped \
            else "no unweighted log_softmax + nll_loss gradient"
        return PassReport(NAME, False, why)
    graph.lint()
    bw.recompile()
    return PassReport(NAME, True, f"{rewritten} cross-entropy gradient(s) formed in one pass over the logits",
                      saved_bytes=saved)
