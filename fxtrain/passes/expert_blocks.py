"""Mixture-of-experts blocks as one row op: each token's output from its own hidden row and routing.

transformers runs the experts of its MoE families (Mixtral, Qwen2/3-MoE, OLMoE, GraniteMoE,
DeepSeek-V3 and more: ``integrations/moe.py: grouped_mm_experts_forward``) by sorting the
(token, slot) pairs of the router's top-k by expert, gathering each pair's hidden row, running
every expert's pairs through one grouped matmul whose group offsets count the pairs per expert,
weighting, putting the pairs back in their order and summing each token's k slots. Op by op that
is no row op: a sort and gathers over all tokens. As a whole it is one: a pair's result is its own
row times its own expert's weights, whichever other pairs share the sort. So padding elimination
can run the block on the real tokens alone, where eager PyTorch also routes every padding token
through k experts.

:func:`find` proves that reading of a graph's nodes, not of a function name: each node between the
sort and the block's ``view(tokens, k, features)`` must be one of the forms below, so a router with
a capacity (which drops pairs according to all tokens: Switch Transformers) or any op that mixes
pairs does not match, and the pass stops there as before.

- ``sort(ids.reshape(-1))`` of a ``[tokens, k]`` index tensor taken from ``topk(..., dim=-1)``
  over as many experts as ``histc`` has bins: ``perm`` and the sorted ids;
- ``x[perm // k]`` for a ``[tokens, ...]`` tensor, ``y.reshape(-1)[perm]`` for a ``[tokens, k]``
  one, ``w[ids]`` for a tensor computed from no token (a per-expert bias): rows in sorted order;
- ops on rows in sorted order alone: elementwise (with operands that depend on no token), casts,
  ``unsqueeze(-1)``, ``chunk``/``split`` of the last dim, slices of the features after an ellipsis
  (``x[..., ::2]``), and in-place arithmetic of such rows by
  such rows or tokenless operands (gpt-oss's ``out.add_(bias[ids])`` after a grouped matmul: the
  block is replayed node by node, so the mutation comes where it came);
- ``cumsum(histc(ids.float(), bins=E, min=0, max=E-1))``: the group offsets, read only by
  grouped matmuls of sorted rows by weights that depend on no token;
- ``inv = empty_like(perm); inv[perm] = arange(n); rows[inv]``: back in pair order;
- ``view(tokens, k, *features)`` of that: the block's output, rows = tokens.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import torch
import torch.fx

from .rows import Node, _elementwise, _features_index, _same, _tensor, features_split, is_grouped_mm, value

_CASTS = {"float", "to", "int", "long", "contiguous", "type_as"}
_IN_PLACE = {"add_", "sub_", "mul_", "div_"}


@dataclass
class ExpertBlock:
    """One matched block: ``inputs`` are read row by row (rows = tokens, one leading dim),
    ``nodes`` are the block's own (in graph order, ``out`` last), ``tokens`` is the input whose
    row count sizes the output."""

    out: Node
    k: int
    tokens: Optional[Node] = None
    inputs: Set[Node] = field(default_factory=set)
    nodes: List[Node] = field(default_factory=list)
    _arange: Dict[Node, Node] = field(default_factory=dict)   # arange -> the perm it inverts

    def copy(self, graph: torch.fx.Graph, node: Node, rows: Dict[Node, Node]) -> Node:
        """``node`` of the block on the row forms of its inputs: sizes that counted every token
        (the inverse permutation's ``arange``, the output's view) count the row form's."""
        if node in self._arange:
            n = graph.call_method("size", (rows[self._arange[node]], 0))
            return graph.call_function(torch.arange, (n,), dict(node.kwargs))
        if node is self.out:   # its sizes after the tokens as the model wrote them (ints or size nodes)
            n = graph.call_method("size", (rows[self.tokens], 0))
            sizes = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
            return graph.call_method(node.target, (rows[node.args[0]], n, *(rows.get(a, a) for a in sizes[1:])))
        return graph.node_copy(node, lambda a: rows.get(a, a))


def find(gm: torch.fx.GraphModule) -> List[ExpertBlock]:
    """Every expert block of ``gm`` (see the module docstring)."""
    blocks = []
    for node in gm.graph.nodes:
        if _is_sort(node):
            block = _match(gm, node)
            if block is not None:
                blocks.append(block)
    return blocks


def _is_sort(node: Node) -> bool:
    if not (node.op == "call_function" and node.target is torch.sort or
            node.op == "call_method" and node.target == "sort"):
        return False
    allowed = {"stable": (True, False, None), "dim": (-1, 0), "descending": (False,)}
    return len(node.args) == 1 and all(k in allowed and v in allowed[k] for k, v in node.kwargs.items())


def _flat_pairs(node: Node) -> Optional[Node]:
    """The ``[tokens, k]`` tensor ``node`` flattens (``y.reshape(-1)``), else None."""
    if node.op != "call_method" or node.target not in ("reshape", "view") or node.args[1:] != (-1,) or node.kwargs:
        return None
    y = _tensor(node.args[0])
    return node.args[0] if y is not None and y.dim() == 2 and isinstance(y.shape[1], int) else None


def _experts_of(ids: Node) -> Optional[int]:
    """How many experts the ``[tokens, k]`` ids choose from: the last dim of the ``topk`` they come
    out of (through casts and views), else None."""
    node = ids
    while node.op == "call_method" and node.target in _CASTS | {"view", "reshape"}:
        node = node.args[0]
    if node.op != "call_function" or node.target is not operator.getitem or node.args[1] != 1:
        return None
    topk = node.args[0]
    if not (topk.op == "call_function" and topk.target is torch.topk or
            topk.op == "call_method" and topk.target == "topk"):
        return None
    x = _tensor(topk.args[0])
    dim = topk.kwargs.get("dim", topk.args[2] if len(topk.args) > 2 else -1)
    if x is None or dim not in (-1, x.dim() - 1) or not isinstance(x.shape[-1], int):
        return None
    return x.shape[-1]


def _tokenless(node: object, rowed: Set[Node]) -> bool:
    """``node`` depends on no token: a constant, or computed from parameters alone (a buffer or
    any other input might hold something of the batch)."""
    if not isinstance(node, Node):
        return True
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in rowed or n.op == "placeholder" and not isinstance(value(n), torch.nn.Parameter):
            return False
        if n.op not in ("placeholder", "get_attr"):
            stack.extend(n.all_input_nodes)
    return True


def _match(gm: torch.fx.GraphModule, sort: Node) -> Optional[ExpertBlock]:
    flat = sort.args[0]
    ids = _flat_pairs(flat) if isinstance(flat, Node) else None
    if ids is None or len(flat.users) != 1:
        return None
    experts = _experts_of(ids)
    t_ids = _tensor(ids)
    if experts is None or t_ids.dtype.is_floating_point:
        return None
    tokens_n, k = t_ids.shape
    # Kinds: "perm", "ids" (sorted ids), "tok" (perm // k), "rows" (rows in sorted order), "tuple"
    # (a split of such rows), "counts", "offs", "inv0" (empty_like(perm)), "inv" (filled), "pairs"
    # (rows back in pair order), "out".
    kind: Dict[Node, str] = {sort: "sort", flat: "flat"}
    block = ExpertBlock(out=sort, k=k)
    block.inputs.add(ids)
    rowed_sources: Set[Node] = {ids}
    out: Optional[Node] = None
    filled: Set[Node] = set()
    for node in gm.graph.nodes:
        inside = [a for a in node.all_input_nodes if a in kind]
        if node in kind or not inside or inside == [out]:
            continue
        if out is not None:
            return None   # something reads the block's inside after its output
        got = _step(node, kind, block, rowed_sources, filled, experts, tokens_n, k)
        if got is None:
            return None
        kind[node] = got
        if got == "out":
            out = node
    if out is None:
        return None
    # Closed: nothing outside reads the block's inside.
    for node, what in kind.items():
        if node is not out and any(u not in kind for u in node.users):
            return None
    if not any(what == "offs" for what in kind.values()) or block.tokens is None:
        return None
    block.out = out
    block.nodes = [n for n in gm.graph.nodes if n in kind or n in block._arange]
    return block


def _step(node: Node, kind: Dict[Node, str], block: ExpertBlock, rowed: Set[Node], filled: Set[Node],
          experts: int, tokens_n: object, k: int) -> Optional[str]:
    """The kind of ``node``, one of whose inputs is in the block, or None when it fits no form."""
    tgt, args, kwargs = node.target, node.args, node.kwargs
    of = lambda a: kind.get(a) if isinstance(a, Node) else None   # noqa: E731
    fn = node.op == "call_function"
    if fn and tgt is operator.getitem and of(args[0]) == "sort" and args[1] in (0, 1):
        return "ids" if args[1] == 0 else "perm"
    if fn and tgt is operator.floordiv and of(args[0]) == "perm" and args[1] == k:
        return "tok"
    if fn and tgt is operator.getitem and isinstance(args[1], Node):
        src, index = args[0], of(args[1])
        t = _tensor(src)
        if of(src) is None and index == "tok" and t is not None and t.dim() >= 1 and _same(t.shape[0], tokens_n):
            block.inputs.add(src)
            rowed.add(src)
            if block.tokens is None:   # the first token-rows input sizes the output
                block.tokens = src
            return "rows"
        if index == "perm" and of(src) is None and isinstance(src, Node) and _flat_pairs(src) is not None \
                and len(src.users) == 1 and _same(_tensor(_flat_pairs(src)).shape[0], tokens_n) \
                and _tensor(_flat_pairs(src)).shape[1] == k:
            kind[src] = "flat"
            block.inputs.add(_flat_pairs(src))
            rowed.add(_flat_pairs(src))
            return "rows"
        if index == "ids" and of(src) is None and _tokenless(src, rowed):
            return "rows"   # a per-expert bias, by each sorted pair's expert
        if of(src) == "rows" and index == "inv" and args[1] in filled:
            return "pairs"
        return None
    if fn and tgt is operator.getitem and of(args[0]) == "tuple" and isinstance(args[1], int):
        return "rows"
    if fn and tgt is operator.getitem and of(args[0]) == "rows" and _tensor(args[0]) is not None \
            and _features_index(args[1], _tensor(args[0]).dim(), 1) == args[1]:
        return "rows"   # x[..., ::2]: gpt-oss's interleaved gate and up halves
    if node.op == "call_method" and tgt in _CASTS and of(args[0]) in ("rows", "ids") and \
            all(not isinstance(a, Node) for a in list(args[1:]) + list(kwargs.values())):
        return of(args[0])
    if node.op == "call_method" and tgt == "unsqueeze" and of(args[0]) == "rows" and args[1:] == (-1,):
        return "rows"
    if features_split(node) is not None and of(args[0]) == "rows":
        return "tuple"
    if fn and tgt is torch.histc and of(args[0]) == "ids":   # of float ids on the CPU, of int ones on CUDA
        opts = dict(zip(("bins", "min", "max"), args[1:]), **kwargs)
        if opts.get("bins") == experts and opts.get("min") == 0 and opts.get("max") == experts - 1:
            return "counts"
        return None
    if fn and tgt is torch.cumsum and of(args[0]) == "counts" and \
            (args[1:] == (0,) or args[1:] == () and kwargs.get("dim") == 0):
        return "offs"
    if is_grouped_mm(node):
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        if of(args[0]) == "rows" and of(offs) == "offs" and _tokenless(args[1], rowed) and \
                set(kwargs) <= {"offs"} and len(args) <= 3:
            return "rows"
        return None
    if fn and tgt is torch.empty_like and of(args[0]) == "perm" and len(args) == 1:
        return "inv0"
    if fn and tgt is operator.setitem and of(args[0]) == "inv0" and of(args[1]) == "perm":
        ar = args[2]
        if isinstance(ar, Node) and ar.op == "call_function" and ar.target is torch.arange and len(ar.users) == 1 \
                and len(ar.args) == 1 and set(ar.kwargs) <= {"device", "dtype"}:
            kind[args[0]] = "inv"
            filled.add(args[0])
            block._arange[ar] = args[1]
            return "set"
        return None
    if node.op == "call_method" and tgt in ("view", "reshape") and of(args[0]) == "pairs":
        t = _tensor(node)
        if t is not None and t.dim() >= 2 and _same(t.shape[0], tokens_n) and t.shape[1] == k:
            return "out"
        return None
    if node.op == "call_method" and tgt in _IN_PLACE and of(args[0]) == "rows" and len(args) == 2 and not kwargs \
            and (of(args[1]) == "rows" or of(args[1]) is None and _tokenless(args[1], rowed)):
        return "rows"
    if _elementwise(node) and any(of(a) == "rows" for a in args):
        others = [a for a in list(args) + list(kwargs.values()) if of(a) != "rows"]
        if all(_tokenless(a, rowed) for a in others):
            return "rows"
    return None
