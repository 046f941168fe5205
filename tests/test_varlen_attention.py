"""Attention on real tokens only (issue 15): ``fxtrain::varlen_attention`` against eager.

The op itself against SDPA on the padded layout (both kernels, bidirectional and causal, an empty
sequence); the pass on HF GPT-2 with left padding, on a model whose mask is more than padding (kept
on the padded path, exact), and a later batch whose mask changes kind (the batch guard sends it to
the dense graph); that attention no longer runs over ``[batch, seq]``; attention dropout keeps the
old path. The MLM families and right-padded GPT-2 are checked in test_padding_elimination.py, whose
parity tests now also assert that every attention ran sequence by sequence.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fxtrain import models
from fxtrain import torch_private as tp
from fxtrain.runtime import varlen_attention as va
from utils import (REQUESTED_DEVICE, current_device, long_params, to_device, train_left_padded_gpt2, train_parity,
                   wrap_pair)

# What these tests check is what the passes compute: on an accelerator they stay on whatever their
# launches cost there (tests/conftest.py: passes_whatever_they_cost).
pytestmark = pytest.mark.usefixtures("passes_whatever_they_cost")


# The kernels the test device has: "generic" everywhere; "with_lse" where torch_private registers a
# kernel that returns the log-sum-exp (the CPU's flash kernel), so nothing is skipped on any device.
KERNELS = ["generic"] + (["with_lse"] if tp.attention_with_lse(REQUESTED_DEVICE.type) is not None else [])


def _qkv(g, tokens, heads, dim, layout):
    """q, k, v ``[tokens, heads, dim]``: contiguous leaves, or "strided" as models hand them over:
    q a transposed ``[heads, tokens, dim]``, k and v halves of one ``[tokens, heads, 2 * dim]``
    projection (row strides other than ``heads * dim``, k's and v's storage offsets not 0)."""
    def randn(*shape):
        return to_device(torch.randn(*shape, generator=g, dtype=torch.float64)).requires_grad_()
    if layout == "packed":
        return tuple(randn(tokens, heads, dim) for _ in range(3))
    kv = randn(tokens, heads, 2 * dim)
    return randn(heads, tokens, dim).transpose(0, 1), kv[..., :dim], kv[..., dim:]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["packed", "strided"])
def test_op_matches_padded_sdpa(kernel, causal, layout, monkeypatch):
    """Values and gradients equal SDPA over the padded layout with the padding (and causal) mask;
    "generic" is the path of devices without a log-sum-exp kernel (F.scaled_dot_product_attention
    forward, recomputed weights backward). The runs' blocks are strided views of the inputs, read
    and written in place: "strided" inputs check that they follow the inputs' own strides."""
    if kernel == "generic":
        monkeypatch.setattr(va, "attention_with_lse", lambda device_type: None)
    g = torch.Generator().manual_seed(0)
    lengths = [5, 3, 3, 0, 7, 1]   # a run of equal lengths (one batched call) and an empty sequence
    tokens, heads, dim = sum(lengths), 2, 8
    q, k, v = _qkv(g, tokens, heads, dim, layout)
    out, lse = va.varlen_attention(q, k, v, torch.tensor(lengths), 0.3, causal)
    assert lse.numel() == (0 if kernel == "generic" else tokens * heads)
    ref = va.reference(q, k, v, lengths, 0.3, causal)
    torch.testing.assert_close(out, ref)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b)


def test_op_refuses_lengths_of_another_batch():
    q = torch.zeros(6, 1, 8, device=current_device())   # head dim 8: on CUDA, the one-call route's own check
    with pytest.raises(RuntimeError, match="add up to 5"):
        va.varlen_attention(q, q, q, torch.tensor([2, 3]), 1.0, False)


def _gpt2():
    torch.manual_seed(0)
    return models.gpt2_lm(hidden=32, layers=2, heads=2, vocab=1000, positions=64)


def test_gpt2_left_padding_matches_eager():
    """Causal attention with left padding, default options (label sparsity too): each real token
    sees the real tokens at or before it in its own row; loss, gradients and weights are eager's."""
    tm, ref = wrap_pair(_gpt2())
    train_left_padded_gpt2(tm, ref)


def _llama_batches(side, seed=3, positions=False):
    g = torch.Generator().manual_seed(seed)
    batches = [models.synthetic_batch("clm", b, s, 1000, padding=0.4, padding_side=side, generator=g,
                                      labels_at_end=0.5) for b, s in [(4, 16), (3, 11)]]
    if positions:   # positions counted over the real tokens only (what a caller may pass)
        for batch in batches:
            batch["position_ids"] = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
    return batches


@pytest.mark.parametrize("side", long_params(["right", "left"], keep=["left"]))
def test_llama_rotary_attention_on_real_tokens(side):
    """Llama: rotary embeddings sit between the head split and attention. They run on the packed real
    tokens, each with the cos/sin of its own position in its padded row (HF counts positions from
    the row start, padding included, when no position_ids are given): eager's loss, gradients and
    weights, and every attention runs sequence by sequence."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(models.llama_lm(hidden=32, layers=2, heads=2, vocab=1000))
    train_parity(tm, ref, _llama_batches(side), lambda out, _: out.loss, state_atol=3e-4)
    why = tm.capture_info().optimizations["padding_elimination"]
    assert why.startswith("on:") and "sequence by sequence: 2 of 2" in why, why


def test_llama_given_positions_and_grouped_query_attention():
    """Left padding with position_ids given per row (cos/sin ``[batch, seq, dim]``: gathered per
    token) and grouped-query attention (4 heads share 2 key/value heads through repeat_kv, repeated
    on the packed rows too): eager's numbers, attention sequence by sequence."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(models.llama_lm(hidden=32, layers=2, heads=4, vocab=1000, kv_heads=2))
    train_parity(tm, ref, _llama_batches("left", seed=4, positions=True), lambda out, _: out.loss, state_atol=3e-4)
    why = tm.capture_info().optimizations["padding_elimination"]
    assert why.startswith("on:") and "sequence by sequence: 2 of 2" in why, why


class _PositionMix(nn.Module):
    """One causal attention block whose q goes through a per-position-looking op before attention:
    "table" multiplies by a ``[seq, dim]`` position table (per position, but not laid out
    ``[batch, ., seq, .]``), "roll" adds q shifted by one position (mixes positions)."""

    def __init__(self, kind, vocab=50, hidden=16, heads=2, seq=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.head = nn.Linear(hidden, vocab)
        self.register_buffer("table", torch.linspace(0.5, 1.5, seq * hidden // heads).view(seq, -1))
        self.kind, self.heads = kind, heads

    def forward(self, input_ids, attention_mask, labels):
        b, s = input_ids.shape
        h = self.emb(input_ids)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(h).split(h.shape[-1], dim=2))
        q = q * self.table[:s] if self.kind == "table" else q + torch.roll(q, 1, dims=2)
        keep = attention_mask.bool()[:, None, None, :] & torch.ones(s, s, dtype=torch.bool, device=h.device).tril()
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        logits = self.head(h + a.transpose(1, 2).reshape(b, s, -1))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


@pytest.mark.parametrize("kind", ["table", "roll"])
def test_ops_before_attention_that_are_not_rotary_stay_exact(kind):
    """A position table that is not ``[batch, ., seq, .]`` keeps attention on the padded layout (the
    report says why); an op that mixes positions is refused outright (padding positions would reach
    real ones): eager's numbers either way."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(_PositionMix(kind))
    g = torch.Generator().manual_seed(6)
    batch = models.synthetic_batch("clm", 4, 16, 50, padding=0.4, generator=g)
    train_parity(tm, ref, [batch], lambda out, _: out, state_atol=3e-4)
    why = tm.capture_info().optimizations["padding_elimination"]
    if kind == "table":
        assert why.startswith("on:") and "0 of 1" in why and "not [batch, ., seq, .]" in why, why
    else:
        assert why.startswith("off:") and "padding rows reach" in why, why


class _HeadSplit(nn.Module):
    """One attention block whose query holds each token's features in its heads "consecutive"ly
    (head j: features j * dim ..., as every model splits them) or "interleaved" (head j: features j,
    j + heads, ...): the per-sequence attention unflattens the packed rows into consecutive heads, so
    the second must keep the padded attention."""

    def __init__(self, layout, vocab=50, hidden=16, heads=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)
        self.layout, self.heads = layout, heads

    def forward(self, input_ids, attention_mask, labels):
        b, s = input_ids.shape
        h = self.emb(input_ids)
        q, k, v = self.qkv(h).split(h.shape[-1], dim=2)
        k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in (k, v))
        if self.layout == "interleaved":
            q = q.reshape(b, s, -1, self.heads).permute(0, 3, 1, 2)
        else:
            q = q.reshape(b, s, self.heads, -1).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask.bool()[:, None, None, :])
        logits = self.head(h + self.out(a.transpose(1, 2).reshape(b, s, -1)))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


@pytest.mark.parametrize("layout", ["consecutive", "interleaved"])
def test_only_heads_of_consecutive_features_run_sequence_by_sequence(layout):
    """The matcher runs the capturing batch's layout ops on a probe whose values number each
    token's features and compares the heads they reach against a view of it: consecutive heads
    run sequence by sequence, interleaved ones stay padded; eager's numbers either way."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(_HeadSplit(layout))
    g = torch.Generator().manual_seed(6)
    batches = [models.synthetic_batch("mlm", 4, 16, 50, padding=0.4, label_density=0.3, generator=g)
               for _ in range(2)]
    train_parity(tm, ref, batches, lambda out, _: out, state_atol=3e-4)
    why = tm.capture_info().optimizations["padding_elimination"]
    assert why.startswith("on:"), why
    if layout == "consecutive":
        assert "sequence by sequence: 1 of 1" in why, why
    else:
        assert "0 of 1" in why and "its query does not split each token's features into heads" in why, why


class _Recorder(TorchDispatchMode):
    """The q shapes of every attention kernel a step runs, inside fxtrain's custom ops too."""

    def __init__(self):
        super().__init__()
        self.shapes, self.varlen, self.sequences = [], [], []

    @classmethod
    def ignore_compile_internals(cls):
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if "scaled_dot_product" in name and "backward" not in name:
            self.shapes.append(tuple(args[0].shape))
        elif name.endswith(("_efficient_attention_forward", "_flash_attention_forward")):
            self.varlen.append(tuple(args[0].shape))   # CUDA: one call over every sequence
            bounds = args[4 if "efficient" in name else 3].tolist()   # cu_seqlens
            self.sequences.append([e - s for s, e in zip(bounds, bounds[1:])])
        impl = tp.custom_op_impl_of(func)
        if impl is not None and func.namespace == "fxtrain":
            with self:
                return impl(*args, **kwargs)
        return func(*args, **kwargs)


def test_attention_never_runs_over_padding():
    """The rewritten graphs hold no SDPA, and every attention kernel of a step runs on one
    sequence's real tokens (or a run of equal-length ones): ``[n, heads, length, dim]`` with
    ``length`` a real length, never the padded one; eager runs ``[batch, heads, seq, dim]``."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=1000))
    batch = models.synthetic_batch("mlm", 4, 16, 1000, padding=0.4, generator=torch.Generator().manual_seed(5),
                                   label_density=0.2, device=current_device())
    lengths = batch["attention_mask"].sum(1).tolist()
    assert max(lengths) < 16
    tm(**batch).loss.backward()   # capture
    record = tm.capture_info().records[0]
    for graph in (record.dynamo_graph, record.forward_graph, record.backward_graph):
        targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
        assert not [t for t in targets if "scaled_dot_product" in t], targets
    assert any("varlen_attention" in str(n.target) for n in record.forward_graph.graph.nodes)
    with _Recorder() as ours:
        tm(**batch).loss.backward()
    with _Recorder() as eager:
        ref(**batch).loss.backward()
    assert eager.shapes == [(4, 2, 16, 16)] * 2
    if ours.varlen:   # CUDA's one-call route: one kernel call per layer over the real tokens
        assert not ours.shapes and len(ours.varlen) == 2, (ours.shapes, ours.varlen)
        assert all(s[-3] == sum(lengths) for s in ours.varlen), ours.varlen
        assert ours.sequences == [[n for n in lengths if n]] * 2, ours.sequences
        return
    assert ours.shapes, "no attention kernel ran"
    assert all(s[2] in lengths and s[2] < 16 for s in ours.shapes), ours.shapes
    assert sorted(n for s in ours.shapes for n in [s[2]] * s[0]) == sorted(lengths * 2)


class _DocAttention(nn.Module):
    """One attention block whose mask is padding AND same document (``doc`` a float per token, so
    that the attention mask stays the one integer ``[batch, seq]`` input marking padding)."""

    def __init__(self, vocab=50, hidden=16, heads=2, dropout=0.0):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)  # a key bias has a zero-true gradient: AdamW noise
        self.out = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)
        self.heads, self.dropout = heads, dropout

    def forward(self, input_ids, attention_mask, doc, labels):
        b, s = input_ids.shape
        h = self.emb(input_ids)
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(h).split(h.shape[-1], dim=2))
        keep = attention_mask.bool()[:, None, None, :] & (doc[:, None, :, None] == doc[:, None, None, :])
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=self.dropout if self.training else 0.0)
        h = h + self.out(a.transpose(1, 2).reshape(b, s, -1))
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def _doc_batch(seed, b, s, split=None):
    batch = models.synthetic_batch("mlm", b, s, 50, padding=0.4, generator=torch.Generator().manual_seed(seed),
                                   label_density=0.3)
    doc = torch.zeros(b, s)
    if split is not None:
        doc[:, split:] = 1.0   # two documents in every row
    batch["doc"] = doc
    return batch


def test_mask_beyond_padding_keeps_the_padded_attention():
    """Capturing batch with two documents per row: the mask is not padding alone, so attention
    stays on the padded layout (said in the report), and the step is still eager's."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(_DocAttention())
    train_parity(tm, ref, [_doc_batch(1, 4, 12, split=4), _doc_batch(2, 3, 10, split=3)], lambda out, _: out,
                 state_atol=3e-4)
    why = tm.capture_info().optimizations["padding_elimination"]
    assert why.startswith("on:") and "0 of 1" in why and "not padding plus causal order" in why, why


def test_a_later_mask_of_another_kind_takes_the_dense_route():
    """Captured on one-document rows (sequence-by-sequence attention), then a batch with two
    documents per row: the batch guard sees the mask change and runs the dense graph: eager's answer."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(_DocAttention())
    train_parity(tm, ref, [_doc_batch(1, 4, 12), _doc_batch(2, 3, 10, split=3), _doc_batch(3, 4, 9)],
                 lambda out, _: out, state_atol=3e-4)
    info = tm.capture_info()
    assert "1 of 1" in info.optimizations["padding_elimination"], info.optimizations["padding_elimination"]
    assert list(info.dense_batches.values()) == [1], info.dense_batches
    assert "attention mask" in next(iter(info.dense_batches))


def test_attention_dropout_keeps_the_padded_attention():
    """Eager's dropout mask is drawn over the padded ``[batch, heads, seq, seq]`` scores; per
    sequence there is no equal draw, so the attention keeps the padded path (and says why)."""
    torch.manual_seed(0)
    tm, _ = wrap_pair(_DocAttention(dropout=0.1))
    tm(**to_device(_doc_batch(1, 4, 12)))
    why = tm.capture_info().optimizations["padding_elimination"]
    assert "0 of 1" in why and "dropout" in why, why


class _PerSequence(nn.Module):
    """One attention per sequence of packed rows: through ``varlen_attention``, or as a loop of SDPA
    calls (the oracle the profiler already costs op by op)."""

    def __init__(self, heads=2, dim=4):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.w = nn.Parameter(torch.randn(heads * dim, heads * dim))

    def forward(self, x, lengths, varlen: bool):
        q = (x @ self.w).view(x.shape[0], self.heads, self.dim)
        if varlen:
            return va.varlen_attention(q, q, q, lengths, 0.5, True)[0].sum()
        outs, start = [], 0
        for n in lengths.tolist():
            block = q[start:start + n].transpose(0, 1)[None]
            outs.append(F.scaled_dot_product_attention(block, block, block, is_causal=True, scale=0.5).sum())
            start += n
        return sum(outs)


def test_profiler_costs_attention_from_the_batch_lengths():
    """The profiler counts ``varlen_attention`` from the batch's real lengths (``sum(length**2)``):
    forward and backward FLOPs equal those of the same attention written as one SDPA per sequence,
    and nothing is left unknown (before, the op was uncosted and FLOP-ideal ratios overstated)."""
    from fxtrain import profile
    torch.manual_seed(0)
    model = to_device(_PerSequence())
    x = to_device(torch.randn(21, 8))
    lengths = to_device(torch.tensor([9, 5, 5, 2]))   # fxtrain makes them on the host; inputs share a device
    reports = [profile(model, x, lengths, varlen, optimizations=False, reuse=False) for varlen in (True, False)]
    assert not reports[0].unknown_ops, reports[0].unknown_ops
    matmul = 2 * 21 * 8 * 8
    assert reports[0].flops_forward > matmul
    assert (reports[0].flops_forward, reports[0].flops_backward) == (reports[1].flops_forward, reports[1].flops_backward)
