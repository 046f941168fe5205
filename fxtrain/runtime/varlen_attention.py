"""Attention over packed real tokens, one sequence at a time (``fxtrain::varlen_attention``).

Padding elimination keeps every row-wise op on the real tokens, packed as ``[tokens, ...]`` rows in
row-major order, so the tokens of one sequence are one contiguous block. Attention is the only op
that mixes rows; on the padded layout its cost grows with ``batch * seq**2`` whatever the padding.
Run per sequence on its block, it costs ``sum(length**2)``: at 60% padding about a sixth.

Exact, not approximate: a real query of a sequence gives weight 0 to padding keys (the pass checks
the model's mask) and never sees another sequence's keys, so the softmax over the sequence's own
real keys is the one eager computes; with ``causal`` each block gets the causal mask of its own
positions, which is eager's causal mask restricted to the real tokens whichever side the padding is.

Lengths are host integers (they choose the slices), read from a CPU tensor that the batch guard
fills in the step's one device-to-host transfer (``host_counts.row_lengths``), so the op itself
never synchronises. Consecutive sequences of equal length run as one batched call (a dense batch
is then one call, as in eager).

Kernels: where torch has an attention kernel that also returns the softmax's log-sum-exp for the
device (``torch_private.attention_with_lse``, the CPU flash kernel), the backward reuses it and
costs one pass; elsewhere the forward is ``F.scaled_dot_product_attention`` (the device's own best
kernel) and the backward recomputes the attention weights in plain tensor ops: an extra
``q @ k^T`` and softmax, and the ``[len, len]`` weights in memory, but nothing device-specific.
"""
from __future__ import annotations

import logging
from typing import Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..torch_private import attention_with_lse

logger = logging.getLogger("fxtrain")
Tensor = torch.Tensor


def _runs(lengths: Tensor, tokens: int) -> Iterator[Tuple[int, int, int]]:
    """``(offset, count, length)`` for each run of consecutive sequences of equal non-zero length.

    The lengths must add up to the packed rows (``tokens``): lengths from another batch would
    otherwise slice the wrong blocks silently."""
    values = lengths.tolist()  # a CPU tensor: a host read
    if sum(values) != tokens:
        raise RuntimeError(f"fxtrain varlen_attention: sequence lengths add up to {sum(values)}, "
                           f"but {tokens} packed rows were given")
    offset = 0
    run_start, run_len, run_count = 0, -1, 0
    for n in values:
        if n == run_len:
            run_count += 1
        else:
            if run_count and run_len > 0:
                yield run_start, run_count, run_len
            run_start, run_len, run_count = offset, n, 1
        offset += n
    if run_count and run_len > 0:
        yield run_start, run_count, run_len


def _heads_first(x: Tensor, offset: int, count: int, length: int) -> Tensor:
    """Rows ``offset .. offset + count * length`` of a packed ``[tokens, heads, dim]`` tensor as
    ``[count, heads, length, dim]`` (a view)."""
    block = x.narrow(0, offset, count * length)
    return block.view(count, length, *x.shape[1:]).transpose(1, 2)


class _Packer:
    """Writes ``[count, heads, length, ...]`` pieces (one per run) into packed ``[tokens, heads, ...]``
    rows as they come: only the current piece is alive beside the result, the transient the
    profiler cannot see (it costs the op by its outputs). A single run covering every row (a dense
    batch) is returned as the kernel made it: the CPU kernels lay results out token-major, so its
    transpose is a view and nothing is copied."""

    def __init__(self, like: Tensor, runs: List[Tuple[int, int, int]], width: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        self.shape = (like.shape[0], *like.shape[1:2], *([width] if width is not None else like.shape[2:]))
        self.whole = len(runs) == 1 and runs[0][1] * runs[0][2] == like.shape[0]
        self.dtype = dtype or like.dtype
        self.out = None if self.whole else like.new_empty(self.shape, dtype=self.dtype)

    def put(self, offset: int, piece: Tensor) -> None:
        rows = piece.transpose(1, 2)                          # [count, length, heads, ...]
        if self.whole:
            self.out = rows.reshape(self.shape).to(self.dtype)
        else:
            count, length = rows.shape[:2]
            self.out.narrow(0, offset, count * length).view(count, length, *self.shape[1:]).copy_(rows)

    def result(self) -> Tensor:
        assert self.out is not None, "a single whole run was never put"
        return self.out


def _lse_dtype(q: Tensor) -> torch.dtype:
    """The kernels' accumulation type: float32 for half types, else q's own."""
    return torch.promote_types(q.dtype, torch.float32)


@torch.library.custom_op("fxtrain::varlen_attention", mutates_args=())
def varlen_attention(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, scale: float,
                     causal: bool) -> Tuple[Tensor, Tensor]:
    """``(out, lse)``: ``out`` like ``q`` (``[tokens, heads, dim]``); ``lse`` ``[tokens, heads]``
    (accumulation type) where a kernel returned it, else empty (the backward then recomputes)."""
    kernels = attention_with_lse(q.device.type)
    runs = list(_runs(lengths, q.shape[0]))
    out = _Packer(q, runs)
    lse = _Packer(q, runs, width=1, dtype=_lse_dtype(q)) if kernels else None
    for offset, count, length in runs:
        qs, ks, vs = (_heads_first(x, offset, count, length) for x in (q, k, v))
        if kernels:
            o, l_ = kernels[0](qs, ks, vs, causal, scale)
            lse.put(offset, l_.unsqueeze(-1))
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)
        out.put(offset, o)
        del o
    return out.result(), (lse.result().squeeze(-1) if lse is not None else q.new_empty((0,)))


@varlen_attention.register_fake
def _varlen_attention_fake(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, scale: float,
                           causal: bool) -> Tuple[Tensor, Tensor]:
    lse = q.new_empty((q.shape[0], q.shape[1]), dtype=_lse_dtype(q)) if attention_with_lse(q.device.type) \
        else q.new_empty((0,))
    return torch.empty_like(q), lse


@torch.library.custom_op("fxtrain::varlen_attention_backward", mutates_args=())
def varlen_attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              lengths: Tensor, scale: float, causal: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``varlen_attention``'s ``out`` for q, k and v, sequence by sequence."""
    kernels = attention_with_lse(q.device.type) if lse.numel() or q.shape[0] == 0 else None
    runs = list(_runs(lengths, q.shape[0]))
    grads = [_Packer(x, runs) for x in (q, k, v)]
    for offset, count, length in runs:
        qs, ks, vs, gs = (_heads_first(x, offset, count, length) for x in (q, k, v, grad))
        if kernels:
            os_ = _heads_first(out, offset, count, length)
            # [count, heads, length] over token-major memory: the layout the forward kernel made
            ls = lse.narrow(0, offset, count * length).view(count, length, -1).transpose(1, 2)
            parts = kernels[1](gs, qs, ks, vs, os_, ls, causal, scale)
        else:
            parts = _math_backward(gs, qs, ks, vs, scale, causal)
        for acc, part in zip(grads, parts):
            acc.put(offset, part)
        del parts
    # Every row belongs to a run (zero-length sequences have none), so the pieces cover the rows.
    return tuple(g.result() for g in grads)  # type: ignore[return-value]


def _math_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float,
                   causal: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """Attention's backward from recomputed weights, in plain tensor ops (any device). Autograd
    cannot be used here: a custom op's kernel runs below the autograd dispatch key."""
    acc = _lse_dtype(q)
    scores = torch.matmul(q, k.transpose(-1, -2)).to(acc) * scale
    if causal:
        length = q.shape[-2]
        above = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    g = grad.to(acc)
    dv = torch.matmul(p.transpose(-1, -2), g)
    dp = torch.matmul(g, v.to(acc).transpose(-1, -2))
    ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
    dq = torch.matmul(ds, k.to(acc))
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@varlen_attention_backward.register_fake
def _varlen_attention_backward_fake(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                    lengths: Tensor, scale: float, causal: bool) -> Tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: object, inputs: Tuple[object, ...], output: Tuple[Tensor, Tensor]) -> None:
    q, k, v, lengths, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, lengths)  # type: ignore[attr-defined]
    ctx.scale, ctx.causal = scale, causal  # type: ignore[attr-defined]


def _backward(ctx: object, grad_out: Tensor, grad_lse: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
    q, k, v, out, lse, lengths = ctx.saved_tensors  # type: ignore[attr-defined]
    dq, dk, dv = varlen_attention_backward(grad_out.contiguous(), q, k, v, out, lse, lengths,
                                           ctx.scale, ctx.causal)  # type: ignore[attr-defined]
    return dq, dk, dv, None, None, None


varlen_attention.register_autograd(_backward, setup_context=_setup_context)

VARLEN_ATTENTION = torch.ops.fxtrain.varlen_attention.default


def reference(q: Tensor, k: Tensor, v: Tensor, lengths: List[int], scale: float, causal: bool) -> Tensor:
    """The same attention through padding and a mask, on the padded layout (for tests and docs)."""
    b, s = len(lengths), max(lengths, default=0)
    heads, dim = q.shape[1], q.shape[2]
    valid = torch.arange(s, device=q.device)[None, :] < torch.tensor(lengths, device=q.device)[:, None]
    index = valid.flatten().nonzero().view(-1)

    def padded(x: Tensor) -> Tensor:
        return x.new_zeros((b * s, heads, x.shape[2])).index_copy(0, index, x).view(b, s, heads, -1).transpose(1, 2)

    mask = valid[:, None, None, :].expand(b, 1, s, s)
    if causal:
        mask = mask & torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    o = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask, scale=scale)
    return o.transpose(1, 2).reshape(b * s, heads, dim).index_select(0, index)
