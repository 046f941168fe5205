"""Label sparsity against eager: loss, logits and every gradient equal, and the pass really fires."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxtrain
from fxtrain import models
from fxtrain.runtime.deferred import DeferredTensor
from utils import current_device, assert_grads_equal, long_params, to_device, train_parity, wrap_pair

# What these tests check is what the passes compute: on an accelerator they stay on whatever their
# launches cost there (tests/conftest.py: passes_whatever_they_cost).
pytestmark = pytest.mark.usefixtures("passes_whatever_they_cost")

SHAPES = [(4, 16), (3, 11), (5, 20)]
# AdamW turns gradients that are pure rounding noise (the key bias of attention has a true gradient
# of 0) into full-size steps, so parameters are compared looser than the gradients themselves.
STATE_ATOL = 3e-4


def _fired(tm):
    why = tm.capture_info().optimizations["label_sparsity"]
    assert why.startswith("on:"), why
    return why


def _check_logits(out, ref_out):
    assert isinstance(out.logits, DeferredTensor)
    # After the first AdamW step the logits come from parameters that differ by that step's rounding
    # noise (STATE_ATOL): the first batch's logits are bit-equal, later ones within a few 1e-5.
    torch.testing.assert_close(out.logits, ref_out.logits, atol=5e-5, rtol=1e-4)


def _batches(kind, pad_id, seed, **kw):
    g = torch.Generator().manual_seed(seed)
    return [models.synthetic_batch(kind, b, s, 1000, padding=0.3, pad_id=pad_id, generator=g, device=current_device(), **kw) for b, s in SHAPES]


MLM = {
    "bert": (lambda: models.bert_mlm(hidden=32, layers=2, heads=2, vocab=1000), 0),
    "roberta": (lambda: models.roberta_mlm(hidden=32, layers=2, heads=2, vocab=1000), 1),
    "distilbert": (lambda: models.distilbert_mlm(hidden=32, layers=2, heads=2, vocab=1000), 0),
    "electra": (lambda: models.electra_mlm(hidden=32, layers=2, heads=2, vocab=1000), 0),
}
CLM = {
    "gpt2": lambda: models.gpt2_lm(hidden=32, layers=2, heads=2, vocab=1000, positions=64),
    "llama": lambda: models.llama_lm(hidden=32, layers=2, heads=2, vocab=1000),
}


@pytest.mark.parametrize("name", long_params(sorted(MLM), keep=["bert", "distilbert"]))
def test_mlm_heads_match_eager(name):
    build, pad = MLM[name]
    torch.manual_seed(0)
    tm, ref = wrap_pair(build())
    train_parity(tm, ref, _batches("mlm", pad, 1, label_density=0.1), lambda out, _: out.loss,
                 compare_outputs=_check_logits, state_atol=STATE_ATOL)
    assert "matmul" in _fired(tm)
    assert tm.capture_info().graphs == 1


@pytest.mark.parametrize("name", long_params(sorted(CLM), keep=["gpt2"]))
def test_causal_lm_with_label_shifting_matches_eager(name):
    torch.manual_seed(0)
    tm, ref = wrap_pair(CLM[name]())
    train_parity(tm, ref, _batches("clm", 0, 2, labels_at_end=0.25), lambda out, _: out.loss,
                 compare_outputs=_check_logits, state_atol=STATE_ATOL)
    _fired(tm)


def test_logits_never_read_are_never_computed():
    torch.manual_seed(0)
    tm = fxtrain.TrainModule(to_device(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=1000)),
                             fxtrain.Options(fallback="raise"))
    out = tm(**_batches("mlm", 0, 3, label_density=0.1)[0])
    out.loss.backward()
    assert isinstance(out.logits, DeferredTensor) and not out.logits.is_materialized
    assert out.logits.shape == (4, 16, 1000) and out.logits.requires_grad  # metadata needs no compute
    assert not out.logits.is_materialized
    # The head's forward graph multiplies only labelled rows by the decoder: no [B*S, vocab] matmul.
    fw = tm.capture_info().records[0].forward_graph
    vocab_outputs = [n for n in fw.graph.nodes if n.op == "call_function" and "mm" in str(n.target)
                     and n.meta["val"].shape[-1] == 1000]
    # Rows of the decoder output: a size known only at run time (the labelled count), not batch x seq.
    assert vocab_outputs and all(str(n.meta["val"].shape[0]).startswith("u") for n in vocab_outputs)


def test_user_also_differentiates_the_logits():
    """Logits consumed by the loss the user builds: gradients through both paths equal eager's."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=1000))
    batches = _batches("mlm", 0, 4, label_density=0.1)

    def loss_of(out, batch):
        return out.loss + 0.1 * out.logits.float().pow(2).mean()

    train_parity(tm, ref, batches, loss_of, state_atol=STATE_ATOL)
    _fired(tm)


def test_logits_read_after_backward_for_metrics():
    torch.manual_seed(0)
    tm, ref = wrap_pair(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=1000))
    batch = _batches("mlm", 0, 5, label_density=0.1)[0]
    out, ref_out = tm(**batch), ref(**batch)
    out.loss.backward(); ref_out.loss.backward()
    assert torch.equal(out.logits.argmax(-1), ref_out.logits.argmax(-1))
    assert_grads_equal(tm.module, ref)


@pytest.mark.parametrize("mode,expect", [("auto", "off:"), ("on", "on:")])
def test_dense_labels(mode, expect):
    """Every position labelled: 'auto' leaves the graph alone (nothing to skip); 'on' is still exact."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=1000), label_sparsity=mode)
    g = torch.Generator().manual_seed(6)
    batches = [models.synthetic_batch("mlm", b, s, 1000, padding=0.0, label_density=1.0, generator=g)
               for b, s in SHAPES]
    train_parity(tm, ref, batches, lambda out, _: out.loss, state_atol=STATE_ATOL)
    assert tm.capture_info().optimizations["label_sparsity"].startswith(expect)


def test_batch_without_any_label_gives_eagers_answer():
    torch.manual_seed(0)
    tm, ref = wrap_pair(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=1000))
    batches = _batches("mlm", 0, 7, label_density=0.1)
    tm(**batches[0]).loss.backward()  # capture on a normal batch
    for p in tm.parameters():
        p.grad = None
    empty = dict(batches[1], labels=torch.full_like(batches[1]["labels"], -100))
    out, ref_out = tm(**empty), ref(**empty)
    # Mean over no label is eager's NaN (0/0); test_sum_reduction_... covers a finite empty loss.
    assert torch.isnan(ref_out.loss)
    torch.testing.assert_close(out.loss, ref_out.loss, equal_nan=True)
    _fired(tm)


class SumLossLM(nn.Module):
    """A hand-written LM head with a summed loss and a custom ignore_index."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.mix = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)
        self.head = nn.Linear(16, 50)

    def forward(self, ids, labels):
        h = torch.relu(self.mix(self.emb(ids))) + self.emb(ids)
        logits = self.head(self.ln(h))
        return F.cross_entropy(logits.view(-1, 50), labels.view(-1), ignore_index=-1, reduction="sum")


def test_sum_reduction_custom_ignore_index_and_empty_batch():
    torch.manual_seed(0)
    tm, ref = wrap_pair(SumLossLM())
    ids = torch.randint(0, 50, (3, 7))
    labels = torch.where(torch.rand(3, 7) < 0.2, ids, torch.full_like(ids, -1))
    labels[0, 0] = 5
    ids, labels = to_device((ids, labels))
    for lab in (labels, torch.full_like(labels, -1)):  # the second batch has no label at all: loss 0
        for p in list(tm.parameters()) + list(ref.parameters()):
            p.grad = None
        loss, ref_loss = tm(ids, lab), ref(ids, lab)
        torch.testing.assert_close(loss, ref_loss)
        loss.backward(); ref_loss.backward()
        for (name, p), q in zip(tm.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    assert "2 matmul" in _fired(tm)


def test_off_by_option_and_env(monkeypatch):
    monkeypatch.setenv("FXTRAIN_LABEL_SPARSITY", "off")
    # Padding elimination would defer the logits too (they hold padding positions).
    tm = fxtrain.TrainModule(to_device(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=1000)),
                             fxtrain.Options(fallback="raise", padding_elimination="off"))
    out = tm(**_batches("mlm", 0, 8, label_density=0.1)[0])
    assert not isinstance(out.logits, DeferredTensor)
    assert tm.capture_info().optimizations["label_sparsity"] == "off: off by option"
