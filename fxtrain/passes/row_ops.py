"""The row gathers and scatters the sparsity passes insert, written in their cheapest form.

The passes move rows between a padded ``[positions, *features]`` layout and a packed ``[rows,
*features]`` one (real tokens, labelled positions). What matters is not only the op itself but the
op autograd derives for its backward, which runs as often:

- gather (``take_rows``): ``F.embedding(index, x)``, not ``index_select(x, 0, index)``. Both run
  the same row-copy kernel forward, but index_select's backward is ``zeros + index_add``, which
  PyTorch's CPU kernel runs as a sort-based ``scatter_add_`` through an index expanded over the
  features: on 2 shared cores the same 1000-row call took 0.1 ms or 60-100 ms, depending on what
  else ran (its several parallel sections each wait for a busy core). An embedding's backward is
  ``embedding_dense_backward``: one zero fill and one parallel pass adding the rows (0.05-0.2 ms).
- scatter into zeros (``put_rows``): ``new_zeros(...).index_copy_(0, index, rows)``, in place: a
  fill and the row writes, and autograd's backward is the row gather (``index_select``), the
  cheapest a scatter can have. AOTAutograd turns the in-place op into the functional
  ``index_copy``, which clones the zeros first; ``scatter_in_place`` puts it back in place on the
  aten forward graph. (``embedding_dense_backward``, the functional "zeros plus rows", would need no
  such pass, but its own derivative fails on the data-dependent row count in torch 2.13.)

Integer gathers (token ids, labels) take no gradient and stay ``index_select``; so do float rows
with more than one feature dim (an embedding's table is 2-d), which the passes do not produce on
the transformer models they target.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.fx
import torch.nn.functional as F

Node = torch.fx.Node


def _embedding_form(example: Any, lead: int) -> bool:
    """Rows of ``example`` (leading ``lead`` dims flattened) are float vectors: the embedding ops apply."""
    return isinstance(example, torch.Tensor) and example.is_floating_point() and example.dim() == lead + 1


def take_rows(graph: torch.fx.Graph, src: Node, index: Node, example: Any, lead: int) -> Node:
    """``src[index]`` along dim 0, inserted at the graph's insertion point.

    ``src`` is ``[rows, *features]`` (the first ``lead`` dims of ``example``, the value it was
    flattened from, made one); ``index`` a 1-d int64 node.
    """
    if _embedding_form(example, lead):
        return graph.call_function(F.embedding, (index, src))
    return graph.call_function(torch.index_select, (src, 0, index))


def put_rows(graph: torch.fx.Graph, rows: Node, index: Node, n: Any, example: Any, lead: int) -> Node:
    """``[n, *features]`` zeros with row ``index[i]`` set to ``rows[i]``, inserted at the graph's
    insertion point. ``example`` is the padded value the result stands for (its first ``lead`` dims
    made one)."""
    features = list(example.shape[lead:])
    zeros = graph.call_method("new_zeros", (rows, (n, *features)))
    return graph.call_method("index_copy_", (zeros, 0, index, rows))


def row_selection(node: Node) -> Optional[Tuple[Node, Node]]:
    """``(src, index)`` when ``node`` gathers rows ``index`` of ``src`` along dim 0 (either form)."""
    if node.op != "call_function":
        return None
    if node.target is torch.index_select and len(node.args) == 3 and node.args[1] == 0 and not node.kwargs:
        src, _, index = node.args
    elif node.target is F.embedding and len(node.args) == 2 and not node.kwargs:
        index, src = node.args
    else:
        return None
    if not isinstance(src, Node) or not isinstance(index, Node):
        return None
    return src, index
