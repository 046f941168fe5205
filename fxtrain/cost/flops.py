"""FLOP formulas per aten op: what a step costs in arithmetic, counted from shapes alone.

The convention is torch's ``FlopCounterMode``'s: 2 FLOPs per multiply-add of the contractions
(matmul, convolution, attention); elementwise ops, reductions, copies and views count 0 because
their cost is memory traffic, not arithmetic. Within that convention nothing is silently zero: a
contraction we have no formula for, and any op outside aten (custom ops, PythonOps without a
``flops`` method), is reported as *unknown* instead.

Formulas are our own so that the CPU attention kernels, which torch 2.13's counter scores 0, are
counted: ``_scaled_dot_product_flash_attention_for_cpu`` and its backward (whose kernel recomputes
the scores, so the backward is five bmm-sized products, as for the other flash kernels).

Some ops' cost depends on values, not shapes: ``fxtrain::varlen_attention`` runs one attention per
sequence of the packed rows, so its FLOPs are ``sum(length**2)``-shaped, and the lengths are data (a
host tensor the batch guard reads). Their formulas take the profiler's values of such arguments
(``value_of``: the shadows of the batch's real tensors); without a value the op is unknown, never
guessed.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Sequence

import torch

aten = torch.ops.aten
Formula = Callable[..., int]

#: FLOPs one core does in the time it moves one byte through memory. The FLOP count above says
#: nothing about ops whose cost is memory traffic (a dense embedding gradient, the accumulation of
#: a large weight's gradient every microbatch), so a cost that has to predict time adds the bytes
#: an op moves at this rate. On the 2-core AMD EPYC machine of DESIGN section 7 (one thread): a
#: 256x1024x256 matmul against a streaming add of 32 MB gives 5.5, the linear layers of a small
#: BERT against a fresh dense 31 MB embedding gradient (first-touch pages) up to 18; 7 is what the
#: measured stage times of BERT-MLM's 4-stage pipeline fit (docs/pipeline.md). Only ratios of
#: costs matter to the splitter.
FLOPS_PER_BYTE = 7.0


def flop_equivalent(flops: float, moved_bytes: float, flops_per_byte: float = FLOPS_PER_BYTE) -> float:
    """Arithmetic plus memory traffic in one unit (FLOPs), so stages can be compared by time."""
    return float(flops) + flops_per_byte * float(moved_bytes)


def _shape(t: Any) -> Sequence[int]:
    return tuple(int(s) for s in t.shape)


def _prod(xs: Sequence[int]) -> int:
    return math.prod(int(x) for x in xs)


def mm_flops(a: Sequence[int], b: Sequence[int]) -> int:
    """[m, k] @ [k, n]."""
    return 2 * a[0] * a[1] * b[1]


def bmm_flops(a: Sequence[int], b: Sequence[int]) -> int:
    """[B, m, k] @ [B, k, n]."""
    return 2 * a[0] * a[1] * a[2] * b[2]


def attention_flops(q: Sequence[int], k: Sequence[int], v: Sequence[int]) -> int:
    """softmax(q k^T) v for q [..., L, E], k [..., S, E], v [..., S, Ev]; query heads set the batch."""
    batch = _prod(q[:-2])
    L, E, S, Ev = q[-2], q[-1], k[-2], v[-1]
    return 2 * batch * L * S * E + 2 * batch * L * S * Ev


def attention_backward_flops(q: Sequence[int], k: Sequence[int], v: Sequence[int]) -> int:
    """Flash-style backward: scores recomputed (q k^T), then dP = dO v^T, dV = P^T dO, dQ = dS k, dK = dS^T q."""
    batch = _prod(q[:-2])
    L, E, S, Ev = q[-2], q[-1], k[-2], v[-1]
    return 2 * batch * L * S * (E + Ev + Ev + E + E)


def conv_flops(x: Sequence[int], w: Sequence[int], out: Sequence[int], transposed: bool) -> int:
    """Each output element (of the non-transposed direction) is a dot product of Cin/groups x kernel."""
    kernel = _prod(w[2:])
    if transposed:
        # w: [Cin, Cout/groups, *k]; every input element scatters into Cout/groups x kernel outputs.
        return 2 * _prod(x) * w[1] * kernel
    # w: [Cout, Cin/groups, *k]
    return 2 * _prod(out) * w[1] * kernel


def _mm(a, b, *_, **__) -> int:
    return mm_flops(_shape(a), _shape(b))


def _bmm(a, b, *_, **__) -> int:
    return bmm_flops(_shape(a), _shape(b))


def _sdpa(q, k, v, *_, **__) -> int:
    return attention_flops(_shape(q), _shape(k), _shape(v))


def _sdpa_backward(_grad_out, q, k, v, *_, **__) -> int:
    return attention_backward_flops(_shape(q), _shape(k), _shape(v))


def _lengths(lengths: Any, value_of: Optional[Callable[[Any], Any]]) -> Optional[Sequence[int]]:
    value = value_of(lengths) if value_of is not None else None
    return None if value is None else [int(n) for n in value]


def varlen_attention_flops(lengths: Sequence[int], heads: int, dim: int, backward: bool = False) -> int:
    """Attention per sequence of the packed rows, counted like SDPA (a causal block costs its whole
    ``length**2``, torch's convention for ``is_causal`` too): forward two products of
    ``length**2 * dim`` per head, backward five (the scores recomputed)."""
    products = 5 if backward else 2
    return 2 * products * heads * dim * sum(n * n for n in lengths)


def _varlen(q, _k, _v, lengths, *_, value_of=None, **__) -> Optional[int]:
    known = _lengths(lengths, value_of)
    return None if known is None else varlen_attention_flops(known, q.shape[1], q.shape[2])


def _varlen_backward(_grad, q, _k, _v, _out, _lse, lengths, *_, value_of=None, **__) -> Optional[int]:
    known = _lengths(lengths, value_of)
    return None if known is None else varlen_attention_flops(known, q.shape[1], q.shape[2], backward=True)


def _convolution(x, w, _bias, _stride, _padding, _dilation, transposed, *_, out=None, **__) -> int:
    return conv_flops(_shape(x), _shape(w), _shape(out[0] if isinstance(out, (tuple, list)) else out), bool(transposed))


def _convolution_backward(grad_out, x, w, _bias_sizes, _stride, _padding, _dilation, transposed, _out_padding,
                          _groups, output_mask, *_, out=None, **__) -> int:
    one = conv_flops(_shape(x), _shape(w), _shape(grad_out), bool(transposed))
    return one * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


FORMULAS: Dict[Any, Formula] = {
    aten.mm: _mm,
    aten.addmm: lambda _bias, *args, **kwargs: _mm(*args, **kwargs),
    aten.bmm: _bmm,
    aten.baddbmm: lambda _bias, *args, **kwargs: _bmm(*args, **kwargs),
    aten.convolution: _convolution,
    aten._convolution: _convolution,
    aten.convolution_backward: _convolution_backward,
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward,
    aten._scaled_dot_product_flash_attention: _sdpa,
    aten._scaled_dot_product_flash_attention_backward: _sdpa_backward,
    aten._scaled_dot_product_efficient_attention: _sdpa,
    aten._scaled_dot_product_efficient_attention_backward: _sdpa_backward,
    aten._scaled_dot_product_cudnn_attention: _sdpa,
    aten._scaled_dot_product_cudnn_attention_backward: _sdpa_backward,
}

# Ops whose formula needs argument values (``value_of``), keyed by qualified name: they are defined
# elsewhere (runtime/), and the profiler must not import the runtime to cost a graph.
VALUE_FORMULAS: Dict[str, Callable[..., Optional[int]]] = {
    "fxtrain::varlen_attention": _varlen,
    "fxtrain::varlen_attention_backward": _varlen_backward,
}

# aten ops that do contractions but have no formula here: reported unknown, never counted as 0.
_UNCOSTED_ATEN = {
    "_scaled_mm", "_int_mm", "_weight_int4pack_mm", "_weight_int8pack_mm", "mkldnn_rnn_layer",
    "mkldnn_rnn_layer_backward", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm", "gru",
    "rnn_tanh", "rnn_relu", "_cdist_forward", "_cdist_backward", "_flash_attention_forward",
    "_flash_attention_backward", "_efficient_attention_forward", "_efficient_attention_backward",
    "mkldnn_convolution", "_slow_conv2d_forward", "_slow_conv2d_backward", "slow_conv3d_forward",
    "_fft_r2c", "_fft_c2r", "_fft_c2c", "linalg_solve_ex", "_linalg_svd", "linalg_qr", "_linalg_eigh",
    "cholesky", "linalg_cholesky_ex", "triangular_solve", "linalg_lu_factor_ex",
}
# Namespaces whose ops are plain tensor bookkeeping or elementwise work (0 FLOPs by the convention);
# fxtrain_host: row counts read ahead of the step (runtime/host_counts.py).
_ZERO_NAMESPACES = {"aten", "prims", "prim", "profiler", "fxtrain_host"}


def depends_on_values(func: Any) -> bool:
    """Whether ``func``'s FLOPs need argument values, not only shapes."""
    return getattr(getattr(func, "overloadpacket", None), "_qualified_op_name", "") in VALUE_FORMULAS


def op_flops(func: Any, args: Sequence[Any], kwargs: Dict[str, Any], out: Any,
             value_of: Optional[Callable[[Any], Any]] = None) -> Optional[int]:
    """FLOPs of one dispatched op, or None when they cannot be known. ``value_of(tensor)``: the
    tensor's value as a (nested) list where the caller has one, else None, for ops whose cost
    depends on data."""
    packet = getattr(func, "overloadpacket", None)
    formula = FORMULAS.get(packet)
    if formula is not None:
        return int(formula(*args, out=out, **kwargs))
    by_value = VALUE_FORMULAS.get(getattr(packet, "_qualified_op_name", ""))
    if by_value is not None:
        return by_value(*args, value_of=value_of, out=out, **kwargs)
    namespace = getattr(func, "namespace", None)
    if namespace in _ZERO_NAMESPACES:
        name = getattr(packet, "__name__", "")
        return None if name in _UNCOSTED_ATEN else 0
    return None
