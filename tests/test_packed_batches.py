"""Packed batches (several documents per row, HF's ``DataCollatorWithFlattening``): attention runs
document by document (``passes/documents.py``), and loss and gradients are eager's.

The issue's oracle is eager on the same documents padded one per row; eager on the packed batch
itself must agree too. HF Llama and GPT-2 both build the "same document, causal" mask from the
restarting ``position_ids`` when there is no ``attention_mask`` and no cache (``use_cache=False``).
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DataCollatorWithFlattening

from fxtrain import models
from test_varlen_attention import _Recorder
from utils import assert_grads_equal, assert_state_equal, count_syncs, to_device, train_parity, wrap_pair

# What these tests check is what the passes compute: on an accelerator they stay on whatever their
# launches cost there (tests/conftest.py: passes_whatever_they_cost).
pytestmark = pytest.mark.usefixtures("passes_whatever_they_cost")

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


def _with_padding(batch):
    """Packed rows that also carry padding and an ``attention_mask`` (the first row's last 4)."""
    out = dict(batch, attention_mask=torch.ones_like(batch["input_ids"]))
    out["attention_mask"][0, 12:] = 0
    out["labels"] = out["labels"].masked_fill(out["attention_mask"] == 0, -100)
    return out


@pytest.mark.parametrize("name", ["llama", pytest.param("gpt2", marks=pytest.mark.extended)])
def test_packed_batches_train_like_eager(name):
    """(a) loss, every gradient and the updated weights equal eager's on the same documents padded
    one per row, and (b) eager's on the packed batch itself, over batches of different layouts
    served by one capture (d). (c) On the last, every attention kernel runs on one document (or a
    run of equal-length ones), never over a whole packed row as eager does, and the step
    synchronises once (the batch guard's read, which brings the document lengths).

    Llama then trains on (d) ``use_cache=True``, where HF builds a plain causal mask that eager
    applies across documents (fxtrain must too: a capture of its own, the pass off), and on packed
    rows with padding and an ``attention_mask`` (padding and causal order, across documents
    again): exact, the pass off and saying why."""
    tm, padded_ref = wrap_pair(_model(name), dynamic=None)   # every batch is 2 x 16: static sizes
    packed_ref = copy.deepcopy(padded_ref)
    refs = (padded_ref, packed_ref)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (tm, *refs)]
    steps = []
    for i, rows in enumerate(LAYOUTS):
        docs = _documents(rows, seed=i)
        steps.append((_packed(docs), _padded(docs)))
    if name == "llama":
        later = _packed(_documents(LAYOUTS[0], seed=3))
        steps += [(dict(later, use_cache=True),) * 2, (_with_padding(later),) * 2]
    for i, (packed, padded) in enumerate(steps):
        packed, padded = to_device(packed), to_device(padded)
        if i < len(LAYOUTS):
            assert int((packed["labels"] != -100).sum()) == int((padded["labels"][:, 1:] != -100).sum())
        with count_syncs() as counter, _Recorder() as kernels:
            loss = tm(**packed).loss
            loss.backward()
        if i == len(LAYOUTS) - 1:
            assert counter.total == 1, counter.syncs
            lengths = [n for row in LAYOUTS[-1] for n in row]
            if kernels.varlen:   # CUDA's one-call route: one kernel call per layer over every document
                assert not kernels.shapes and kernels.sequences == [lengths] * 2, (kernels.shapes, kernels.sequences)
            else:
                assert kernels.shapes and all(s[2] in lengths and s[2] < 16 for s in kernels.shapes), kernels.shapes
                assert sorted(n for s in kernels.shapes for n in [s[2]] * s[0]) == sorted(lengths * 2)
            with _Recorder() as eager:
                packed_loss = packed_ref(**packed).loss
                packed_loss.backward()
            assert eager.shapes == [(2, 2, 16, 16)] * 2   # what the pass spares: whole rows
        else:
            packed_loss = packed_ref(**packed).loss
            packed_loss.backward()
        padded_loss = padded_ref(**padded).loss
        padded_loss.backward()
        for ref, ref_loss in zip(refs, (padded_loss, packed_loss)):
            torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-4)
            assert_grads_equal(tm.module, ref)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for ref in refs:
            assert_state_equal(tm.module, ref)
    info = tm.capture_info()
    reports = [r.optimizations["packed_attention"] for r in info.records]
    assert reports[0] == "on: attention density 0.40 < 0.9: 2 of 2 attention(s) run document by document", reports
    # position_ids are not taken for an attention mask (their values are not 0/1)
    why = info.records[0].optimizations["padding_elimination"]
    assert why == "off: no single [batch, seq] attention mask input gates every attention", why
    assert info.dense_batches == {}, info.dense_batches
    if name == "llama":
        assert len(reports) == 3, reports
        # use_cache=True: the report names what eager does (causal across documents) and the fix;
        # nothing claims padding in a batch that has none.
        # (no mask at all, or, from transformers 5.17, a plain causal mask tensor)
        assert reports[1].startswith("off: a packed batch (6 documents in 2 row(s): position_ids restarts) with "
                                     "no attention mask") or reports[1].startswith(
            "off: a packed batch (6 documents in 2 row(s): position_ids restarts) with a plain causal mask "
            "over whole rows"), reports
        assert "across documents" in reports[1] and "use_cache=False" in reports[1], reports
        why = info.records[1].optimizations["padding_elimination"]
        assert why.startswith("off: an attention has no mask: nothing marks padding tokens") or \
            why == "off: no single [batch, seq] attention mask input gates every attention", why
        assert reports[2].startswith("off:"), reports   # padding elimination's, or a mask not the documents'
    else:
        assert len(reports) == 1, reports


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


def test_packed_documents_under_bf16_autocast():
    """Llama's rotary embedding leaves q and k in float32 under bf16 autocast, beside a bf16 v:
    attention per document gets them cast as autocast casts SDPA's (before, the CPU kernel refused
    the mix and the capture fell back to eager)."""
    tm, ref = wrap_pair(_model("llama"), dynamic=None, fallback="raise")
    for i, rows in enumerate(LAYOUTS[:2]):
        batch = to_device(_packed(_documents(rows, seed=i)))
        with torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16):
            loss, ref_loss = tm(**batch).loss, ref(**batch).loss
        torch.testing.assert_close(loss, ref_loss, atol=2e-2, rtol=2e-2)
        loss.backward(); ref_loss.backward()
        assert_grads_equal(tm.module, ref, atol=2e-2, rtol=2e-2)
        tm.zero_grad(); ref.zero_grad()
    assert tm.capture_info().optimizations["packed_attention"].startswith("on"), tm.capture_info().optimizations


def test_packed_documents_through_attention_in_eager_ops():
    """HF Llama set to ``attn_implementation="eager"``: its attention written out in eager ops
    (passes/eager_attention.py) is the SDPA it computes and runs document by document; its
    document mask blocks keys with float32's lowest value, not ``-inf``, which hides them as
    exactly. Loss, gradients and updated weights equal eager's over two layouts served by one
    capture. Before, attention stayed over whole rows ("no attention")."""
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=64, pad_token_id=0)
    config._attn_implementation = "eager"
    tm, ref = wrap_pair(transformers.LlamaForCausalLM(config), dynamic=None)
    batches = [_packed(_documents(rows, seed=i)) for i, rows in enumerate(LAYOUTS[:2])]
    train_parity(tm, ref, batches, lambda out, _: out.loss)
    info = tm.capture_info()
    assert len(info.records) == 1 and info.dense_batches == {}, (info.records, info.dense_batches)
    assert info.optimizations["packed_attention"].endswith(": 2 of 2 attention(s) run document by document"), \
        info.optimizations


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


class _GroupedQueryDocuments(nn.Module):
    """Bidirectional attention within documents, 4 query heads sharing one key/value head
    (``enable_gqa``): the pass repeats the key/value head as SDPA pairs them."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.q = nn.Linear(16, 16, bias=False)
        self.kv = nn.Linear(16, 8, bias=False)
        self.head = nn.Linear(16, 50)

    def forward(self, input_ids, position_ids, labels):
        b, s = input_ids.shape
        h = self.emb(input_ids)
        q = self.q(h).view(b, s, 4, 4).transpose(1, 2)
        k, v = (t.reshape(b, s, 1, 4).transpose(1, 2) for t in self.kv(h).split(4, dim=-1))
        doc = (torch.diff(position_ids, dim=-1, prepend=position_ids[:, :1] - 1) != 1).cumsum(-1)
        mask = doc[:, None, :, None] == doc[:, None, None, :]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return F.cross_entropy(self.head(a.transpose(1, 2).reshape(b, s, 16)).flatten(0, 1), labels.flatten())


def test_grouped_query_bidirectional_documents():
    """Another kind of document mask (no causal order, grouped key/value heads), and a second batch
    of other rows and documents (a position that does not grow by one starts one: ``0, 1, 1``)
    served by the same capture."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(_GroupedQueryDocuments())
    g = torch.Generator().manual_seed(0)
    positions = [[[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3]],
                 [[0, 0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 1, 1, 2, 0]]]
    batches = [dict(input_ids=torch.randint(0, 50, (len(p), 8), generator=g), position_ids=torch.tensor(p),
                    labels=torch.randint(0, 50, (len(p), 8), generator=g)) for p in positions]
    train_parity(tm, ref, batches, lambda out, b: out)
    info = tm.capture_info()
    assert info.optimizations["packed_attention"].startswith("on:"), info.optimizations
    assert len(info.records) == 1 and info.dense_batches == {}, (info.records, info.dense_batches)



def test_token_type_ids_are_not_taken_for_restarting_positions():
    """A BERT-MLM batch with no attention mask and no position_ids: its token_type_ids (zeros, or
    0s then 1s for sentence pairs) are no packed positions, so the report gives no packing advice,
    and training is eager's."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=VOCAB))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (2, 12), generator=g)
    types = torch.zeros(2, 12, dtype=torch.long)
    types[1, 6:] = 1
    batch = dict(input_ids=ids, token_type_ids=types, labels=ids.masked_fill(torch.rand(2, 12, generator=g) < 0.7, -100))
    # The tied embedding's gradient sums its two uses in another order than eager (1.5e-5 apart).
    train_parity(tm, ref, [batch], lambda out, _: out.loss, atol=5e-5)
    why = tm.capture_info().optimizations["packed_attention"]
    assert why.startswith("off:") and "packed batch" not in why, why


@pytest.mark.cpu_only(reason="the CPU's launch rule: the CPU runs one kernel call per run of equal-length documents")
def test_the_cpu_weighs_a_kernel_call_per_run_of_documents(monkeypatch):
    """On the CPU each run of equal-length documents is a kernel call of its own, which the CPU's
    launch rule weighs (cost/launches.py): the tiny Llama's 2 attentions over documents of 5, 3, 6,
    2, 7 and 9 tokens are 12 calls, more host work than the arithmetic they skip, so the pass is off
    by default there and the step trains as eager's."""
    import fxtrain
    from fxtrain.capture import pipeline
    from fxtrain.cost import launches
    monkeypatch.setattr(pipeline, "rates_for", launches.rates_for)   # undo the module's fixture
    model = to_device(_model("llama"))
    ref = copy.deepcopy(model)
    tm = fxtrain.TrainModule(model)
    batch = to_device(_packed(_documents(LAYOUTS[0], 0)))
    loss, ref_loss = tm(**batch).loss, ref(**batch).loss
    torch.testing.assert_close(loss, ref_loss)
    loss.backward(); ref_loss.backward()
    assert_grads_equal(model, ref)
    why = tm.capture_info().optimizations["packed_attention"]
    assert why.startswith("off: on the cpu the host's work and the arithmetic share the cores: "), why
    assert "2 attention(s) run as 12 kernel calls (one per run of equal lengths)" in why, why
