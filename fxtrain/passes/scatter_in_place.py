"""Aten forward pass: a scatter into a fresh zero tensor runs in place.

Padding elimination re-pads rows for attention as ``new_zeros(...).index_copy_(0, index, rows)``
(``row_ops.put_rows``). AOTAutograd functionalizes the in-place op into ``index_copy(zeros, ...)``,
which clones its first argument: a fill, then a full copy of the zeros, then the row writes, three
passes over a ``[batch * seq, hidden]`` tensor where two do (one per Q, K and V of every layer).
When nothing else reads the zeros, updating them in place computes the same value.

Runs on the aten forward (or inference) graph. A compiler (inductor) decomposes ``index_copy``
before this pass sees it, and re-inplaces on its own.
"""
from __future__ import annotations

import torch
import torch.fx

from ..runtime.step import PassReport

NAME = "scatter_in_place"
aten = torch.ops.aten
_FRESH_ZEROS = {aten.new_zeros.default, aten.zeros.default}
_IN_PLACE = {aten.index_copy.default: aten.index_copy_.default}


def scatter_in_place(fw: torch.fx.GraphModule) -> PassReport:
    graph = fw.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _IN_PLACE:
            continue
        zeros = node.args[0]
        if not isinstance(zeros, torch.fx.Node) or zeros.op != "call_function" or zeros.target not in _FRESH_ZEROS \
                or len(zeros.users) != 1:
            continue
        node.target = _IN_PLACE[node.target]   # same arguments, same result value: the zeros, updated
        rewritten += 1
    if not rewritten:
        return PassReport(NAME, False, "no scatter into a private zero tensor")
    graph.lint()
    fw.recompile()
    return PassReport(NAME, True, f"{rewritten} scatter(s) into fresh zeros run in place")
