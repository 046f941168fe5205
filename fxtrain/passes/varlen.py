"""Attention on real tokens only: padding elimination's last padded op, run sequence by sequence.

After ``padding_elimination._rewrite`` every attention reads q, k and v re-padded into zeros
(``row_ops.put_rows`` followed by the model's own view/split/transpose) and its output is gathered
back to the real tokens. Here that round trip is replaced, attention by attention (an SDPA call,
or a plain block written in eager ops: ``Attention``), by
``fxtrain::varlen_attention`` on the packed rows themselves (``runtime/varlen_attention.py``), so
attention costs ``sum(length**2)`` instead of ``batch * seq**2`` and the re-padding disappears.

What makes it exact, and what is checked before relying on it:

- the model's mask, restricted to real queries, allows exactly the real keys of the same sequence
  (bidirectional) or those at or before the query (causal): checked on the capturing batch to pick
  the kind, and written into the batch guard, so a later batch whose mask is anything else (a
  document mask, a sliding window) runs the dense graph instead;
- the layout ops between the packed rows and attention only split the features into heads
  (``[tokens, features]`` -> ``[batch, heads, seq, dim]`` with each head a contiguous block of
  features, the heads a fixed number of features apart: one after another, or GPT-NeoX's q, k and
  v of a head side by side) and the output ops only merge them back: checked by running those ops
  on a probe whose values name their own position;
- between that head split and attention, q and k may pass through ops that act on each position
  alone (rotary position embeddings: ``q * cos + rotate_half(q) * sin``; a per-head RMSNorm, also
  before the head transpose, as HF Qwen3's; ``per_position_op`` lists what qualifies, with shape
  checks). They are re-run on the packed rows, laid out as
  ``[tokens, heads, 1, dim]``, with each operand computed outside the padded tensors (cos/sin, from
  the positions) gathered at each real token's own ``(row, position)``; on the capturing batch the
  result is checked bit-equal to the dense ops' at the real tokens. Positions are whatever eager
  used (HF counts them from the row start, padding included, unless position_ids are given);
- grouped-query attention's repeat of key/value heads (HF's ``repeat_kv``) is repeated on the
  packed rows (``repeat_interleave``), as eager copies it on the padded ones;
- no attention dropout (``dropout_p`` 0: eager's dropout mask over the padded layout has no
  per-sequence equivalent), no ``enable_gqa`` flag, a constant scale.

An attention that fails any of these keeps the re-padded path, which is exact, and the reason is
logged and reported.
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.fx
import torch.nn.functional as F

from ..runtime.varlen_attention import VARLEN_ATTENTION
from ..torch_private import AUTOCAST_ENTER, AUTOCAST_EXIT
from ..runtime.host_counts import HOST_ROW_LENGTHS
from .batch_guard import GuardBuilder, host_numbers
from ..runtime.step import Plans
from .row_ops import row_selection
from .rows import _same, ancestors, descendants, run_node, value

logger = logging.getLogger("fxtrain")
Node = torch.fx.Node
_LAYOUT = {"view", "reshape", "transpose", "permute", "contiguous", "split", "chunk", "unbind", "unflatten", "flatten"}
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


# Ops that act on each (batch, position) of q or k alone, as rotary position embeddings do between the
# head split and attention: elementwise arithmetic (operands from outside the padded tensors, such
# as cos/sin of the positions, may broadcast), casts, and slices or concatenations of the last dim.
# And the per-head RMSNorm some models apply to q and k before rotary (HF Qwen3's q_norm/k_norm):
# a positive power, a mean over the last dim kept as a dim, and rsqrt of that plus a positive eps.
_CHAIN_FUNCTIONS = {operator.mul, operator.add, operator.sub, operator.truediv, operator.neg,
                    torch.mul, torch.add, torch.sub, torch.div, torch.neg, torch.pow, operator.pow,
                    torch.rsqrt, torch.mean}
_CHAIN_METHODS = {"mul", "add", "sub", "div", "neg", "to", "float", "half", "bfloat16", "double", "type_as",
                  "pow", "rsqrt", "mean"}
_DIVIDES = {operator.truediv, torch.div, "div"}
_ADDS = {operator.add, torch.add, "add"}


def _norm_op_safe(node: Node, inside: Callable[[Any], bool]) -> bool:
    """The RMSNorm ops among the chain's, on their safe forms only: they run on the re-padded
    layout too, whose padding positions are zeros, and an inf there (rsqrt of 0, a negative power
    of 0) would reach attention as NaN. ``mean`` over the last dim only, kept as a dim (so each
    position still reads only its own features); ``pow`` by a positive number; ``rsqrt`` of an
    inside value plus a positive constant."""
    target, args, kwargs = node.target, node.args, node.kwargs
    if target in (torch.mean, "mean"):
        out = value(node)
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
        keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        return (isinstance(dim, int) and isinstance(out, torch.Tensor) and dim % out.dim() == out.dim() - 1
                and keep is True and not kwargs.get("dtype"))
    if target in (torch.pow, operator.pow, "pow"):
        exponent = args[1] if len(args) > 1 else kwargs.get("exponent")
        return isinstance(exponent, (int, float)) and not isinstance(exponent, bool) and exponent > 0 \
            and isinstance(args[0], Node) and inside(args[0])
    if target in (torch.rsqrt, "rsqrt"):
        (x,) = args[:1] or (None,)
        if not (isinstance(x, Node) and x.op in ("call_function", "call_method") and x.target in _ADDS
                and len(x.args) == 2):
            return False
        consts = [a for a in x.args if not isinstance(a, Node)]
        return len(consts) == 1 and isinstance(consts[0], (int, float)) and consts[0] > 0
    return True


def _last_dim_slice(index: Any, ndim: int) -> bool:
    """``x[..., a:b]`` or ``x[:, :, :, a:b]``: a slice of the last dim only."""
    if not isinstance(index, tuple) or not index or not isinstance(index[-1], slice):
        return False
    last = index[-1]
    if not all(v is None or isinstance(v, int) for v in (last.start, last.stop, last.step)):
        return False
    lead = index[:-1]
    if lead == (Ellipsis,):
        return True
    return len(index) == ndim and all(i == slice(None) for i in lead)


def per_position_op(node: Node, inside: Callable[[Any], bool]) -> bool:
    """``node`` computes each (batch, position) of its output from the same one of its ``inside``
    operands (tensors laid out ``[..., features]``) and from operands that ``inside`` rejects
    (computed without the padded tensors: cos/sin of the positions), which may broadcast.

    A strict list, with shapes checked: an inside operand has the output's rank and leading dims (it
    is never broadcast along a position), and only the last dim is sliced or concatenated."""
    out = value(node)
    if not isinstance(out, torch.Tensor) or out.dim() < 2:
        return False
    operands = [a for a in list(node.args) + list(node.kwargs.values())]
    interleaved = _interleave_op(node, out, inside)
    if interleaved is not None:
        return interleaved
    if node.op == "call_function" and node.target is torch.cat:
        parts = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if not isinstance(parts, (list, tuple)) or not isinstance(dim, int) or dim % out.dim() != out.dim() - 1:
            return False
        operands = list(parts)
    elif node.op == "call_function" and node.target is operator.getitem:
        src = value(node.args[0])
        if not inside(node.args[0]) or not isinstance(src, torch.Tensor) \
                or not _last_dim_slice(node.args[1], src.dim()):
            return False
        operands = [node.args[0]]
    elif node.op == "call_method" and node.target in _CHAIN_METHODS:
        if node.target == "to" and any(isinstance(a, torch.Tensor) or isinstance(value(a), torch.Tensor)
                                       for a in node.args[1:]):
            return False
    elif not (node.op == "call_function" and node.target in _CHAIN_FUNCTIONS):
        return False
    target = node.target
    ins = [a for a in operands if isinstance(a, Node) and inside(a)]
    if not ins or not _norm_op_safe(node, inside):
        return False
    if target in _DIVIDES and len(node.args) > 1 and isinstance(node.args[1], Node) and inside(node.args[1]):
        return False   # a padding position's zeros would divide into inf/NaN values
    for a in operands:
        v = value(a)
        if isinstance(a, Node) and inside(a):
            if not isinstance(v, torch.Tensor) or v.dim() != out.dim() or len(v.shape) < 2 \
                    or not all(_same(x, y) for x, y in zip(v.shape[:-1], out.shape[:-1])):
                return False
        elif isinstance(v, torch.Tensor):
            if v.dim() > out.dim():
                return False
        elif not isinstance(v, (int, float, bool, torch.dtype, torch.device, type(None), str)):
            return False
    return True


def _interleave_op(node: Node, out: torch.Tensor, inside: Callable[[Any], bool]) -> Optional[bool]:
    """An interleaved rotary embedding's ``rotate_half`` (GLM-4, Cohere 2, Helium): its halves are
    ``x[..., ::2]`` and ``x[..., 1::2]`` (last-dim slices, taken above), then
    ``torch.stack((-x2, x1), dim=-1).flatten(-2)``. The stack pairs each feature with the same one
    of the other operand at the same position, and the flatten merges the last two dims back: both
    act on each position alone. None where ``node`` is neither; else whether it qualifies."""
    if node.op == "call_function" and node.target is torch.stack:
        parts = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if not isinstance(parts, (list, tuple)) or not isinstance(dim, int) or dim % out.dim() != out.dim() - 1:
            return False
        values = [value(p) for p in parts]
        return bool(parts) and all(isinstance(p, Node) and inside(p) and isinstance(v, torch.Tensor)
                                   and tuple(v.shape) == tuple(out.shape[:-1]) for p, v in zip(parts, values))
    if node.op == "call_method" and node.target == "flatten":
        x = value(node.args[0])
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
        if not isinstance(x, torch.Tensor) or not isinstance(node.args[0], Node) or not inside(node.args[0]):
            return False
        return isinstance(start, int) and isinstance(end, int) and x.dim() >= 3 and \
            start % x.dim() == x.dim() - 2 and end % x.dim() == x.dim() - 1
    return None


def autocast_dtype_at(node: Node, device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast casts SDPA's inputs to at ``node`` on ``device_type`` (its lower precision),
    or None where it is off: the autocast the capture runs under (dynamo guards on it, so the graph
    never runs under another), then the model's own ``torch.autocast`` blocks entered before
    ``node`` in the graph and not yet left."""
    try:
        on = torch.is_autocast_enabled(device_type)
        state: List[Optional[torch.dtype]] = [torch.get_autocast_dtype(device_type) if on else None]
    except (RuntimeError, ValueError):   # a device type without autocast
        return None
    entered: Dict[Node, int] = {}
    for n in node.graph.nodes:
        if n is node:
            break
        if n.op == "call_function" and n.target is AUTOCAST_ENTER and n.args and n.args[0] == device_type:
            args = dict(zip(("device_type", "dtype", "enabled", "cache_enabled"), n.args), **n.kwargs)
            dtype = args.get("dtype") or torch.get_autocast_dtype(device_type)
            entered[n] = len(state)
            state.append(dtype if args.get("enabled") in (True, None) else None)
        elif n.op == "call_function" and n.target is AUTOCAST_EXIT and n.args and n.args[0] in entered:
            del state[entered.pop(n.args[0]):]
    return state[-1]


def as_sdpa_sees_them(graph: torch.fx.Graph, sdpa: Node, tensors: List[Node],
                      args: Optional[Dict[str, Any]] = None) -> List[Node]:
    """q, k and v for ``varlen_attention`` in place of ``sdpa`` (``args``: its arguments, for an
    attention in eager ops), cast as autocast would cast SDPA's (inserted at the graph's insert
    point). The custom op is on no autocast list, and under bf16 autocast a Llama-style rotary
    embedding leaves q and k in float32 (its cos and sin are) beside a bf16 v: eager's SDPA casts
    all three; the CPU flash kernel refused the mix ("expected scalar type Float but found
    BFloat16") and every such capture fell back to eager. Without autocast, q and k of another
    dtype than v (GPT-J casts them to float32 for its scores) are cast to v's, the dtype eager's
    output has."""
    args = args if args is not None else sdpa_arguments(sdpa)
    q, v = value(args["query"]), value(args["value"])
    device = q.device.type if isinstance(q, torch.Tensor) else None
    dtype = autocast_dtype_at(sdpa, device) if device is not None else None
    if dtype is None:
        if not isinstance(v, torch.Tensor):
            return tensors
        dtype = v.dtype
        return [x if value(a) is not None and value(a).dtype == dtype else graph.call_method("to", (x, dtype))
                for x, a in zip(tensors, (args["query"], args["key"], args["value"]))]
    return [graph.call_method("to", (x, dtype)) for x in tensors]


def sdpa_arguments(node: Node) -> Dict[str, Any]:
    """The SDPA call's arguments by name (defaults filled in)."""
    bound: Dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                             "enable_gqa": False}
    bound.update(zip(_SDPA_PARAMS, node.args))
    bound.update(node.kwargs)
    return bound


def mask_kind(attn_mask: Any, tokens: torch.Tensor) -> Optional[bool]:
    """For the capturing batch: False when every real query may see exactly the real keys of its
    sequence, True when exactly those at or before it (causal), None otherwise. An additive mask
    must be 0 or hide (``-inf``, the dtype's lowest value) at every real query's key: a finite bias
    elsewhere would give a key weight that the per-sequence kernel leaves out."""
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dim() != 4:
        return None
    b, s = tokens.shape
    try:
        m = attn_mask.expand(b, attn_mask.shape[1], s, s)
    except RuntimeError:
        return None
    allowed = m if m.dtype == torch.bool else m == 0
    real_q = tokens[:, None, :, None]
    if m.dtype != torch.bool and bool((~allowed & (m > torch.finfo(m.dtype).min) & real_q).any()):
        return None
    real_k = tokens[:, None, None, :]
    pos = torch.arange(s, device=tokens.device)
    for causal in (True, False):   # a batch of one-token sequences fits both: causal is the stricter
        expected = real_k & (pos[None, :] <= pos[:, None]) if causal else real_k
        if not bool(((allowed != expected) & real_q).any()):
            return causal
    return None


@dataclass(eq=False)
class Attention:
    """One attention as the rewrite sees it: SDPA's arguments by name (``sdpa_arguments``), the
    node whose value is its ``[batch, heads, seq, dim]`` output, and the nodes that go once it is
    replaced: an SDPA call alone, or a block written in eager ops with all of its own
    (``eager_attention.EagerAttention.sdpa_equivalent``)."""

    out: Node
    args: Dict[str, Any]
    own: List[Node]

    @classmethod
    def of_sdpa(cls, node: Node) -> "Attention":
        return cls(node, sdpa_arguments(node), [node])

    @property
    def name(self) -> str:
        return self.out.name


class _Match:
    def __init__(self) -> None:
        # q, k, v: (packed rows, their feature dims, first feature, features from one head's first
        # to the next's, row width, per-position chain, heads, repeats of each head)
        self.inputs: List[Tuple[Node, int, int, int, int, Optional[_Chain], int, int]] = []
        self.heads = 0
        self.dim = 0
        self.merged = True   # the gathered output is [tokens, heads * dim], not [tokens, heads, dim]
        self.gather: Optional[Node] = None
        self.gather_index: Optional[Node] = None   # the real tokens' flat positions, or some of them
        self.dead: List[Node] = []                 # what the rewrite leaves unused (erased if so)


def _layout(node: Node) -> bool:
    if node.op == "call_method":
        return node.target in _LAYOUT
    if node.op == "call_function" and node.target is operator.getitem:
        src = node.args[0]
        return isinstance(src, Node) and src.op == "call_method" and src.target in ("split", "chunk", "unbind")
    return node.op == "call_function" and node.target is torch.cat   # a key/value cache that starts empty


def _cat_source(node: Node) -> Optional[Node]:
    """The one non-empty operand of ``torch.cat`` (a cache's empty tensor and this step's keys)."""
    parts = node.args[0]
    nonempty = []
    for p in parts:
        v = p.meta.get("example_value", p.meta.get("val")) if isinstance(p, Node) else None
        if isinstance(v, torch.Tensor) and v.numel() == 0 and v.dim() == 1:
            continue
        nonempty.append(p)
    return nonempty[0] if len(nonempty) == 1 and isinstance(nonempty[0], Node) else None


def _put_rows_above(x: Node, index: Node) -> Tuple[Optional[Node], List[Node]]:
    """The ``index_copy_`` of ``row_ops.put_rows`` that ``x`` is a layout of, and the path to it."""
    path: List[Node] = []
    node = x
    while True:
        if node.op == "call_method" and node.target == "index_copy_" and len(node.args) == 4 \
                and node.args[1] == 0 and node.args[2] is index and isinstance(node.args[0], Node) \
                and node.args[0].op == "call_method" and node.args[0].target == "new_zeros":
            return node, path
        if not _layout(node):
            return None, path
        path.append(node)
        src = _cat_source(node) if node.op == "call_function" and node.target is torch.cat else node.args[0]
        if not isinstance(src, Node):
            return None, path
        node = src


class _Chain:
    """Ops between a head split of the re-padded rows (``entry``, ``[batch, heads, seq, dim]``) and
    attention's input that act on each position alone (``per_position_op``: rotary embeddings).
    ``sides``: their operands computed without the padded rows (cos/sin of the positions), with how
    each is laid out over the positions ("tokens": ``[batch, ., seq, .]``, "positions":
    ``[1, ., seq, .]``, "batch": ``[batch, ., 1, .]``, "keep": broadcast over every position)."""

    def __init__(self, entry: Node, nodes: List[Node], out: Node, post: List[Node], sides: Dict[Node, str],
                 swap: Optional[Node] = None) -> None:
        self.entry, self.nodes, self.out, self.post, self.sides = entry, nodes, out, post, sides
        self.swap = swap   # the head transpose among ``nodes`` (``entry`` is then [batch, seq, heads, dim])


def _below(gm: torch.fx.GraphModule, index: Node) -> Set[Node]:
    """Every node computed from a re-padding (``put_rows``) of the real tokens' rows at ``index``."""
    return descendants(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "index_copy_"
                       and len(n.args) == 4 and n.args[2] is index)


def _chain_above(gm: torch.fx.GraphModule, x: Node, index: Node) -> Tuple[Optional[_Chain], str]:
    """The per-position ops (and the head split they start from) that attention's input ``x`` is."""
    post: List[Node] = []
    y = x
    while True:
        if y.op == "call_function" and y.target is torch.cat and _cat_source(y) is not None:
            post.append(y)
            y = _cat_source(y)
        elif y.op == "call_method" and y.target == "contiguous" and isinstance(y.args[0], Node):
            post.append(y)
            y = y.args[0]
        else:
            break
    below = _below(gm, index)

    def inside(a: Any) -> bool:
        return isinstance(a, Node) and a in below

    def walk(start: Node) -> Tuple[Set[Node], Set[Node]]:
        ops: Set[Node] = set()
        entries: Set[Node] = set()
        stack = [start]
        while stack:
            node = stack.pop()
            if node in ops or node in entries:
                continue
            if inside(node) and per_position_op(node, inside):
                ops.add(node)
                stack.extend(a for a in node.all_input_nodes if inside(a))
            else:
                entries.add(node)
        return ops, entries

    ops, entries = walk(y)
    if not ops or len(entries) != 1:
        return None, "is neither a head split of the packed real tokens nor per-position ops on one"
    (entry,) = entries
    # Per-position ops before the head transpose too (HF Qwen3 norms q and k per head on
    # ``[batch, seq, heads, dim]``): the transpose is then part of the chain, an identity on the
    # packed rows' ``[tokens, heads, 1, dim]``, and the ops above it may only read operands that
    # broadcast over every position (the norm's weight).
    swap, above = None, set()
    if _head_swap(entry) and inside(entry.args[0]) and per_position_op(entry.args[0], inside):
        above, entries = walk(entry.args[0])
        if len(entries) != 1:
            return None, "is neither a head split of the packed real tokens nor per-position ops on one"
        swap, (entry,) = entry, entries
        ops |= above | {swap}
    e = value(swap if swap is not None else entry)
    if not isinstance(e, torch.Tensor) or e.dim() != 4 or not isinstance(value(entry), torch.Tensor) \
            or value(entry).dim() != 4:
        return None, "has per-position ops on something other than [batch, heads, seq, dim]"
    sides: Dict[Node, str] = {}
    for node in ops:
        for a in node.all_input_nodes:
            if inside(a):
                continue
            v = value(a)
            if node in above and not (isinstance(v, torch.Tensor) and v.dim() <= 1):
                return None, f"has a per-position op before the head transpose reading {a.name}, not a broadcast"
            if not isinstance(v, torch.Tensor):
                return None, f"has a per-position op reading {a.name}, not a tensor"
            if v.dim() <= 1:
                sides[a] = "keep"
                continue
            if v.dim() != 4:
                return None, f"has rotary-style operands ({a.name}) that are not [batch, ., seq, .]"
            per_b, per_s = not _same(v.shape[0], 1), not _same(v.shape[2], 1)
            if (per_b and not _same(v.shape[0], e.shape[0])) or (per_s and not _same(v.shape[2], e.shape[2])):
                return None, f"has rotary-style operands ({a.name}) that are not [batch, ., seq, .]"
            sides[a] = {(True, True): "tokens", (False, True): "positions", (True, False): "batch",
                        (False, False): "keep"}[(per_b, per_s)]
    nodes = [n for n in gm.graph.nodes if n in ops]
    return _Chain(entry, nodes, y, post, sides, swap), ""


def _head_swap(node: Node) -> bool:
    """``x.transpose(1, 2)`` of a 4-d ``x``: ``[batch, seq, heads, dim]`` to ``[batch, heads, seq, dim]``."""
    v = value(node)
    return (node.op == "call_method" and node.target == "transpose" and len(node.args) == 3
            and isinstance(node.args[0], Node) and set(node.args[1:]) == {1, 2} and not node.kwargs
            and isinstance(v, torch.Tensor) and v.dim() == 4)


def _token_positions(call: Callable[..., Any], kind: str, index: Any, seq: Any) -> Any:
    """Where each packed real token (flat position in ``index``) reads a side input laid out as
    ``kind`` (see ``_Chain``). ``call(f, *args)`` runs ``f`` or inserts it in a graph, so that the
    check on the capturing batch runs the very ops the graph gets."""
    if kind == "tokens":
        return index
    if kind == "positions":
        return call(torch.remainder, index, seq)
    return call(torch.div, index, seq, rounding_mode="floor")


def _side_rows(call: Callable[..., Any], side: Any, kind: str, at: Any) -> Any:
    """The rows of ``side`` (``[batch|1, h, seq|1, d]``) at ``at`` (``_token_positions``), as
    ``[tokens, h, 1, d]``: the layout the chain runs in on packed rows."""
    if kind == "keep":
        return side
    per = call(torch.transpose, side, 1, 2)                      # [batch|1, seq|1, h, d]
    src = call(torch.flatten, per, 0, 1) if kind == "tokens" else \
        call(torch.select, per, 0 if kind == "positions" else 1, 0)
    return call(torch.unsqueeze, call(torch.index_select, src, 0, at), 2)


def _chain_exact(chain: _Chain, ev: "_Evaluator", tokens: torch.Tensor, heads: int, dim: int) -> bool:
    """On the capturing batch's cos/sin and a random q: the chain run on the packed real tokens
    (``[tokens, heads, 1, dim]``, each side input's rows gathered) equals the dense chain at the
    real tokens, bit for bit."""
    b, s = tokens.shape
    e = value(chain.entry)
    drawn = ev.random((b, heads, s, dim), tokens.device)
    version = drawn._version
    probe = drawn.to(e.dtype)
    idx = tokens.flatten().nonzero().flatten()
    dense: Dict[Node, Any] = {chain.entry: probe if chain.swap is None else probe.transpose(1, 2).contiguous()}
    packed: Dict[Node, Any] = {chain.entry: probe.transpose(1, 2).reshape(b * s, heads, dim)[idx].unsqueeze(2)}

    def call(f: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return f(*args, **kwargs)

    try:
        for side, kind in chain.sides.items():
            v = ev.outside(side)
            if not isinstance(v, torch.Tensor):
                return False
            dense[side] = v
            packed[side] = _side_rows(call, v, kind, None if kind == "keep" else _token_positions(call, kind, idx, s))
        for node in chain.nodes:
            dense[node] = run_node(node, dense)
            packed[node] = packed[node.args[0]] if node is chain.swap else run_node(node, packed)
    except Exception:
        return False
    finally:
        wrote = drawn._version != version   # into its input: the shared draw is no longer what it was
        if wrote:
            ev.forget()
    want, got = dense[chain.out], packed[chain.out]
    if wrote or not isinstance(want, torch.Tensor) or want.shape != (b, heads, s, dim) \
            or got.shape != (len(idx), heads, 1, dim):
        return False
    return torch.equal(got.squeeze(2), want.transpose(1, 2).reshape(b * s, heads, dim)[idx])


def _repeated_heads(x: Node) -> Tuple[int, List[Node]]:
    """``(rep, nodes)`` when ``x`` is grouped-query attention's repeat of key/value heads
    (``y[:, :, None].expand(b, kv, rep, s, d).reshape(b, kv * rep, s, d)``, HF's repeat_kv):
    ``nodes`` from ``x`` up to the indexing of ``y``. ``(1, [])`` otherwise."""
    if x.op != "call_method" or x.target not in ("reshape", "view") or not isinstance(x.args[0], Node):
        return 1, []
    e = x.args[0]
    if e.op != "call_method" or e.target != "expand" or not isinstance(e.args[0], Node):
        return 1, []
    g = e.args[0]
    if g.op != "call_function" or g.target is not operator.getitem or not isinstance(g.args[0], Node) \
            or not isinstance(g.args[1], tuple) or g.args[1][:3] != (slice(None), slice(None), None) \
            or any(i != slice(None) for i in g.args[1][3:]):
        return 1, []
    vx, ve, vy = value(x), value(e), value(g.args[0])
    if not all(isinstance(v, torch.Tensor) for v in (vx, ve, vy)) or vy.dim() != 4 or ve.dim() != 5 \
            or vx.dim() != 4 or not isinstance(ve.shape[2], int) or not isinstance(vy.shape[1], int):
        return 1, []
    rep = ve.shape[2]
    b, kv, s, d = vy.shape
    if not all(_same(p, q) for p, q in zip(ve.shape, (b, kv, rep, s, d))) \
            or not all(_same(p, q) for p, q in zip(vx.shape, (b, kv * rep, s, d))):
        return 1, []
    return rep, [x, e, g]


class _Evaluator:
    """Runs parts of the rewritten graph on the capturing batch's values, with one node's value
    replaced by a probe."""

    def __init__(self, gm: torch.fx.GraphModule, evaluate: Any) -> None:
        self.gm, self.evaluate = gm, evaluate
        self.known: Dict[Node, Any] = {}
        self._numbers: Optional[torch.Tensor] = None
        self._random: Dict[Tuple[Tuple[int, ...], str], torch.Tensor] = {}

    def numbered(self, shape: Tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A probe of ``shape`` whose values number its elements (0, 1, ...; float64, exact to
        2 ** 53). Views of one tensor made once per capture: a probe is as large as the capturing
        batch's activations, and making each anew cost more than the rest of the matching (BERT-base
        at 32 x 512: 48 probes of 12.6 M values, 1.7 s of ``arange`` on the CPU). ``run`` refuses a path that
        writes into its probe, so the numbers stay true."""
        n = math.prod(shape)
        have = self._numbers
        if have is None or have.numel() < n or have.device != torch.device(device):
            have = self._numbers = torch.arange(n, dtype=torch.float64, device=device)
        return have[:n].view(shape)

    def random(self, shape: Tuple[int, ...], device: torch.device) -> torch.Tensor:
        """Standard normal float64 values of ``shape``, the same for every call with that shape: drawn
        once per capture on ``device`` (drawing on the host and copying was ~0.2 s per rotary chain at
        a GPU's batch sizes). Callers must not write into it."""
        key = (tuple(shape), str(device))
        if key not in self._random:
            g = torch.Generator(device=device).manual_seed(0)
            self._random[key] = torch.randn(shape, generator=g, dtype=torch.float64, device=device)
        return self._random[key]

    def outside(self, node: Node) -> Any:
        if node not in self.known:
            self.known[node] = self.evaluate(self.gm, node)
        return self.known[node]

    def run(self, start: Node, probe: torch.Tensor, end: Node) -> Optional[Any]:
        """``end``'s value with ``start``'s replaced by ``probe``; None where a node fails or writes
        into the probe (its version counter moves: the numbers would no longer be true)."""
        version = probe._version
        env: Dict[Node, Any] = {start: probe}
        needed = ancestors(end)
        for node in self.gm.graph.nodes:
            if node is start or node not in needed or not any(a in env for a in node.all_input_nodes):
                continue
            try:
                for a in node.all_input_nodes:
                    if a not in env:
                        env[a] = self.outside(a)
                env[node] = run_node(node, env)
            except Exception:
                return None
        if probe._version != version:
            self.forget()
            return None
        return env.get(end)

    def forget(self) -> None:
        """Drop the shared probes (one was written into): later ones are made anew."""
        self._numbers = None
        self._random.clear()


def _splits_features(out: torch.Tensor, rows: torch.Tensor, first: int, heads: int, dim: int,
                     stride: int) -> bool:
    """Whether ``out`` (``[batch, heads, seq, dim]``, made from ``rows``, ``[batch, seq, features]``,
    whose values number each element) holds, for head ``h``, each token's ``dim`` features from
    ``first + h * stride``: heads one after another (``stride == dim``), or each head's q, k and v
    side by side in one block of ``stride`` features (GPT-NeoX's fused projection viewed as
    ``[batch, seq, heads, 3 * dim]`` and chunked). One comparison on the graph's device, against
    ``rows``: the probes are as large as the capturing batch's activations (BERT-base at 32 x 512:
    12.6 M values per q, k and v of each layer), so copying them to the host and decoding each
    value's row and feature there took seconds of the first step."""
    if first < 0 or stride < dim or first % stride + dim > stride \
            or first - first % stride + heads * stride > rows.shape[2]:
        return False
    at = first + torch.arange(heads, device=rows.device)[:, None] * stride + torch.arange(dim, device=rows.device)
    return torch.equal(out.transpose(1, 2), rows[:, :, at])   # [batch, seq, heads, dim]


def _match(gm: torch.fx.GraphModule, attention: Attention, index: Node, tokens: torch.Tensor,
           ev: _Evaluator, real_rows: Set[Node]) -> Tuple[Optional[_Match], str]:
    args = attention.args
    if not isinstance(args["dropout_p"], (int, float)) or args["dropout_p"] != 0:
        return None, "attention dropout is on (its mask over the padded layout has no per-sequence form)"
    if args["is_causal"] is not False or args["enable_gqa"] is not False:
        return None, "is_causal or enable_gqa set next to a mask"
    if args["scale"] is not None and not isinstance(args["scale"], (int, float)):
        return None, "the scale is not a constant"
    b, s = tokens.shape
    match = _Match()
    for name in ("query", "key", "value"):
        x = args[name]
        if not isinstance(x, Node):
            return None, f"its {name} is not a head split of the packed real tokens"
        rep, repeat = (1, []) if name == "query" else _repeated_heads(x)
        if repeat:
            x = repeat[-1].args[0]
        put, path = _put_rows_above(x, index)
        chain = None
        if put is None:
            chain, why = _chain_above(gm, x, index)
            if chain is None:
                return None, f"its {name} {why}"
            put, path = _put_rows_above(chain.entry, index)
            if put is None:
                return None, f"its {name} is not per-position ops on a head split of the packed real tokens"
            x = chain.entry
        zeros = put.args[0]
        features = zeros.args[1][1:] if isinstance(zeros.args[1], (tuple, list)) else ()
        if not features or not all(isinstance(d, int) for d in features):
            return None, f"its {name} rows are not of constant features"
        # Rows of [heads, dim] where the padded region reaches past the head split (Gemma 4's q/k
        # norms and rotary embedding before the heads' transpose): flattened, they are the vectors
        # a head split of the projection would re-pad.
        f = math.prod(features)
        # The probe's values number each (row, feature); on the graph's device: the path may meet
        # outside values there (HF's DynamicLayer cats onto an empty cache tensor made on the keys'
        # device), which a host probe cannot join.
        probe = ev.numbered((b * s, f), tokens.device)
        out = ev.run(put, probe.view(b * s, *features), x)
        if chain is not None and chain.swap is not None and isinstance(out, torch.Tensor) and out.dim() == 4:
            out = out.transpose(1, 2)   # the chain's own transpose makes it [batch, heads, seq, dim]
        if not isinstance(out, torch.Tensor) or out.dim() != 4 or out.shape[0] != b or out.shape[2] != s:
            return None, f"its {name} is not [batch, heads, seq, dim] of the re-padded rows"
        heads, dim = out.shape[1], out.shape[3]
        corner = float(out[0, 0, 0, 0])       # token 0's first feature in the heads
        first = int(corner) if corner.is_integer() else -1
        after = float(out[0, 1, 0, 0]) if heads > 1 else corner + dim   # ... and in the second head
        stride = int(after) - first if after.is_integer() else -1
        if not _splits_features(out, probe.view(b, s, f), first, heads, dim, stride):
            return None, f"its {name} does not split each token's features into heads"
        if match.heads and (heads * rep, dim) != (match.heads, match.dim):
            return None, "q, k and v differ in heads or head size"
        match.heads, match.dim = heads * rep, dim
        if chain is not None and not _chain_exact(chain, ev, tokens, heads, dim):
            return None, f"its {name}'s per-position ops differ when run on the packed real tokens"
        match.inputs.append((put.args[3], len(features), first, stride, f, chain, heads, rep))
        match.dead += repeat + path + [put, zeros]
        if chain is not None:
            match.dead += chain.post + chain.nodes[::-1]
    node, path = attention.out, []
    while True:
        users = list(node.users)
        if len(users) != 1:
            return None, "its output is read outside the gather of real tokens"
        (user,) = users
        sel = row_selection(user)
        if sel is not None and sel[0] is node and (sel[1] is index or user in real_rows):
            match.gather, match.gather_index = user, sel[1]
            break
        if not _layout(user) or user.args[0] is not node:
            return None, "its output is read outside the gather of real tokens"
        path.append(user)
        node = user
    probe = ev.numbered((b, match.heads, s, match.dim), tokens.device)
    out = ev.run(attention.out, probe, node)
    # [tokens, heads * dim], or [tokens, heads, dim] where the region starts before the heads' merge
    match.merged = isinstance(out, torch.Tensor) and tuple(out.shape) == (b * s, match.heads * match.dim)
    if not isinstance(out, torch.Tensor) or not match.merged and tuple(out.shape) != (b * s, match.heads, match.dim) \
            or not torch.equal(out.reshape(b, s, match.heads, match.dim), probe.transpose(1, 2)):
        return None, "its output is not merged back head after head"
    match.dead += [match.gather] + path[::-1] + attention.own
    return match, ""


def _chain_on_rows(graph: torch.fx.Graph, chain: _Chain, packed: Node, side_rows: Callable[[Node, str], Node]) -> Node:
    """``chain`` copied onto the packed ``[tokens, heads, dim]`` rows: run as ``[tokens, heads, 1,
    dim]`` (the dense layout's rank, each token its own position) with each side input's rows."""
    env: Dict[Node, Any] = {chain.entry: graph.call_function(torch.unsqueeze, (packed, 2))}
    for side, kind in chain.sides.items():
        env[side] = side_rows(side, kind)
    for node in chain.nodes:
        if node is chain.swap:   # the packed layout already has heads before positions
            env[node] = env[node.args[0]]
            continue
        env[node] = graph.node_copy(node, lambda a: env[a])
        env[node].meta = {}
    return graph.call_function(torch.squeeze, (env[chain.out], 2))


def erase_replaced(graph: torch.fx.Graph, nodes: List[Node]) -> None:
    """Erase ``nodes`` (the replaced attention, its re-padding) once unused, then whatever pure
    computation only they read (the padded mask)."""
    todo = list(nodes)
    erased: Set[Node] = set()
    while todo:
        node = todo.pop(0)
        if node in erased or node.users or node.op in ("placeholder", "output", "get_attr"):
            continue
        if node not in nodes:
            name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
            if node.op not in ("call_function", "call_method") or str(name).endswith("_"):
                continue
        inputs = list(node.all_input_nodes)
        graph.erase_node(node)
        erased.add(node)
        todo.extend(inputs)
        todo.extend(n for n in nodes if n not in erased)  # one that waited for this node's use to go


def _require_mask(builder: GuardBuilder, mask: Node, attn_mask: Node, pad: int, causal: bool,
                  mask_dtype: torch.dtype) -> bool:
    """Write into the batch guard: every batch's mask, on real queries, is the kind relied on."""
    g_attn = builder.node(attn_mask)
    g_mask = builder.node(mask)
    if g_attn is None or g_mask is None:
        return False
    g = builder.graph
    real = g.call_function(torch.ne, (g_mask, pad))
    is_bool = mask_dtype == torch.bool
    allowed = g_attn if is_bool else g.call_function(torch.eq, (g_attn, 0))
    real_q = g.call_function(operator.getitem, (real, (slice(None), None, slice(None), None)))
    expected = g.call_function(operator.getitem, (real, (slice(None), None, None, slice(None))))
    if causal:
        pos = g.call_method("cumsum", (g.call_function(torch.ones_like, (g.call_method("any", (real, 0)),),
                                                       {"dtype": torch.long}), 0))
        order = g.call_function(operator.le, (g.call_function(operator.getitem, (pos, (None, slice(None)))),
                                              g.call_function(operator.getitem, (pos, (slice(None), None)))))
        expected = g.call_function(operator.and_, (expected, order))
    wrong = g.call_function(operator.ne, (allowed, expected))
    if not is_bool:   # a finite bias is neither kind (mask_kind)
        biased = g.call_function(operator.and_, (g.call_function(torch.logical_not, (allowed,)), g.call_function(
            torch.gt, (g_attn, torch.finfo(mask_dtype).min))))
        wrong = g.call_function(operator.or_, (wrong, biased))
    bad = g.call_function(operator.and_, (wrong, real_q))
    ok = g.call_function(torch.logical_not, (g.call_method("any", (bad,)),))
    kind = "causal" if causal else "bidirectional"
    builder.require(ok, f"the attention mask is not the padding mask ({kind}) the per-sequence attention relies on")
    return True


def attention_on_real_tokens(gm: torch.fx.GraphModule, plans: Plans, kinds: Dict[Attention, Optional[bool]],
                             index: Node, packed_row: Callable[[], Node], real_rows: Set[Node], mask: Node,
                             pad: int, tokens: torch.Tensor, evaluate: Any) -> Tuple[int, List[str]]:
    """Replace each re-padded attention of ``kinds`` (attention -> causal, or None when its mask
    fits neither kind) by ``varlen_attention`` on the packed rows. ``index``: the real tokens' flat
    positions; ``packed_row()``: each flat position's row among them; ``real_rows``: gathers of
    padded values whose rows the batch guard checks are real (the labelled rows of label sparsity).
    Returns how many were replaced and why the others were not."""
    graph = gm.graph
    ev = _Evaluator(gm, evaluate)
    why: List[str] = []
    lengths: Optional[Node] = None
    guarded: Dict[Tuple[Node, bool], bool] = {}
    builder = GuardBuilder.of(gm, plans)
    done = 0
    gathered: Dict[Node, Node] = {}
    positions: Dict[str, Node] = {}

    def call(f: Callable[..., Any], *args: Any, **kwargs: Any) -> Node:
        return graph.call_function(f, args, kwargs)

    def side_rows(side: Node, kind: str) -> Node:
        """``_side_rows`` in the graph, once per side input, right where that input is made."""
        if side not in gathered:
            at = None
            if kind != "keep":
                if kind not in positions:
                    with graph.inserting_before(index.next):   # right after the real tokens' index
                        seq = graph.call_method("size", (mask, 1))
                        positions[kind] = _token_positions(call, kind, index, seq)
                at = positions[kind]
            with graph.inserting_before(side.next):
                gathered[side] = _side_rows(call, side, kind, at)
        return gathered[side]

    for attention, causal in kinds.items():
        if causal is None:
            why.append(f"{attention.name}: its mask is not padding plus causal order")
            continue
        match, reason = _match(gm, attention, index, tokens, ev, real_rows)
        if match is None:
            why.append(f"{attention.name}: {reason}")
            continue
        attn_mask = attention.args["attn_mask"]
        key = (attn_mask, causal)
        if key not in guarded:
            mask_value = ev.outside(attn_mask)
            guarded[key] = isinstance(mask_value, torch.Tensor) and _require_mask(
                builder, mask, attn_mask, pad, causal, mask_value.dtype)
        if not guarded[key]:
            why.append(f"{attention.name}: its mask cannot be checked before each step")
            continue
        if lengths is None:
            first = next(n for n in graph.nodes if n.op != "placeholder")
            with graph.inserting_before(first):
                lengths = host_numbers(gm, plans, graph.call_function(torch.ne, (mask, pad)), HOST_ROW_LENGTHS)
        scale = attention.args["scale"]
        scale = float(scale) if scale is not None else match.dim ** -0.5
        with graph.inserting_before(attention.out):
            packed = []
            for rows, feature_dims, first, stride, width, chain, heads, rep in match.inputs:
                if feature_dims > 1:
                    rows = graph.call_method("flatten", (rows, 1))
                base = first - first % stride   # where head 0's block of ``stride`` features starts
                if base or width != heads * stride:   # q, k or v is a part of each row (GPT-2's fused c_attn)
                    rows = graph.call_method("narrow", (rows, 1, base, heads * stride))
                x = graph.call_method("unflatten", (rows, 1, (heads, stride)))
                if stride != match.dim:   # each head's q, k and v side by side (GPT-NeoX)
                    x = graph.call_method("narrow", (x, 2, first - base, match.dim))
                if chain is not None:
                    x = _chain_on_rows(graph, chain, x, side_rows)
                if rep > 1:   # grouped-query attention: each key/value head serves rep query heads
                    x = graph.call_function(torch.repeat_interleave, (x, rep), {"dim": 1})
                packed.append(x)
            packed = as_sdpa_sees_them(graph, attention.out, packed, attention.args)
            both = graph.call_function(VARLEN_ATTENTION, (*packed, lengths, scale, bool(causal)))
            out = graph.call_function(operator.getitem, (both, 0))
            if match.merged:
                out = graph.call_method("flatten", (out, 1))
        if match.gather_index is not index:   # some real rows (labelled ones): at their packed rows
            with graph.inserting_before(match.gather):
                at = graph.call_function(torch.index_select, (packed_row(), 0, match.gather_index))
                if match.merged:
                    out = graph.call_function(F.embedding, (at, out))
                else:
                    out = graph.call_method("unflatten", (graph.call_function(F.embedding, (at, graph.call_method(
                        "flatten", (out, 1)))), 1, (match.heads, match.dim)))
        match.gather.replace_all_uses_with(out)
        erase_replaced(graph, match.dead)
        done += 1
    builder.store(plans)
    for w in why:
        logger.info("fxtrain padding_elimination: attention stays on the padded layout: %s", w)
    return done, why
