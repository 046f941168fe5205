"""End-to-end smoke: the one-line wrapper trains like eager on an MLP and a tiny BERT-MLM."""
import copy

import torch

import fxtrain
from fxtrain import models
from utils import to_device


def _assert_grads_equal(a: torch.nn.Module, b: torch.nn.Module, atol: float = 1e-5) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=1e-4, msg=name)


def test_mlp_trains_like_eager_over_changing_batches():
    torch.manual_seed(0)
    net = to_device(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 3)))
    ref = copy.deepcopy(net)
    tm = fxtrain.TrainModule(net, fxtrain.Options(fallback="raise"))
    opt, ref_opt = torch.optim.AdamW(tm.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for batch in (5, 9, 4):
        x, y = to_device((torch.randn(batch, 8), torch.randint(0, 3, (batch,))))
        loss = torch.nn.functional.cross_entropy(tm(x), y)
        ref_loss = torch.nn.functional.cross_entropy(ref(x), y)
        torch.testing.assert_close(loss, ref_loss)
        loss.backward(); ref_loss.backward()
        _assert_grads_equal(net, ref)
        opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
    info = tm.capture_info()
    # Default sizes: the first batch's, then symbolic once a size changes; later sizes reuse that graph.
    assert info.graphs == 2 and info.graph_breaks == 0 and info.fallback_reason is None
    assert [r.mode for r in info.records] == ["train", "train"]


def test_bert_mlm_loss_and_grads_equal_eager_with_unused_logits():
    model = to_device(models.build("bert-tiny"))
    ref = copy.deepcopy(model)
    tm = fxtrain.TrainModule(model, fxtrain.Options(fallback="raise"))
    for batch, seq in ((4, 16), (3, 11)):
        b = to_device(models.preset_batch("bert-tiny", batch, seq, padding=0.3, label_density=0.2))
        out, ref_out = tm(**b), ref(**b)
        torch.testing.assert_close(out.loss, ref_out.loss)
        torch.testing.assert_close(out.logits, ref_out.logits)
        out.loss.backward(); ref_out.loss.backward()
        _assert_grads_equal(model, ref)
        model.zero_grad(); ref.zero_grad()
    assert tm.capture_info().graphs == 2  # static sizes first, symbolic after the change
