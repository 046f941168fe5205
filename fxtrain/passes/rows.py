"""Row analysis of dynamo-level FX graphs: which ops treat the leading dims as independent rows.

A tensor of shape ``lead + features`` is a stack of rows when every op between it and some consumer
computes each output row from the same input row alone (linear layers, LayerNorm, activations,
residual adds of other row tensors, views that only regroup the leading dims). Then a consumer
that needs only some rows (a loss whose labels are mostly ignored, a classifier that reads token 0)
lets every such op run on those rows alone. The passes built on this (label sparsity, upstream
slicing) share two steps: :func:`find_region` grows the set of ops that can run on selected rows,
upstream from a seed; :func:`replay_on_rows` rebuilds that region on ``[K, *features]`` tensors.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..graph_walk import ancestors, descendants, run_node  # noqa: F401  (the passes import them from here)
from ..torch_private import NN_GELU, NN_LINEAR, NN_SDPA, NN_SILU, size_hint
from ..runtime.host_counts import HOST_COUNT, HOST_DOCUMENT_LENGTHS, HOST_ROW_LENGTHS
from .row_ops import take_rows

Node = torch.fx.Node

# Ops that act on each element, or broadcast an operand that has no leading dims. Activations of
# current families among them: Nemotron's squared ReLU (square), Apertus's xIELU (gt, where, expm1,
# clamp, softplus), besides GELU/SiLU/tanh.
_ELEMENTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow, operator.abs,
    operator.gt, operator.ge, operator.lt, operator.le, operator.eq, operator.ne,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.tanh, torch.sigmoid,
    torch.relu, torch.rsqrt, torch.sqrt, torch.exp, torch.expm1, torch.log, torch.log1p, torch.erf,
    torch.where, torch.square, torch.abs, torch.sign, torch.clamp, torch.clip, torch.minimum, torch.maximum,
    torch.gt, torch.ge, torch.lt, torch.le, torch.eq, torch.ne, torch.sin, torch.cos, torch.reciprocal,
    F.relu, F.gelu, F.silu, F.tanh, F.sigmoid, F.dropout, F.softplus, F.elu, F.leaky_relu, F.mish,
    F.hardswish, F.hardsigmoid, F.relu6, NN_GELU, NN_SILU,
}
_ELEMENTWISE_METHODS = {
    "add", "sub", "mul", "div", "neg", "pow", "tanh", "sigmoid", "relu", "rsqrt", "sqrt", "exp", "expm1",
    "log", "log1p", "erf", "square", "abs", "sign", "clamp", "clip", "minimum", "maximum", "reciprocal",
    "gt", "ge", "lt", "le", "eq", "ne", "sin", "cos",
    "float", "half", "bfloat16", "double", "to", "type_as", "contiguous", "clone",
}
# torch.min/max of two tensors (xIELU's ``torch.min(x, eps)``); of one, or over a dim, they reduce.
_BINARY_FUNCTIONS = {torch.min, torch.max}
_BINARY_METHODS = {"min", "max"}


# In-place arithmetic (Gemma 4's ``hidden_states *= self.layer_scalar``) on a tensor of its own
# that nothing else reads: the same as its out-of-place op, which the row form runs instead.
_IN_PLACE = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
             operator.itruediv: operator.truediv}


def _out_of_place(node: Node) -> bool:
    if node.op != "call_function" or node.target not in _IN_PLACE or node.kwargs or len(node.args) != 2:
        return False
    x = node.args[0]   # made by an op that allocates its output (not F.relu(..., inplace=True): an alias)
    if not isinstance(x, Node) or x.op != "call_function":
        return False
    fresh = x.target in (_ELEMENTWISE_FUNCTIONS | _LINEAR_FUNCTIONS) - {F.dropout} and True not in x.args[1:] \
        and not x.kwargs.get("inplace") or x.target is operator.getitem and topk_rows(x.args[0]) is not None
    return fresh and _read_before(x, node)


def _read_before(x: Node, node: Node) -> bool:
    """Every other reader of ``x`` runs before ``node`` mutates it, so that it reads what the out-of-place
    op leaves in ``x`` too (Mixtral's ``w /= w.sum(-1, keepdim=True)``). A reader after ``node`` would
    see the mutation (an alias read later), which the out-of-place op would not make."""
    others = set(x.users) - {node}
    at = x.next
    while others and at is not node and at.op != "root":
        others.discard(at)
        at = at.next
    return not others


def _elementwise(node: Node) -> bool:
    if node.op == "call_function" and node.target in _ELEMENTWISE_FUNCTIONS or \
            node.op == "call_method" and node.target in _ELEMENTWISE_METHODS or _out_of_place(node):
        return True
    return (node.op == "call_function" and node.target in _BINARY_FUNCTIONS or
            node.op == "call_method" and node.target in _BINARY_METHODS) and \
        len(node.args) == 2 and not node.kwargs and _tensor(node.args[1]) is not None


_LINEAR_FUNCTIONS = {NN_LINEAR, F.linear}
_CAT_FUNCTIONS = {torch.cat, torch.concat}
_MATMUL_FUNCTIONS = {torch.matmul, operator.matmul}
_SOFTMAX_FUNCTIONS = {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax}
_SOFTMAX_METHODS = {"softmax", "log_softmax"}
_REDUCE_FUNCTIONS = {torch.mean, torch.sum}
_REDUCE_METHODS = {"mean", "sum"}
_VIEW_METHODS = {"view", "reshape"}


def value(node: Any) -> Any:
    """The fake value dynamo recorded for a node (or the constant itself)."""
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, Node) else node


def _tensor(node: Any) -> Optional[torch.Tensor]:
    v = value(node)
    return v if isinstance(v, torch.Tensor) else None


def _same(a: Any, b: Any) -> bool:
    return statically_known_true(a == b) if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt) else a == b


def _same_shape(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def same_shape_guarded(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Like ``_same_shape``, but sizes that are equal on the capturing batch and not known equal are
    made equal by a guard (a later call where they differ recaptures).

    For inputs that must agree by construction (ids and their attention mask): after a static
    capture, dynamo's symbolic recapture gives each input's sizes their own symbols, so nothing
    proves ``mask.shape == ids.shape`` although every working call has it.
    """
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if _same(x, y):
            continue
        hints = [v.node.hint if isinstance(v, torch.SymInt) else v for v in (x, y)]
        if None in hints or hints[0] != hints[1]:
            return False
    return all(bool(x == y) for x, y in zip(a, b))  # bool() of a SymBool installs the guard


def op_name(node: Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def _is_identity_index(index: Any) -> bool:
    return all(item is Ellipsis or (isinstance(item, slice) and item.start in (None, 0) and item.stop is None
                                    and item.step in (None, 1))
               for item in (index if isinstance(index, tuple) else (index,)))


def _features_index(index: Any, ndim: int, lead: int) -> Optional[Tuple[Any, ...]]:
    """The row form's index for ``x[index]`` when it indexes the features alone (``ndim`` dims, the
    first ``lead`` of them rows) with ints and int-bounded slices, else None. Written after an
    ellipsis it is the same index (q, k and v out of one fused projection: HF Phi-3's
    ``qkv[..., :query_pos]``); after ``lead`` full slices, those become one (Gemma 4's
    ``per_layer_inputs[:, :, l, :]``)."""
    if not isinstance(index, tuple):
        return None
    plain = lambda item: isinstance(item, int) and not isinstance(item, bool) or isinstance(item, slice) and \
        all(v is None or isinstance(v, int) for v in (item.start, item.stop, item.step))   # noqa: E731
    if index and index[0] is Ellipsis and 0 < len(index) - 1 <= ndim - lead and all(plain(i) for i in index[1:]):
        return index
    whole = slice(None)
    if len(index) > lead and all(i == whole for i in index[:lead]) and len(index) <= ndim and \
            all(plain(i) for i in index[lead:]):
        return (whole, *index[lead:])
    return None


def features_split(node: Node) -> Optional[Node]:
    """The tensor ``node`` splits along its last dim, written as ``dim=-1`` so that it means the same
    on the row form (``x.chunk(2, dim=-1)``, ``x.split(n, -1)``: HF Phi-3's gate and up halves of
    one projection), else None. Its pieces are taken by ``getitem``."""
    if node.op != "call_method" or node.target not in ("chunk", "split") or not isinstance(node.args[0], Node):
        return None
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    x = _tensor(node.args[0])
    if dim != -1 or x is None or x.dim() < 2 or set(node.kwargs) - {"dim"}:
        return None
    return node.args[0]


def topk_rows(node: Any) -> Optional[Node]:
    """The tensor whose last dim ``node`` takes the top k of (a mixture of experts' router: HF
    Mixtral, Qwen3-MoE), else None. Its values and indices are taken by ``getitem``."""
    if not isinstance(node, Node) or not (node.op == "call_function" and node.target is torch.topk or
                                          node.op == "call_method" and node.target == "topk"):
        return None
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else -1)
    x = _tensor(node.args[0])
    if dim != -1 or len(node.args) > 3 or set(node.kwargs) - {"dim", "largest", "sorted"} or x is None or x.dim() < 2:
        return None
    return node.args[0]


def _feature_dim(dim: Any, ndim: int, lead: int) -> bool:
    return isinstance(dim, int) and (dim % ndim) >= lead if ndim else False


def row_inputs(node: Node, lead: int, broadcast: Optional[Set[Node]] = None,
               token_rows: bool = False) -> Optional[List[Tuple[Node, int]]]:
    """The inputs of ``node`` that must be row-selected when ``node``'s first ``lead`` dims are rows.

    ``token_rows``: the rows are tokens (padding elimination's ``[batch, seq]``), and a view or an
    int index of the dims after them (Gemma 4's per-layer inputs) is taken as a row op. Not for
    label sparsity and upstream slicing, which grow regions upstream from a selection whose rows may
    be whole sequences: there ``h[:, 0, :]`` at one row dim, taken as a row op, let label sparsity
    on RoBERTa's classification logits grow into the encoder, and a later symbolic capture failed
    ("Expected target size [u0, 3], got [u0]": the fuzzer's roberta-cls, custom loss, seed 1, batch
    25). An index written after an ellipsis (Phi-3's ``qkv[..., :n]``) is a row op for every pass.

    Returns a list of (input, its number of leading dims), or None when ``node`` mixes rows (or is
    an op this analysis does not know), so that it has to be computed in full. An elementwise
    operand broadcast along the rows (a ``[1, seq, hidden]`` position embedding) fails the node
    unless ``broadcast`` is given: then it is listed and added to that set (the caller expands it).
    """
    out = _tensor(node)
    if out is None or lead < 1 or lead > out.dim():
        return None
    features = out.dim() - lead
    target, args, kwargs = node.target, node.args, node.kwargs
    if node.op == "call_function" and target in _LINEAR_FUNCTIONS:
        x = args[0]
        return [(x, lead)] if _rows_of(x, out.shape[:lead], lead) else None
    if node.op == "call_function" and target is torch.addmm:
        bias, x, w = args[:3]
        if lead != 1 or (_tensor(bias) is not None and _tensor(bias).dim() > 1) or kwargs:
            return None
        return [(x, 1)] if _rows_of(x, out.shape[:1], 1) else None
    if node.op == "call_function" and target in _MATMUL_FUNCTIONS:
        x, w = args[:2]
        wt = _tensor(w)
        if wt is None or wt.dim() != 2 or features < 1:
            return None
        return [(x, lead)] if _rows_of(x, out.shape[:lead], lead) else None
    if node.op == "call_function" and target is F.layer_norm:
        shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
        if len(shape) > features:
            return None
        return [(args[0], lead)] if _rows_of(args[0], out.shape[:lead], lead) else None
    if (node.op == "call_function" and target in _SOFTMAX_FUNCTIONS) or \
            (node.op == "call_method" and target in _SOFTMAX_METHODS):
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if not _feature_dim(dim, out.dim(), lead):
            return None
        return [(args[0], lead)] if _rows_of(args[0], out.shape[:lead], lead) else None
    if (node.op == "call_function" and target in _REDUCE_FUNCTIONS) or \
            (node.op == "call_method" and target in _REDUCE_METHODS):
        x = _tensor(args[0])
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        dims = dims if isinstance(dims, (tuple, list)) else (dims,)
        keep = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        if x is None or not (keep or token_rows) or not dims or not all(_feature_dim(d, x.dim(), lead) for d in dims):
            return None   # without keepdim only where rows are tokens (a sum over a MoE's k slots)
        return [(args[0], lead)] if _rows_of(args[0], out.shape[:lead], lead) else None
    if node.op == "call_method" and target in _VIEW_METHODS:
        x = _tensor(args[0])
        if x is None or x.dim() - features < 1:
            return None
        if features and not _same_shape(x.shape[x.dim() - features:], out.shape[lead:]):
            # A view of the features alone (Gemma 4's per-layer inputs, [B, S, L * D] -> [B, S, L, D]).
            if token_rows and x.dim() > lead and _same_shape(x.shape[:lead], out.shape[:lead]) and \
                    all(isinstance(d, int) for d in out.shape[lead:]):
                return [(args[0], lead)]
            return None
        return [(args[0], x.dim() - features)]
    if node.op == "call_function" and target in _CAT_FUNCTIONS:
        # Along a feature dim (rotary embedding's rotate_half, ``cat((-x2, x1), dim=-1)``, where a
        # family applies it before the heads' transpose: Gemma 4).
        parts = args[0] if args else kwargs.get("tensors")
        if not _feature_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), out.dim(), lead) or \
                not isinstance(parts, (tuple, list)):
            return None
        shapes = [_tensor(a) for a in parts]
        if not all(isinstance(a, Node) and t is not None and t.dim() == out.dim() and
                   _same_shape(t.shape[:lead], out.shape[:lead]) for a, t in zip(parts, shapes)):
            return None
        return [(a, lead) for a in parts]
    if node.op == "call_method" and target == "flatten" and token_rows and not kwargs:
        # Of feature dims only (the interleaved rotary embedding's ``.flatten(-2)``); for padding
        # elimination only, as the feature views above.
        x = _tensor(args[0])
        start = args[1] if len(args) > 1 else 0
        end = args[2] if len(args) > 2 else -1
        if x is None or not (_feature_dim(start, x.dim(), lead) and _feature_dim(end, x.dim(), lead)):
            return None
        return [(args[0], lead)] if _same_shape(x.shape[:lead], out.shape[:lead]) else None
    if node.op == "call_function" and target is torch.stack:
        # Along a new feature dim (GPT-J's interleaved rotary embedding before the heads' transpose:
        # ``stack((-x2, x1), dim=-1).flatten(-2)``).
        parts = args[0] if args else kwargs.get("tensors")
        if not _feature_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), out.dim(), lead) or \
                not isinstance(parts, (tuple, list)):
            return None
        if not all(isinstance(a, Node) and _tensor(a) is not None and _tensor(a).dim() == out.dim() - 1 and
                   _same_shape(_tensor(a).shape[:lead], out.shape[:lead]) for a in parts):
            return None
        return [(a, lead) for a in parts]
    if node.op == "call_function" and target is operator.getitem:
        x = _tensor(args[0])
        if x is None:
            return None
        if x.dim() == out.dim() and _is_identity_index(args[1]):
            return [(args[0], lead)]
        index = _features_index(args[1], x.dim(), lead)
        if features and index is not None and (token_rows or index is args[1]) and x.dim() > lead and \
                _same_shape(x.shape[:lead], out.shape[:lead]):
            return [(args[0], lead)]   # without token_rows, only an index after an ellipsis
        return None
    if _elementwise(node):
        found: List[Tuple[Node, int]] = []
        for a in list(args) + list(kwargs.values()):
            t = _tensor(a)
            if t is None or t.dim() <= features:
                continue  # a scalar, or broadcast over the rows: used as it is
            a_lead = t.dim() - features
            if not _rows_of(a, out.shape[:lead], a_lead):
                if broadcast is None or a_lead != lead or not isinstance(a, Node):
                    return None  # broadcast along the rows: rows do not map one to one
                broadcast.add(a)
            found.append((a, a_lead))
        return found
    return None


def _rows_of(x: Any, lead_shape: Sequence[Any], x_lead: int) -> bool:
    """``x`` has exactly the given rows: its leading dims multiply to the same count, unbroadcast."""
    t = _tensor(x)
    if not isinstance(x, Node) or t is None or x_lead < 1 or x_lead > t.dim():
        return False
    if x_lead == len(lead_shape):
        return _same_shape(t.shape[:x_lead], lead_shape)
    return _same(math.prod(t.shape[:x_lead]), math.prod(lead_shape))


@dataclass
class Region:
    """Ops that can run on selected rows, upstream of a seed node."""

    lead: Dict[Node, int] = field(default_factory=dict)        # node in the region -> its leading dims
    frontier: Dict[Node, int] = field(default_factory=dict)    # rows gathered from these full tensors
    outputs: List[Node] = field(default_factory=list)          # region nodes the graph also returns

    def heavy_ops(self) -> int:
        return sum(1 for n in self.lead if heavy(n))


def heavy(node: Node) -> bool:
    """An op whose cost scales with the rows times a weight: where skipping rows pays."""
    return node.op == "call_function" and (node.target in _LINEAR_FUNCTIONS or node.target is torch.addmm
                                           or node.target in _MATMUL_FUNCTIONS) or is_grouped_mm(node)


# The grouped matmul of a mixture of experts under its names: torch's own (``torch._grouped_mm``,
# ``F.grouped_mm``) and the custom op transformers registers where those have no kernel (the CPU).
_GROUPED_MM_NAMES = {"_grouped_mm", "grouped_mm", "grouped_mm_fallback"}


def is_grouped_mm(node: Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", None) in _GROUPED_MM_NAMES


def _numel(t: Any) -> int:
    return math.prod(size_hint(d) for d in t.shape)


def flops_at_capture(node: Node) -> int:
    """Forward FLOPs of a contraction of dynamo's graph at the capturing batch's sizes (2 per
    multiply-add, as in cost/flops.py; 0 for any other op, and for a node a pass inserted, which
    carries no recorded value): what a pass that runs the node on fewer rows saves in proportion."""
    out = _tensor(node)
    if out is None or node.op != "call_function":
        return 0
    if node.target in _LINEAR_FUNCTIONS or node.target in _MATMUL_FUNCTIONS or is_grouped_mm(node):
        a = _tensor(node.args[0])
        return 2 * _numel(out) * size_hint(a.shape[-1]) if a is not None and a.dim() else 0
    if node.target is torch.addmm:
        a = _tensor(node.args[1])
        return 2 * _numel(out) * size_hint(a.shape[-1]) if a is not None else 0
    return 0


def forward_flops(gm: torch.fx.GraphModule) -> int:
    """Forward FLOPs of dynamo's graph at the capturing batch's sizes: its contractions and its
    SDPA attentions (``flops_at_capture``, ``attention_flops_at_capture``)."""
    return sum(flops_at_capture(n) + (attention_flops_at_capture(n) if n.op == "call_function"
                                      and n.target in (NN_SDPA, F.scaled_dot_product_attention) else 0)
               for n in gm.graph.nodes)


def contraction_dtype(gm: torch.fx.GraphModule) -> Tuple[str, torch.dtype]:
    """(device type, dtype) of the graph's costliest contraction at capture: where and in what
    precision the FLOPs a pass skips would have run (float32 on the CPU where there is none)."""
    best = max((n for n in gm.graph.nodes if heavy(n)), key=flops_at_capture, default=None)
    out = _tensor(best) if best is not None else None
    if out is None:
        return "cpu", torch.float32
    return out.device.type, out.dtype


def attention_flops_at_capture(sdpa: Node, args: Optional[Dict[str, Any]] = None) -> int:
    """Forward FLOPs of an SDPA node (or of the attention whose output is ``sdpa`` and whose
    arguments by name are ``args``) over whole rows: scores and their product with the values."""
    args = args if args is not None else dict(zip(("query", "key"), sdpa.args), **sdpa.kwargs)
    q, k = _tensor(args.get("query")), _tensor(args.get("key"))
    out = _tensor(sdpa)
    if q is None or k is None or out is None:
        return 0
    keys = size_hint(k.shape[-2])
    return 2 * _numel(q) * keys + 2 * _numel(out) * keys


# Ops that launch no device kernel: views, metadata, and the host numbers the batch guard reads ahead.
_NO_KERNEL_METHODS = {"view", "view_as", "reshape", "flatten", "unflatten", "narrow", "transpose", "permute", "expand",
                      "unsqueeze", "squeeze", "t", "split", "chunk", "size", "dim", "to", "type_as", "detach"}


def kernel_ops(gm: torch.fx.GraphModule) -> int:
    """How many ops of ``gm`` launch a device kernel, counted by op kind (views, ``getitem``,
    arithmetic on sizes and host reads count 0): what a pass adds to every step's launches."""
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_method":
            count += node.target not in _NO_KERNEL_METHODS
        elif node.op == "call_module":
            count += 1
        elif node.op == "call_function":
            if node.target is operator.getitem or _host_only(node):
                continue
            count += 1
    return count


def _host_only(node: Node) -> bool:
    """A host read of the batch guard's numbers, or arithmetic on sizes (no tensor argument)."""
    if node.target in (HOST_COUNT, HOST_ROW_LENGTHS, HOST_DOCUMENT_LENGTHS):
        return True
    if getattr(node.target, "__module__", None) in ("_operator", "operator"):
        return not any(isinstance(_tensor(a), torch.Tensor) or (isinstance(a, Node) and "example_value" not in a.meta)
                       for a in node.all_input_nodes)
    return False


def find_region(gm: torch.fx.GraphModule, seed: Node, lead: int, allowed_users: Set[Node],
                regroup: bool = True) -> Region:
    """Grow the row region upstream from ``seed`` (whose first ``lead`` dims are rows).

    A node joins when it computes rows from rows and every user of it is in the region, is one of
    ``allowed_users`` (the consumer being rewritten) or is the graph output (then the pass must
    still return it in full: see ``Region.outputs``). Anything else that the region reads row by
    row is the frontier: computed in full as before, then gathered. With ``regroup=False`` views
    end the region, so every region and frontier node has the seed's leading shape.
    """
    region = Region()
    wanted: Dict[Node, int] = {seed: lead}
    conflicted: Set[Node] = set()
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for node in reversed(list(gm.graph.nodes)):
        if node not in wanted:
            continue
        n_lead = wanted[node]
        users_ok = all(u in region.lead or u in allowed_users or u is output for u in node.users)
        inputs = row_inputs(node, n_lead) if users_ok and node not in conflicted and node.op != "placeholder" else None
        if inputs is not None and not regroup and node.op == "call_method" and node.target in _VIEW_METHODS:
            inputs = None
        if inputs is None:
            region.frontier[node] = n_lead
            continue
        region.lead[node] = n_lead
        if output in node.users:
            region.outputs.append(node)
        for inp, in_lead in inputs:
            if inp in wanted and wanted[inp] != in_lead:
                conflicted.add(inp)
            wanted[inp] = in_lead
    return region


Select = Callable[[torch.fx.Graph, Node, int], Node]


def index_rows(index: Node) -> Select:
    """Rows of the flattened leading dims picked by a 1-d int64 ``index`` node (``row_ops.take_rows``)."""
    def select(graph: torch.fx.Graph, node: Node, lead: int) -> Node:
        flat = node if lead == 1 else graph.call_method("flatten", (node, 0, lead - 1))
        return take_rows(graph, flat, index, value(node), lead)
    return select


def replay_on_rows(gm: torch.fx.GraphModule, region: Region, select: Select, insert_before: Node) -> Dict[Node, Node]:
    """Insert, before ``insert_before``, the region's ops on the rows ``select`` picks.

    ``select`` picks the same rows of every frontier node (region and frontier nodes share their
    flattened leading dims: views only regroup them). Views inside the region become no-ops on the
    picked rows. Returns the map from original nodes to their row versions.
    """
    graph = gm.graph
    rows: Dict[Node, Node] = {}
    with graph.inserting_before(insert_before):
        for f, lead in region.frontier.items():
            rows[f] = select(graph, f, lead)
        for node in gm.graph.nodes:
            if node not in region.lead or node in rows:
                continue
            rows[node] = copy_on_rows(graph, node, rows, region.lead[node])
    return rows


def is_regroup(node: Node, lead: int) -> bool:
    """A region op that is a no-op on flattened rows (a view of the leading dims, an identity index),
    ``node``'s first ``lead`` dims being rows."""
    if node.op == "call_method" and node.target in _VIEW_METHODS:
        features = _tensor(node).shape[lead:]
        x = _tensor(node.args[0])
        return _same_shape(x.shape[x.dim() - len(features):], features)
    return node.op == "call_function" and node.target is operator.getitem and _is_identity_index(node.args[1])


def copy_on_rows(graph: torch.fx.Graph, node: Node, rows: Dict[Node, Node], lead: int) -> Node:
    """``node`` applied to the row forms of its inputs (dims it names are re-based on the rows); a
    regroup is its input's row form itself; a view of the features alone is the same view of the
    row form's features."""
    if is_regroup(node, lead):
        return rows[node.args[0]]
    if node.op == "call_method" and node.target in _VIEW_METHODS:   # sized, not -1: there may be no rows
        x = rows[node.args[0]]
        return graph.call_method(node.target, (x, graph.call_method("size", (x, 0)), *_tensor(node).shape[lead:]))
    if node.op == "call_function" and node.target in _CAT_FUNCTIONS:   # its dim, counted from the end
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        dim = dim - _tensor(node).dim() if dim >= 0 else dim
        parts = node.args[0] if node.args else node.kwargs["tensors"]
        return graph.call_function(node.target, ([rows[a] for a in parts], dim))
    if node.op == "call_function" and node.target is torch.stack:   # a new dim, counted from the end
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        dim = dim - _tensor(node).dim() if dim >= 0 else dim
        parts = node.args[0] if node.args else node.kwargs["tensors"]
        return graph.call_function(torch.stack, ([rows[a] for a in parts], dim))
    if node.op == "call_method" and node.target == "flatten":   # of feature dims, counted from the end
        ndim = _tensor(node.args[0]).dim()
        ends = [d - ndim if d >= 0 else d for d in (node.args[1] if len(node.args) > 1 else 0,
                                                    node.args[2] if len(node.args) > 2 else -1)]
        return graph.call_method("flatten", (rows[node.args[0]], *ends))
    if node.op == "call_function" and node.target is operator.getitem and _tensor(node.args[0]) is not None:
        index = _features_index(node.args[1], _tensor(node.args[0]).dim(), lead)
        return graph.call_function(operator.getitem, (rows[node.args[0]], index))
    new = graph.node_copy(node, lambda n: rows.get(n, n))
    if _out_of_place(node):
        new.target = _IN_PLACE[node.target]
    new.args = _shift_dims(node, new.args, lead)
    if "dim" in new.kwargs:
        new.kwargs = {**new.kwargs, "dim": _shift_dim(new.kwargs["dim"], node, lead)}
    return new


def _shift_dim(dim: Any, node: Node, lead: int) -> Any:
    """A dim of the full tensor, as a dim of its ``[K, *features]`` row form (negative: unchanged)."""
    ndim = _tensor(node.args[0]).dim()
    if isinstance(dim, (tuple, list)):
        return type(dim)(_shift_dim(d, node, lead) for d in dim)
    if isinstance(dim, int) and dim >= 0:
        return dim - ndim
    return dim


def _shift_dims(node: Node, args: Tuple[Any, ...], lead: int) -> Tuple[Any, ...]:
    target = node.target
    reduces = (node.op == "call_function" and target in (_SOFTMAX_FUNCTIONS | _REDUCE_FUNCTIONS)) or \
        (node.op == "call_method" and target in (_SOFTMAX_METHODS | _REDUCE_METHODS))
    if reduces and len(args) > 1:
        return (args[0], _shift_dim(args[1], node, lead)) + tuple(args[2:])
    return args


def erase_dead(gm: torch.fx.GraphModule, candidates: Sequence[Node]) -> int:
    """Erase ``candidates`` that nothing uses any more, and the pure helpers only they used."""
    erased = 0
    pending = list(candidates)
    seen: Set[Node] = set()
    while pending:
        node = pending.pop()
        if node in seen or node.op in ("placeholder", "output") or node.users:
            continue
        if node.op == "call_method" and str(node.target).endswith("_"):
            continue
        seen.add(node)
        inputs = list(node.all_input_nodes)
        gm.graph.erase_node(node)
        erased += 1
        pending.extend(i for i in inputs if i.op in ("call_function", "call_method") and _pure_helper(i))
    return erased


def _pure_helper(node: Node) -> bool:
    """Size arithmetic and views left behind by erased ops (never anything with side effects)."""
    v = value(node)
    if isinstance(v, (torch.SymInt, int, torch.Size, tuple)):
        return True
    return isinstance(v, torch.Tensor) and node.op in ("call_function", "call_method") and \
        (_elementwise(node) and node.target not in _IN_PLACE
         or node.target in _LINEAR_FUNCTIONS | {operator.getitem, F.layer_norm}
         or (node.op == "call_method" and node.target in _VIEW_METHODS))


def copy_subgraph(gm: torch.fx.GraphModule, roots: Sequence[Node], region: Set[Node]) -> Tuple[torch.fx.GraphModule, List[Node]]:
    """A GraphModule computing ``roots`` (region nodes) in full, as the original graph did.

    Its inputs are the tensors the region reads from outside and the placeholders it uses; size
    helpers (symbolic arithmetic, ``torch.Size``) are copied along. The returned list names the
    original node each placeholder of the copy stands for.
    """
    needed: Set[Node] = set()
    stack = list(roots)
    while True:
        while stack:
            n = stack.pop()
            if n in needed:
                continue
            needed.add(n)
            if n in region or not _is_input(n):
                stack.extend(n.all_input_nodes)
        # What writes into a needed tensor in place (a MoE's ``inv[perm] = arange(n)``) is needed too.
        stack = [n for n in gm.graph.nodes if n not in needed and n.args and n.args[0] in needed
                 and (n.target is operator.setitem or n.op == "call_method" and str(n.target).endswith("_"))]
        if not stack:
            break
    graph = torch.fx.Graph()
    env: Dict[Node, Node] = {}
    inputs: List[Node] = []
    for node in gm.graph.nodes:
        if node not in needed:
            continue
        if node not in region and _is_input(node):
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
            inputs.append(node)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[r] for r in roots))
    return torch.fx.GraphModule(gm, graph), inputs


def _is_input(node: Node) -> bool:
    return node.op == "placeholder" or isinstance(value(node), torch.Tensor)
