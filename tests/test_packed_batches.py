"""Packed batches (several documents per row, HF's ``DataCollatorWithFlattening``): attention runs
document by document (``passes/documents.py``), and loss and gradients are eager's.

The issue's oracle is eager on the same documents padded one per row; eager on the packed batch
itself must agree too. HF Llama and GPT-2 both build the "same document, causal" mask from the
restarting ``position_ids`` when there is no ``attention_mask`` and no cache (``use_cache=False``).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DataCollatorWithFlattening

from fxtrain import models
from test_varlen_attention import _Recorder
from utils import assert_grads_equal, assert_state_equal, count_syncs, to_device, train_parity, wrap_pair

VOCAB = 1000


def _model(name):
    torch.manual_seed(0)
    if name == "llama":
        return models.llama_lm(hidden=32, layers=2, heads=2, vocab=VOCAB)
    return models.gpt2_lm(hidden=32, layers=2, heads=2, vocab=VOCAB, positions=64)


def _documents(rows, seed):
    """``rows``: each row's document lengths. Token ids drawn from ``seed`` (never the pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in row] for row in rows]


def _packed(docs):
    """One packed row per entry of ``docs`` (rows of equal total length), as the collator makes it."""
    collate = DataCollatorWithFlattening()
    rows = [collate([{"input_ids": d} for d in row]) for row in docs]
    batch = {k: torch.cat([r[k] for r in rows]) for k in ("input_ids", "labels", "position_ids")}
    return dict(batch, use_cache=False)


def _padded(docs):
    """The same documents, one per row, right-padded: the issue's eager oracle."""
    flat = [d for row in docs for d in row]
    s = max(len(d) for d in flat)
    ids = torch.zeros(len(flat), s, dtype=torch.long)
    mask = torch.zeros(len(flat), s, dtype=torch.long)
    for i, d in enumerate(flat):
        ids[i, :len(d)] = torch.tensor(d)
        mask[i, :len(d)] = 1
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), use_cache=False)


# Rows of 16 tokens; the second layout differs (more, shorter documents, one row a single document).
LAYOUTS = [[[5, 3, 6, 2], [7, 9]], [[2, 2, 4, 8], [16]], [[1, 4, 11], [3, 3, 3, 7]]]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_packed_equals_eager_on_the_documents_padded_one_per_row(name):
    """(a), (c) and (d): loss, every gradient and the updated weights equal eager's on the padded
    documents, over batches of different layouts served by one capture; on the last one every
    attention kernel runs on one document (or a run of equal-length ones), never over a whole
    packed row as eager does, and the step synchronises once (the batch guard's read, which
    brings the document lengths)."""
    tm, ref = wrap_pair(_model(name))
    opt = torch.optim.AdamW(tm.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for i, rows in enumerate(LAYOUTS):
        docs = _documents(rows, seed=i)
        packed, padded = to_device(_packed(docs)), to_device(_padded(docs))
        assert int((packed["labels"] != -100).sum()) == int((padded["labels"][:, 1:] != -100).sum())
        last = i == len(LAYOUTS) - 1
        with count_syncs() as counter, _Recorder() as kernels:
            loss = tm(**packed).loss
            loss.backward()
        ref_loss = ref(**padded).loss
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-4)
        assert_grads_equal(tm.module, ref)
        opt.step(); ref_opt.step()
        opt.zero_grad(); ref_opt.zero_grad()
        assert_state_equal(tm.module, ref)
    assert counter.total == 1, counter.syncs
    lengths = [n for row in rows for n in row]
    assert kernels.shapes and all(s[2] in lengths and s[2] < 16 for s in kernels.shapes), kernels.shapes
    assert sorted(n for s in kernels.shapes for n in [s[2]] * s[0]) == sorted(lengths * 2)
    info = tm.capture_info()
    assert info.optimizations["packed_attention"].startswith("on:"), info.optimizations
    assert "2 of 2 attention(s) run document by document" in info.optimizations["packed_attention"]
    assert len(info.records) == 1 and info.dense_batches == {}, (info.records, info.dense_batches)


def test_packed_equals_eager_on_the_packed_batch_then_a_cache_batch():
    """(b) and (d): eager on the packed batch itself, which runs attention over whole rows with
    the document mask; then ``use_cache=True``, where HF builds a plain causal mask that eager
    applies across documents: fxtrain must too (a capture of its own, with the pass off)."""
    tm, ref = wrap_pair(_model("llama"))
    packed = [_packed(_documents(rows, seed=i)) for i, rows in enumerate(LAYOUTS[:2])]
    with _Recorder() as eager:
        ref(**to_device(packed[0])).loss.backward()
    assert eager.shapes == [(2, 2, 16, 16)] * 2   # what the pass spares: whole rows
    ref.zero_grad()
    train_parity(tm, ref, [packed[0], dict(packed[1], use_cache=True)], lambda out, b: out.loss)
    reports = [r.optimizations["packed_attention"] for r in tm.capture_info().records]
    assert len(reports) == 2 and reports[0].startswith("on:") and reports[1].startswith("off:"), reports


class _DocumentsAndPadding(nn.Module):
    """One causal attention block whose mask is "same document" AND the keys ``keep`` marks: a
    document mask exactly while ``keep`` is all ones, so that a later batch can break it."""

    def __init__(self, vocab=50, hidden=16, heads=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.head = nn.Linear(hidden, vocab)
        self.heads = heads

    def forward(self, input_ids, position_ids, keep, labels):
        b, s = input_ids.shape
        h = self.emb(input_ids)
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(h).split(h.shape[-1], dim=2))
        starts = torch.diff(position_ids, dim=-1, prepend=position_ids[:, :1] - 1) != 1
        doc = starts.cumsum(-1)
        causal = torch.ones(s, s, dtype=torch.bool, device=h.device).tril()
        mask = (doc[:, None, :, None] == doc[:, None, None, :]) & causal & keep.bool()[:, None, None, :]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        logits = self.head(a.transpose(1, 2).reshape(b, s, -1) + h)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_a_batch_whose_mask_is_no_document_mask_runs_dense(tmp_path):
    """The batch guard checks the mask on every batch: one that also masks keys (here a padding
    mask) takes the dense route, with eager's numbers; a document mask again runs per document.
    The same from the on-disk cache (the guard and the step are plain torch ops there too)."""
    g = torch.Generator().manual_seed(0)

    def batch(keep_last):
        pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 0, 1, 2, 3, 4, 5]])
        keep = torch.ones(2, 8, dtype=torch.long)
        keep[:, -1] = keep_last
        return dict(input_ids=torch.randint(0, 50, (2, 8), generator=g), position_ids=pos, keep=keep,
                    labels=torch.randint(0, 50, (2, 8), generator=g))

    batches = [batch(1), batch(0), batch(1)]
    for hits in (0, 1):
        torch.manual_seed(0)
        tm, ref = wrap_pair(_DocumentsAndPadding(), cache_dir=str(tmp_path))
        train_parity(tm, ref, batches, lambda out, b: out)
        info = tm.capture_info()
        assert info.cache_hits == hits, info.cache_log
        assert info.optimizations["packed_attention"].startswith("on:"), info.optimizations
        assert sum(info.dense_batches.values()) == 1, info.dense_batches
