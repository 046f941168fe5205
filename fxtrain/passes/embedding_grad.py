"""Backward pass: add a tied embedding's gradient into the decoder's in place.

With tied input/output embeddings (BERT, GPT-2, RoBERTa ... LM heads) the weight's gradient is the
decoder's dense ``[vocab, hidden]`` gradient plus the embedding's. AOTAutograd computes the latter as
``embedding_dense_backward``: a zero-filled ``[vocab, hidden]`` tensor with the batch's few hundred
rows added in, then a full-size ``add``. On BERT-base that is two passes over 94 MB (~0.3 s of a
~2.5 s step on this machine) to move at most batch x seq rows. Accumulating those rows straight into
the decoder gradient (``index_put_(..., accumulate=True)``) touches only the rows that exist.

Runs on the aten backward graph (after partitioning), where the gradient sum is explicit. The
decoder gradient must be a fresh intermediate that nothing else reads, so updating it in place
changes no other value: a matmul's result, or (under autocast, whose decoder matmul runs in 16 bits
while the weight and the embedding's gradient are float32) the cast of one, since a cast is a copy.
"""
from __future__ import annotations

import torch
import torch.fx

from ..runtime.step import PassReport
from .base import bytes_of

NAME = "tied_embedding_grad"
aten = torch.ops.aten
OPS = (aten.embedding_dense_backward.default,)
_VIEWS = {aten.t.default, aten.view.default, aten.permute.default, aten.transpose.int}
# Ops whose result is new memory: a matmul, or a dtype cast (``_to_copy`` copies even to its own dtype).
_FRESH = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten._to_copy.default,
          torch.ops.prims.convert_element_type.default}


def _private(node: torch.fx.Node) -> bool:
    """Only this use reads ``node``, through single-use views down to a freshly computed tensor."""
    while True:
        if len(node.users) != 1 or node.op != "call_function":
            return False
        if node.target not in _VIEWS:
            return node.target in _FRESH
        node = node.args[0]


def tied_embedding_grad(bw: torch.fx.GraphModule) -> PassReport:
    graph = bw.graph
    rewritten, saved = 0, 0
    for emb in list(graph.nodes):
        if emb.op != "call_function" or emb.target is not aten.embedding_dense_backward.default:
            continue
        grad, indices, _, padding_idx, by_freq = emb.args[:5]
        if by_freq or len(emb.users) != 1:
            continue
        (add,) = emb.users
        if add.op != "call_function" or add.target is not aten.add.Tensor or add.kwargs or len(add.args) != 2:
            continue
        other = add.args[0] if add.args[1] is emb else add.args[1]
        if other is emb or not _private(other) or not any(u.op == "output" for u in add.users):
            continue  # not a weight's gradient (an activation's, through a row gather of row_ops)
        ov, ev, gv = (n.meta.get("val") for n in (other, emb, grad))
        if ov is None or ev is None or gv is None or ov.dtype != ev.dtype or gv.dtype != ev.dtype \
                or ov.device != ev.device or tuple(ov.shape) != tuple(ev.shape) or not isinstance(ev.shape[-1], int):
            continue
        with graph.inserting_before(add):
            idx = graph.call_function(aten.reshape.default, (indices, [-1]))
            rows = graph.call_function(aten.reshape.default, (grad, [-1, ev.shape[-1]]))
            if isinstance(padding_idx, int) and padding_idx >= 0:
                real = graph.call_function(aten.unsqueeze.default, (graph.call_function(
                    aten.ne.Scalar, (idx, padding_idx)), -1))
                # where, not masked_fill: code generators lower where itself (masked_fill they decompose).
                rows = graph.call_function(aten.where.ScalarOther, (real, rows, 0.0))
            summed = graph.call_function(aten.index_put_.default, (other, [idx], rows, True))
        summed.meta = dict(add.meta)
        add.replace_all_uses_with(summed)
        graph.erase_node(add)
        graph.erase_node(emb)
        rewritten += 1
        saved += 3 * bytes_of(ev.shape, ev.dtype)   # the zero fill, and the add's read and write
    if not rewritten:
        return PassReport(NAME, False, "no tied embedding gradient summed with a private dense gradient")
    graph.lint()
    bw.recompile()
    return PassReport(NAME, True, f"{rewritten} embedding gradient(s) accumulated in place into the tied weight's",
                      saved_bytes=saved)
