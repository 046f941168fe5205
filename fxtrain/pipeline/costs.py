"""Cost per graph node, the quantity automatic stage balancing equalises.

A cost function maps a captured dynamo graph to one number per node (in ``gm.graph.nodes`` order);
the partitioner only sums them. ``node_flops`` counts training FLOPs (forward plus backward) of the
heavy ops from the fake-tensor shapes dynamo recorded on each node; ``node_time`` adds the bytes
each node moves (``traffic_of``) at the profiler's FLOPs-per-byte rate (``cost.flops``), since
FLOPs alone price an embedding's dense gradient at zero; ``node_params`` counts parameter
elements where a parameter is first used. The profiler (DESIGN §5) can replace ``node_flops``
with its own per-node numbers by passing any ``CostFn``.

Attention is counted analytically: torch 2.13's FlopCounterMode counts the CPU SDPA kernel as zero.
"""
from __future__ import annotations

import math
import operator
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx
import torch.nn.functional as F

from ..cost.flops import attention_flops, bmm_flops, conv_flops, mm_flops   # the profiler's formulas
from ..torch_private import NN_LINEAR, NN_SDPA

CostFn = Callable[[torch.fx.GraphModule], List[float]]


def _example(value: Any) -> Optional[torch.Tensor]:
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("example_value")
    return value if isinstance(value, torch.Tensor) else None


def _grads(*tensors: Optional[torch.Tensor]) -> int:
    """How many operands need a gradient: each costs one more product of the forward's size."""
    return sum(1 for t in tensors if t is not None and t.requires_grad)


def _train(forward: int, *operands: Optional[torch.Tensor]) -> int:
    return forward * (1 + _grads(*operands))


def _numel(shape: Sequence[int]) -> int:
    return int(math.prod(shape))


def matmul_flops(a: torch.Tensor, b: torch.Tensor) -> int:
    """torch.matmul (1-D promotions, broadcast batch) as the profiler's batched product."""
    ash, bsh = list(a.shape), list(b.shape)
    if len(ash) == 1:
        ash = [1] + ash
    if len(bsh) == 1:
        bsh = bsh + [1]
    batch = _numel(torch.broadcast_shapes(tuple(ash[:-2]), tuple(bsh[:-2])))
    return bmm_flops([batch] + ash[-2:], [batch] + bsh[-2:])


def linear_flops(x: torch.Tensor, w: torch.Tensor) -> int:
    return mm_flops([_numel(x.shape[:-1]), x.shape[-1]], [x.shape[-1], w.shape[0] if w.dim() == 2 else 1])


def einsum_flops(equation: str, operands: Sequence[torch.Tensor]) -> int:
    """2 * product of every index size, for two operands (a contraction); 0 for one operand."""
    if len(operands) != 2:
        return 0
    lhs = equation.replace(" ", "").split("->")[0].split(",")
    sizes: Dict[str, int] = {}
    for letters, t in zip(lhs, operands):
        letters = letters.replace("...", "")
        for ch, size in zip(letters, t.shape[t.dim() - len(letters):]):
            sizes[ch] = int(size)
    return 2 * _numel(sizes.values())


_MATMUL_FUNCTIONS = {torch.matmul, operator.matmul, torch.mm, torch.bmm}
_MATMUL_METHODS = {"matmul", "mm", "bmm", "__matmul__"}
_ADDMM_FUNCTIONS = {torch.addmm, torch.baddbmm, torch.addbmm}
_ADDMM_METHODS = {"addmm", "baddbmm", "addbmm"}
_CONV_FUNCTIONS = {torch.conv1d, torch.conv2d, torch.conv3d, F.conv1d, F.conv2d, F.conv3d}
_CONV_T_FUNCTIONS = {torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d,
                     F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d}
_SDPA = {F.scaled_dot_product_attention, NN_SDPA}


def _arg(node: torch.fx.Node, index: int, name: str) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def flops_of(node: torch.fx.Node) -> int:
    """Training FLOPs (forward + the backward products for operands that need grad) of one node."""
    target = node.target
    function, method = node.op == "call_function", node.op == "call_method"
    if function and target in _MATMUL_FUNCTIONS or method and target in _MATMUL_METHODS:
        a, b = _example(node.args[0]), _example(node.args[1])
        return _train(matmul_flops(a, b), a, b) if a is not None and b is not None else 0
    if function and target in _ADDMM_FUNCTIONS or method and target in _ADDMM_METHODS:
        a, b = _example(_arg(node, 1, "mat1" if target in (torch.addmm, "addmm") else "batch1")), \
            _example(_arg(node, 2, "mat2" if target in (torch.addmm, "addmm") else "batch2"))
        return _train(matmul_flops(a, b), a, b) if a is not None and b is not None else 0
    if function:
        if target in (F.linear, NN_LINEAR):
            x, w, b = _example(_arg(node, 0, "input")), _example(_arg(node, 1, "weight")), _example(_arg(node, 2, "bias"))
            return _train(linear_flops(x, w), x, w) if x is not None and w is not None else 0
        if target in _CONV_FUNCTIONS or target in _CONV_T_FUNCTIONS:
            x, w, out = _example(node.args[0]), _example(node.args[1]), _example(node)
            if x is None or w is None or out is None:
                return 0
            return _train(conv_flops(x.shape, w.shape, out.shape, target in _CONV_T_FUNCTIONS), x, w)
        if target in _SDPA:
            q, k, v = (_example(_arg(node, i, n)) for i, n in enumerate(("query", "key", "value")))
            if q is None or k is None or v is None:
                return 0
            fwd = attention_flops(q.shape, k.shape, v.shape)
            return fwd + (2 * fwd if _grads(q, k, v) else 0)
        if target is torch.einsum and node.args and isinstance(node.args[0], str):
            tensors = [_example(o) for o in _product_operands(node)]
            if all(t is not None for t in tensors):
                return _train(einsum_flops(node.args[0], tensors), *tensors)
    return 0


def _product_operands(node: torch.fx.Node) -> List[Any]:
    """The operands whose gradient each costs one product of the forward's size (as ``flops_of``)."""
    target = node.target
    operands = [a for a in node.args if isinstance(a, torch.fx.Node)]
    if node.op == "call_function" and target in (F.linear, NN_LINEAR):
        return [_arg(node, 0, "input"), _arg(node, 1, "weight")]
    if node.op == "call_function" and target in _ADDMM_FUNCTIONS or node.op == "call_method" and target in _ADDMM_METHODS:
        return operands[1:3]
    if node.op == "call_function" and target is torch.einsum:
        ops = node.args[1:]
        return list(ops[0]) if len(ops) == 1 and isinstance(ops[0], (tuple, list)) else list(ops)
    return operands[:2]


def forward_flops_of(node: torch.fx.Node) -> int:
    """Forward-only FLOPs of one node (the training count without the backward products)."""
    target = node.target
    total = flops_of(node)
    if total == 0:
        return 0
    if node.op == "call_function" and target in _SDPA:
        q, k, v = (_example(_arg(node, i, n)) for i, n in enumerate(("query", "key", "value")))
        return attention_flops(q.shape, k.shape, v.shape)
    return total // (1 + _grads(*[_example(a) for a in _product_operands(node)]))


def weight_flops_of(node: torch.fx.Node, is_weight: Callable[[torch.fx.Node], bool]) -> int:
    """The backward FLOPs of one node that go to weight gradients: one forward's worth per operand
    that needs a gradient and ``is_weight`` (a parameter, or computed from parameters alone). The
    rest of the backward computes input gradients: the B and W parts of a zero-bubble schedule."""
    if flops_of(node) == 0 or node.op == "call_function" and node.target in _SDPA:
        return 0
    forward = forward_flops_of(node)
    weights = [a for a in _product_operands(node) if isinstance(a, torch.fx.Node) and is_weight(a)]
    return forward * _grads(*[_example(a) for a in weights])


def node_flops(gm: torch.fx.GraphModule) -> List[float]:
    """Training FLOPs per node (matmul, linear, conv, attention, einsum); every other op counts 0."""
    return [float(flops_of(n)) for n in gm.graph.nodes]


def node_params(gm: torch.fx.GraphModule) -> List[float]:
    """Parameter elements per node: each parameter placeholder counted once, at its first user."""
    costs: Dict[torch.fx.Node, float] = {}
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        ex = _example(n)
        if not isinstance(ex, torch.nn.Parameter) and not (ex is not None and ex.requires_grad):
            continue
        users = [u for u in gm.graph.nodes if u in n.users]
        if users:
            costs[users[0]] = costs.get(users[0], 0.0) + float(ex.numel())
    return [costs.get(n, 0.0) for n in gm.graph.nodes]


def labelled_share(gm: torch.fx.GraphModule) -> Dict[torch.fx.Node, float]:
    """The nodes label sparsity will replay on labelled rows only, with the labelled share of rows.

    For each cross-entropy whose labels (a model input) are mostly ``ignore_index``, the nodes that
    compute its logits row by row (the region the label-sparsity pass replays on labelled rows),
    and the cross-entropy.
    """
    from ..passes.label_sparsity import _label_placeholder, cross_entropy_args, unsupported_cross_entropy
    from ..passes.rows import find_region
    from .capture import EXAMPLE_KEY

    share: Dict[torch.fx.Node, float] = {}
    for node in list(gm.graph.nodes):
        bound = cross_entropy_args(node)
        if bound is None or unsupported_cross_entropy(bound):
            continue
        source = _label_placeholder(bound.arguments["target"])
        labels = source.meta.get(EXAMPLE_KEY) if source is not None else None
        if not isinstance(labels, torch.Tensor) or labels.numel() == 0:
            continue
        density = float((labels != bound.arguments["ignore_index"]).float().mean())
        for n in find_region(gm, bound.arguments["input"], 1, {node}).lead:
            share[n] = density
        share[node] = density   # the loss itself then reads labelled rows of logits only
    return share


def node_sparse_flops(gm: torch.fx.GraphModule) -> List[float]:
    """Training FLOPs once label sparsity has run: what the stages will actually compute.

    The logits region of a mostly-unlabelled cross-entropy counts for the labelled fraction of the
    example batch only. On an MLM the vocabulary projection dominates the dense count but runs on
    ~15% of the rows, so balancing dense FLOPs overloads the first stages.
    """
    costs = node_flops(gm)
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n, density in labelled_share(gm).items():
        costs[index[n]] *= density
    return costs


def _storage(t: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef
    try:
        return StorageWeakRef(t.untyped_storage())
    except Exception:  # a tensor subclass without storage: treat it as its own data
        return id(t)


def _tensors(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _is_param(node: Any) -> bool:
    ex = _example(node)
    return isinstance(node, torch.fx.Node) and node.op == "placeholder" and ex is not None and ex.requires_grad


_EMBEDDINGS = {F.embedding, torch.embedding}


def traffic_of(node: torch.fx.Node) -> Tuple[int, int]:
    """Bytes one node moves through memory in a training step: (activation bytes, parameter bytes).

    FLOPs price contractions only; on a CPU the rest of a step is memory traffic, and some of it
    does not shrink with the batch: every microbatch writes each weight's full gradient and adds it
    into ``.grad``. An embedding reads only its looked-up rows forward, but its backward writes a
    dense table-sized gradient; with a 30k vocabulary that is the first stage's largest cost.
    Views move nothing. Elsewhere the forward reads its inputs and writes its output, and the
    backward, when the output needs a gradient, moves about twice that (it reads the output's
    gradient and the saved inputs, and writes the inputs' gradients). Each parameter read also
    costs the accumulation of its gradient (read both, write one).
    """
    if node.op not in ("call_function", "call_method"):
        return 0, 0
    outs = _tensors(node.meta.get("example_value"))
    if not outs:
        return 0, 0
    inputs = [a for a in node.all_input_nodes if _example(a) is not None]
    stores = {_storage(_example(a)) for a in inputs}
    if any(_storage(o) in stores for o in outs):
        return 0, 0
    written = sum(o.numel() * o.element_size() for o in outs)
    grad = any(o.requires_grad for o in outs)
    if node.op == "call_function" and node.target in _EMBEDDINGS:
        if node.target is torch.embedding:      # aten order: (weight, indices)
            weight, indices = _example(_arg(node, 0, "weight")), _example(_arg(node, 1, "indices"))
        else:
            weight, indices = _example(_arg(node, 1, "weight")), _example(_arg(node, 0, "input"))
        if weight is None or indices is None:
            return 0, 0
        activations = indices.numel() * indices.element_size() + 2 * written
        table = weight.numel() * weight.element_size()
        if not weight.requires_grad:
            return activations, 0
        # backward: read the output's gradient, zero a dense table, add the rows in, accumulate.
        return activations + written, table + 3 * table
    activation = sum(_nbytes(a) for a in inputs if not _is_param(a)) + written
    params = sum(_nbytes(a) for a in inputs if _is_param(a))
    if not grad:
        return activation, params
    # forward, twice that backward; a parameter's gradient then accumulates (read both, write one)
    return 3 * activation, 3 * params + 3 * params


def _nbytes(node: torch.fx.Node) -> int:
    ex = _example(node)
    return ex.numel() * ex.element_size() if ex is not None else 0


def node_time(gm: torch.fx.GraphModule, flops_per_byte: Optional[float] = None) -> List[float]:
    """What each node costs in time, in FLOP-equivalents: FLOPs plus bytes moved, after label sparsity.

    Stages balanced on FLOPs alone came out 20-30% apart in measured compute on BERT-MLM: the
    embedding's dense gradient and the per-microbatch accumulation of the tied 31 MB table are
    memory traffic that the FLOP count prices at zero. Label sparsity shrinks the activation
    traffic of the logits region with its FLOPs, not the weight's: the whole decoder weight is
    still read and its gradient written.
    """
    from ..cost.flops import FLOPS_PER_BYTE, flop_equivalent

    rate = FLOPS_PER_BYTE if flops_per_byte is None else flops_per_byte
    flops = node_sparse_flops(gm)
    share = labelled_share(gm)
    out = []
    for i, n in enumerate(gm.graph.nodes):
        activation, params = traffic_of(n)
        out.append(flop_equivalent(flops[i], activation * share.get(n, 1.0) + params, rate))
    return out


COST_FUNCTIONS: Dict[str, CostFn] = {"flops": node_flops, "sparse_flops": node_sparse_flops, "time": node_time,
                                     "params": node_params}


def module_of(node: torch.fx.Node) -> str:
    """The qualified name of the innermost module a node was traced in ('' for the model itself)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return normalize_module_path(path)


def normalize_module_path(path: str) -> str:
    """``L['mod'].bert.encoder.layer[0]`` / ``L['self'].model`` -> ``bert.encoder.layer.0`` (wrapper stripped)."""
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    path = re.sub(r"^L\.?", "", path).lstrip(".")
    parts = path.split(".")
    # The capture wraps the model as `wrapper.model`: drop the wrapper's own names.
    if parts and parts[0] in ("mod", "module", "self"):
        parts = parts[1:]
    if parts and parts[0] == "model":
        parts = parts[1:]
    return ".".join(p for p in parts if p)
