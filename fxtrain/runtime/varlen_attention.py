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

Routes (``route``: by device type, dtype and head dim; the forward, the backward and both fakes
ask it alike):

- ``"efficient"`` / ``"flash"`` (CUDA): ONE variable-length kernel call over every sequence per
  direction, told where each starts by ``cu_seqlens`` (``torch_private.varlen_kernels``): the
  memory-efficient kernel for float32 (and half types before sm80), FlashAttention-2 for fp16/bf16
  on sm80+. Issue 17: the per-run loop below cost an H100 2,805 kernel launches in 5 BERT-MLM steps
  (16x128, 54% padding), 60% of the host time in the backward's ~14 ops per run, and ran 0.26x
  eager, host-bound. ``cu_seqlens`` is built on the host from the host lengths and copied to the
  device from pinned memory without blocking (no synchronisation); consecutive calls with the same
  lengths tensor (every layer of a step, forward and backward) reuse one copy.
  ``lse`` is the kernel's own: ``[heads, tokens]`` (flash), or the efficient kernel's
  ``[sequences, heads, max length rounded up to 32]`` flattened to 1-d (its size depends on the
  lengths' values, so the fake gives it an unbacked size, like the row counts of ``host_counts``).
- ``"blocks_lse"`` (the CPU): per run of equal lengths, through a kernel that also returns the
  softmax's log-sum-exp (``torch_private.attention_with_lse``, the CPU flash kernel), whose backward
  reuses it and costs one pass. Kept on the CPU: no variable-length kernel there, and the batched
  runs already make the demo ~6-8x eager. One call over a padded copy instead (every sequence
  scattered to ``[sequences, longest, heads, dim]``, the same kernel told a key mask, the rows
  gathered back: exact, one kernel call, but ``sequences * longest**2`` work) measured slower at
  every size but the tiniest (torch 2.13, one thread, 2026-12-07, forward / backward µs per call,
  per-run against padded): 4 sequences of 20-45 tokens, 2 heads of 16: 582 / 807 against 484 / 715;
  the demo's 16 sequences, 4 heads of 64: 2834 / 8728 against 6094 / 13867; BERT-base's 8 x 12
  heads: 5152 / 9691 against 7628 / 17468; 15 packed causal documents up to 512 tokens: 28491 /
  68672 against 54237 / 125036.
- ``"blocks"`` (anything else: float64 on CUDA, ROCm, odd head dims): per run,
  ``F.scaled_dot_product_attention`` forward and a backward recomputing the attention weights in
  plain tensor ops: an extra ``q @ k^T`` and softmax, and the ``[len, len]`` weights in memory, but
  nothing device-specific.
"""
from __future__ import annotations

import itertools
import logging
import threading
from typing import Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..torch_private import EFFICIENT_LSE_ALIGN, attention_with_lse, is_fake, varlen_kernels

logger = logging.getLogger("fxtrain")
Tensor = torch.Tensor


def _runs(lengths: Tensor, tokens: int) -> Iterator[Tuple[int, int, int]]:
    """``runs_of`` the host lengths, which must add up to the packed rows (``tokens``): lengths
    from another batch would otherwise slice the wrong blocks silently."""
    values = lengths.tolist()  # a CPU tensor: a host read
    if sum(values) != tokens:
        raise RuntimeError(f"fxtrain varlen_attention: sequence lengths add up to {sum(values)}, "
                           f"but {tokens} packed rows were given")
    return runs_of(values)


def runs_of(values: List[int]) -> Iterator[Tuple[int, int, int]]:
    """``(offset, count, length)`` for each run of consecutive sequences of equal non-zero length:
    one kernel call each on the per-run routes."""
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
    """Rows ``offset .. offset + count * length`` of a packed ``[tokens, heads, ...]`` tensor as
    ``[count, heads, length, ...]``: one ``as_strided`` view, where narrow, view and transpose were
    three ops (the loop runs per run of equal lengths, 8 to 14 of these a run: on a host-bound CPU
    step their dispatch was as much of the attention's time as its kernels)."""
    rows, heads, *rest = x.stride()
    return x.as_strided((count, x.shape[1], length, *x.shape[2:]), (length * rows, heads, rows, *rest),
                        x.storage_offset() + offset * rows)


class _Packer:
    """Writes ``[count, heads, length, ...]`` pieces (one per run) into packed ``[tokens, heads, ...]``
    rows as they come: only the current piece is alive beside the result, the transient the
    profiler cannot see (it costs the op by its outputs). A single run covering every row (a dense
    batch) is returned as the kernel made it: the CPU kernels lay results out token-major, so its
    transpose is a view and nothing is copied."""

    def __init__(self, like: Tensor, runs: List[Tuple[int, int, int]], shape: Optional[Tuple[int, ...]] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        self.shape = tuple(like.shape if shape is None else shape)
        self.whole = len(runs) == 1 and runs[0][1] * runs[0][2] == like.shape[0]
        self.dtype = dtype or like.dtype
        self.out = None if self.whole else like.new_empty(self.shape, dtype=self.dtype)

    def put(self, offset: int, piece: Tensor) -> None:
        """``piece``: ``[count, heads, length, ...]``, heads first as the kernels return it."""
        if self.whole:
            self.out = piece.transpose(1, 2).reshape(self.shape).to(self.dtype)
        else:
            _heads_first(self.out, offset, piece.shape[0], piece.shape[2]).copy_(piece)

    def result(self) -> Tensor:
        assert self.out is not None, "a single whole run was never put"
        return self.out


def _lse_dtype(q: Tensor) -> torch.dtype:
    """The kernels' accumulation type: float32 for half types, else q's own."""
    return torch.promote_types(q.dtype, torch.float32)


#: Routes that run every sequence in one variable-length kernel call (CUDA).
VARLEN_ROUTES = ("efficient", "flash")
_HALF = (torch.float16, torch.bfloat16)


def route(device_type: str, dtype: torch.dtype, head_dim: int, capability: Optional[Tuple[int, int]] = None,
          hip: bool = False, value_dim: Optional[int] = None) -> str:
    """Which kernels ``varlen_attention`` runs for q/k/v of ``dtype`` on ``device_type``:
    "flash", "efficient", "blocks_lse" or "blocks" (module docstring). ``capability``: the CUDA
    device's (major, minor), None where unknown (no GPU in this process: tracing only).

    Flash wants fp16/bf16, sm80+ and equal head dims; the efficient kernel float32/fp16 (bf16 from
    sm80); both a head dim that is a multiple of 8 (their aligned kernels) up to 256. ROCm's
    kernels lay the log-sum-exp out otherwise (torch_private): per-run there."""
    value_dim = head_dim if value_dim is None else value_dim
    sm80 = capability is None or tuple(capability) >= (8, 0)
    if device_type == "cuda" and not hip and all(d % 8 == 0 and 0 < d <= 256 for d in (head_dim, value_dim)):
        if dtype in _HALF and capability is not None and sm80 and head_dim == value_dim:
            return "flash"
        if dtype in (torch.float32, torch.float16) or (dtype == torch.bfloat16 and sm80):
            return "efficient"
    return "blocks_lse" if attention_with_lse(device_type) is not None else "blocks"


def _capability(device: torch.device) -> Optional[Tuple[int, int]]:
    """The CUDA device's compute capability (cached by torch), None without a usable GPU."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def _route_of(q: Tensor, v: Tensor) -> str:
    return route(q.device.type, q.dtype, q.shape[-1], _capability(q.device), torch.version.hip is not None,
                 v.shape[-1])


def kernel_calls(q: Tensor, v: Tensor, lengths: List[int]) -> int:
    """Kernel calls a ``varlen_attention`` of padded-layout ``q`` and ``v`` (values or fakes: their
    device, dtype and head dims choose the route) makes in each direction for ``lengths``: one on
    the variable-length routes, one per run of equal lengths on the others (the host work the CPU's
    launch model counts, cost/launches.py)."""
    if _route_of(q, v) in VARLEN_ROUTES:
        return 1
    return len(list(runs_of(lengths)))


_local = threading.local()


def _sequences(lengths: Tensor, tokens: int, device: torch.device) -> Tuple[Tensor, int, int]:
    """``(cu_seqlens, sequences, max_length)`` of the non-empty sequences: int32 ``[0, l0, l0 + l1,
    ..., tokens]`` on ``device``. Built from the host lengths and copied from pinned memory without
    blocking (a non-blocking copy from pageable memory, or a blocking one, would wait for the device);
    the last result is kept for the same lengths tensor, so a step's layers share one copy."""
    last = getattr(_local, "last", None)
    if last is not None and last[0] is lengths and last[1] == device:
        return last[2]
    values = lengths.tolist()  # a CPU tensor: a host read
    if sum(values) != tokens:
        raise RuntimeError(f"fxtrain varlen_attention: sequence lengths add up to {sum(values)}, "
                           f"but {tokens} packed rows were given")
    found = [n for n in values if n > 0]
    bounds = [0, *itertools.accumulate(found)]
    pin = device.type == "cuda" and torch.cuda.is_available()
    cu = torch.tensor(bounds, dtype=torch.int32, pin_memory=pin).to(device, non_blocking=True)
    result = (cu, len(found), max(found, default=0))
    if not is_fake(cu):
        _local.last = (lengths, device, result)
    return result


def _kernel_ready(x: Tensor) -> Tensor:
    """``x`` as the variable-length kernels read it: unit stride in the head dim, the other strides
    multiples of 8 elements (their aligned kernels); the packed q/k/v of the passes already are."""
    if x.stride(-1) == 1 and x.stride(0) % 8 == 0 and x.stride(1) % 8 == 0:
        return x
    return x.contiguous()


def _efficient_lse_length(max_len: int) -> int:
    return -(-max_len // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN


def _empty_lse(kind: str, q: Tensor) -> Tensor:
    shape = (0,) if kind == "efficient" else (q.shape[1], q.shape[0])
    return q.new_empty(shape, dtype=torch.float32)


def _varlen_forward(kind: str, q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, scale: float,
                    causal: bool) -> Tuple[Tensor, Tensor]:
    cu, count, max_len = _sequences(lengths, q.shape[0], q.device)
    if count == 0:   # no tokens at all
        return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), _empty_lse(kind, q)
    out, lse = varlen_kernels(kind)[0](_kernel_ready(q), _kernel_ready(k), _kernel_ready(v), cu, max_len,
                                       causal, scale)
    return out.contiguous(), (lse.reshape(-1) if kind == "efficient" else lse)


def _varlen_backward(kind: str, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     lengths: Tensor, scale: float, causal: bool) -> Tuple[Tensor, Tensor, Tensor]:
    cu, count, max_len = _sequences(lengths, q.shape[0], q.device)
    if count == 0:
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    if kind == "efficient":
        lse = lse.view(count, q.shape[1], _efficient_lse_length(max_len))
    parts = varlen_kernels(kind)[1](grad.contiguous(), _kernel_ready(q), _kernel_ready(k), _kernel_ready(v),
                                    out.contiguous(), lse, cu, max_len, causal, scale)
    return tuple(p.contiguous() for p in parts)  # type: ignore[return-value]


@torch.library.custom_op("fxtrain::varlen_attention", mutates_args=())
def varlen_attention(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, scale: float,
                     causal: bool) -> Tuple[Tensor, Tensor]:
    """``(out, lse)``: ``out`` like ``q`` (``[tokens, heads, dim]``); ``lse`` ``[tokens, heads]``
    (accumulation type) where a kernel returned it, else empty (the backward then recomputes)."""
    kind = _route_of(q, v)
    if kind in VARLEN_ROUTES:
        return _varlen_forward(kind, q, k, v, lengths, scale, causal)
    kernels = attention_with_lse(q.device.type) if kind == "blocks_lse" else None
    runs = list(_runs(lengths, q.shape[0]))
    out = _Packer(q, runs)
    lse = _Packer(q, runs, shape=q.shape[:2], dtype=_lse_dtype(q)) if kernels else None
    for offset, count, length in runs:
        qs, ks, vs = (_heads_first(x, offset, count, length) for x in (q, k, v))
        if kernels:
            o, l_ = kernels[0](qs, ks, vs, causal, scale)
            lse.put(offset, l_)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)
        out.put(offset, o)
        del o
    return out.result(), (lse.result() if lse is not None else q.new_empty((0,)))


@varlen_attention.register_fake
def _varlen_attention_fake(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, scale: float,
                           causal: bool) -> Tuple[Tensor, Tensor]:
    kind = _route_of(q, v)
    if kind == "efficient":   # [sequences, heads, max length rounded up]: sized by the lengths' values
        size = torch.library.get_ctx().new_dynamic_size()
        return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), q.new_empty((size,), dtype=torch.float32)
    if kind == "flash":
        return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), q.new_empty((q.shape[1], q.shape[0]),
                                                                               dtype=torch.float32)
    lse = q.new_empty((q.shape[0], q.shape[1]), dtype=_lse_dtype(q)) if kind == "blocks_lse" \
        else q.new_empty((0,))
    return torch.empty_like(q), lse


def efficient_outputs(q: Tensor, v: Tensor, lengths: Optional[List[int]], entries: int) -> Tuple[Tensor, Tensor]:
    """The ``"efficient"`` route's outputs (empty, like ``q``) for lengths whose values are known:
    what its fake cannot give where the fake run has no shape environment for the log-sum-exp's
    unbacked size (the profiler's fake step, cost/tracker.py). ``lengths`` None: the largest it can
    be, every one of the ``entries`` sequences as long as all the rows."""
    found = [n for n in lengths if n > 0] if lengths is not None else None
    count, longest = (len(found), max(found, default=0)) if found is not None else (entries, q.shape[0])
    lse = q.new_empty((count * q.shape[1] * _efficient_lse_length(longest) if count else 0,), dtype=torch.float32)
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), lse


@torch.library.custom_op("fxtrain::varlen_attention_backward", mutates_args=())
def varlen_attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              lengths: Tensor, scale: float, causal: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``varlen_attention``'s ``out`` for q, k and v, sequence by sequence."""
    kind = _route_of(q, v)
    if kind in VARLEN_ROUTES:
        return _varlen_backward(kind, grad, q, k, v, out, lse, lengths, scale, causal)
    kernels = attention_with_lse(q.device.type) if kind == "blocks_lse" and (lse.numel() or q.shape[0] == 0) \
        else None
    runs = list(_runs(lengths, q.shape[0]))
    grads = [_Packer(x, runs) for x in (q, k, v)]
    for offset, count, length in runs:
        qs, ks, vs, gs = (_heads_first(x, offset, count, length) for x in (q, k, v, grad))
        if kernels:
            # lse as [count, heads, length] over token-major memory: the layout the forward made
            parts = kernels[1](gs, qs, ks, vs, _heads_first(out, offset, count, length),
                               _heads_first(lse, offset, count, length), causal, scale)
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
    if _route_of(q, v) in VARLEN_ROUTES:   # the kernels' gradients are contiguous (made so at worst)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
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
