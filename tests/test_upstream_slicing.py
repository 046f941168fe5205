"""Upstream slicing against eager: classifier heads that keep one row per sequence."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxtrain
from fxtrain import models
from fxtrain.runtime.deferred import DeferredTensor
from utils import to_device, train_parity, wrap_pair

SHAPES = [(4, 16), (3, 11), (5, 20)]
STATE_ATOL = 3e-4  # see test_label_sparsity.py: AdamW amplifies rounding noise in zero-true gradients


def _bert_cls():
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, num_labels=3, problem_type="single_label_classification",
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg)


@pytest.mark.parametrize("name,build,pad", [("roberta", lambda: models.roberta_cls(32, 2, 2, 1000), 1),
                                            pytest.param("bert", _bert_cls, 0, marks=pytest.mark.extended)])
def test_sequence_classification_matches_eager(name, build, pad):
    torch.manual_seed(0)
    tm, ref = wrap_pair(build())
    g = torch.Generator().manual_seed(3)
    batches = [models.synthetic_batch("cls", b, s, 1000, padding=0.3, pad_id=pad, generator=g) for b, s in SHAPES]
    train_parity(tm, ref, batches, lambda out, _: out.loss, state_atol=STATE_ATOL,
                 compare_outputs=lambda o, r: torch.testing.assert_close(o.logits, r.logits, atol=1e-5, rtol=1e-4))
    info = tm.capture_info()
    assert info.optimizations["upstream_slicing"].startswith("on:"), info.optimizations
    assert "3 matmul" in info.optimizations["upstream_slicing"]  # last FFN (2) and attention output
    assert (info.graphs, info.graph_breaks) == (1, 0)


class LastToken(nn.Module):
    """Keeps the last position (``h[:, -1]``) and also returns the full hidden states."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.mix = nn.Linear(8, 8)
        self.ffn = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        self.ln = nn.LayerNorm(8)
        self.cls = nn.Linear(8, 2)

    def forward(self, ids, y):
        e = self.emb(ids)
        h = e + torch.cumsum(self.mix(e), dim=1)           # mixes positions: the region stops here
        h = self.ln(h + self.ffn(h))
        logits = self.cls(h[:, -1])
        return F.cross_entropy(logits, y), h


def test_last_token_and_returned_hidden_states_are_deferred():
    torch.manual_seed(0)
    tm, ref = wrap_pair(LastToken())
    batches = [dict(ids=torch.randint(0, 30, (b, s)), y=torch.randint(0, 2, (b,))) for b, s in SHAPES]

    def compare(out, ref_out):
        assert isinstance(out[1], DeferredTensor)
        torch.testing.assert_close(out[1], ref_out[1], atol=1e-5, rtol=1e-4)

    train_parity(tm, ref, batches, lambda out, _: out[0], compare_outputs=compare, state_atol=STATE_ATOL)
    assert "2 matmul" in tm.capture_info().optimizations["upstream_slicing"]


def test_off_by_option():
    torch.manual_seed(0)
    tm, ref = wrap_pair(LastToken(), upstream_slicing="off")
    batch = to_device(dict(ids=torch.randint(0, 30, (3, 5)), y=torch.randint(0, 2, (3,))))
    out = tm(**batch)
    assert not isinstance(out[1], DeferredTensor)
    torch.testing.assert_close(out[0], ref(**batch)[0])
    assert tm.capture_info().optimizations["upstream_slicing"] == "off: off by option"
