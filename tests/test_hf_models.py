"""HF transformers models (tiny configs, random init) train exactly like eager, in one graph."""
import pytest
import torch

from fxtrain import models
from utils import to_device, train_parity, wrap_pair


def _compare_logits(out, ref_out):
    torch.testing.assert_close(out.logits, ref_out.logits, atol=1e-5, rtol=1e-4)


def _mlm_batches(vocab, pad_id, shapes):
    g = torch.Generator().manual_seed(1)
    return [models.synthetic_batch("mlm", b, s, vocab, padding=0.3, label_density=0.25, pad_id=pad_id, generator=g)
            for b, s in shapes]


SHAPES = [(4, 16), (3, 11), (5, 20)]


def _check(build, batches, eval_batch):
    torch.manual_seed(0)
    tm, ref = wrap_pair(build())
    train_parity(tm, ref, batches, lambda out, _: out.loss, compare_outputs=_compare_logits)
    info = tm.capture_info()
    assert (info.graphs, info.graph_breaks, info.fallback_reason) == (1, 0, None)
    tm.eval(); ref.eval()
    with torch.no_grad():
        eval_batch = to_device(eval_batch)
        out, ref_out = tm(**eval_batch), ref(**eval_batch)
    _compare_logits(out, ref_out)
    torch.testing.assert_close(out.loss, ref_out.loss, atol=1e-5, rtol=1e-4)
    assert type(out) is type(ref_out)


def test_bert_mlm():
    batches = _mlm_batches(1000, 0, SHAPES)
    _check(lambda: models.bert_mlm(hidden=32, layers=2, heads=2, vocab=1000), batches, batches[1])


def test_gpt2_lm():
    g = torch.Generator().manual_seed(2)
    batches = [models.synthetic_batch("clm", b, s, 1000, padding=0.25, generator=g) for b, s in SHAPES]
    _check(lambda: models.gpt2_lm(hidden=32, layers=2, heads=2, vocab=1000, positions=64), batches, batches[0])


def test_roberta_sequence_classification():
    g = torch.Generator().manual_seed(3)
    batches = [models.synthetic_batch("cls", b, s, 1000, padding=0.3, pad_id=1, generator=g) for b, s in SHAPES]
    _check(lambda: models.roberta_cls(hidden=32, layers=2, heads=2, vocab=1000), batches, batches[2])


@pytest.mark.extended
def test_t5_conditional_generation():
    g = torch.Generator().manual_seed(4)
    batches = []
    for b, s in SHAPES:
        enc = models.synthetic_batch("cls", b, s, 1000, padding=0.3, generator=g)
        dec = models.synthetic_batch("clm", b, max(2, s // 2), 1000, padding=0.2, generator=g)
        batches.append(dict(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=dec["labels"]))
    _check(lambda: models.t5(d_model=32, layers=2, heads=2, vocab=1000), batches, batches[1])
