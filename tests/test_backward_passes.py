"""Rewrites of the aten backward graph: gradients equal eager's and the rewrite really fires."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxtrain import models
from utils import assert_grads_equal, current_device, to_device, train_parity, wrap_pair


class _Classifier(nn.Module):
    def __init__(self, reduction, ignore_index, label_smoothing, classes=300):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, classes))
        self.kw = dict(reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing)

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y, **self.kw)


# These rewrite the aten backward graph, which only the graph runtime runs: forced here (the default
# "auto" picks it where the rewrite saves more than replaying the graph costs), and with both executors.
@pytest.mark.parametrize("reduction,smoothing,fires,executor", [
    ("mean", 0.0, True, "eager"), pytest.param("sum", 0.0, True, "eager", marks=pytest.mark.extended),
    ("mean", 0.1, False, "eager"), pytest.param("mean", 0.0, False, "inductor", marks=pytest.mark.extended)])
def test_cross_entropy_gradient_in_one_pass(reduction, smoothing, fires, executor):
    torch.manual_seed(0)
    tm, ref = wrap_pair(_Classifier(reduction, 7, smoothing), label_sparsity="off", backward="graph",
                        executor=executor)
    g = torch.Generator().manual_seed(1)
    batches = []
    for n in (12, 9, 20):
        y = torch.randint(0, 300, (n,), generator=g)
        y[::3] = 7  # ignored rows: their gradient must stay exactly zero
        batches.append({"x": torch.randn(n, 16, generator=g), "y": y})
    train_parity(tm, ref, batches, lambda out, _: out)
    why = tm.capture_info().optimizations["cross_entropy_grad"]
    assert why.startswith("on:" if fires else "off:"), why
    if executor == "inductor":   # it fuses these gradients itself (executors.py): the pass stays out of its way
        assert why == "off: inductor fuses the log_softmax and nll_loss gradients itself", why


def test_few_classes_left_alone():
    torch.manual_seed(0)
    tm, _ = wrap_pair(_Classifier("mean", -100, 0.0, classes=10), label_sparsity="off", executor="eager")
    tm(*to_device((torch.randn(4, 16), torch.randint(0, 10, (4,))))).backward()
    assert tm.capture_info().optimizations["cross_entropy_grad"] == \
        "off: fewer than 256 classes: nothing worth removing"


def test_dense_gpt2_step():
    """The dense GPT-2 LM step (nothing for the sparsity passes): both backward rewrites fire."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(models.gpt2_lm(hidden=32, layers=2, heads=2, vocab=1000, positions=64), backward="graph",
                        executor="eager")
    g = torch.Generator().manual_seed(2)
    batches = [models.synthetic_batch("clm", b, s, 1000, generator=g) for b, s in [(4, 16), (3, 11)]]
    train_parity(tm, ref, batches, lambda out, _: out.loss, state_atol=3e-4)
    info = tm.capture_info().optimizations
    assert info["cross_entropy_grad"].startswith("on:") and info["tied_embedding_grad"].startswith("on:")
    assert info["label_sparsity"].startswith("off:") and info["padding_elimination"].startswith("off:")
    assert all(r.runtime.startswith("graph") for r in tm.capture_info().records)


def test_tied_embedding_gradient_under_bf16_autocast():
    """Under autocast the decoder's matmul runs in bf16 and its weight gradient reaches the float32
    sum through a cast (a copy): the embedding rows are still added into it in place, and the tied
    weight's gradient stays eager's (under the same autocast)."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(models.gpt2_lm(hidden=32, layers=2, heads=2, vocab=1000, positions=64), backward="graph",
                        executor="eager")
    batch = to_device(models.synthetic_batch("clm", 4, 16, 1000, generator=torch.Generator().manual_seed(2)))
    with torch.autocast(current_device().type, dtype=torch.bfloat16):
        loss, ref_loss = tm(**batch).loss, ref(**batch).loss
    torch.testing.assert_close(loss, ref_loss, atol=2e-2, rtol=2e-2)
    loss.backward(); ref_loss.backward()
    assert_grads_equal(tm.module, ref, atol=2e-2, rtol=2e-2)
    tied = tm.module.get_input_embeddings().weight
    assert tied is tm.module.get_output_embeddings().weight
    torch.testing.assert_close(tied.grad, ref.get_input_embeddings().weight.grad, atol=1e-3, rtol=1e-3)
    assert tm.capture_info().optimizations["tied_embedding_grad"].startswith("on:")


@pytest.mark.parametrize("device_rates,mode", [(None, "graph"), ("accelerator", "autograd")])
def test_the_backward_is_replayed_only_where_its_passes_pay_on_the_device(monkeypatch, device_rates, mode):
    """The default ``backward="auto"`` weighs the one-hot traffic ``cross_entropy_grad`` removes
    (an 8192-class head over 512 rows: 48 MiB a step) against replaying the backward graph from
    Python (~5 µs an op, cost/launches.py: ``replay_pays``). On the CPU the same cores move that
    memory: the graph mode. On an accelerator it is ~13 µs of device time in a step bound by the
    host's launches, which the replay would lengthen: PyTorch's engine runs the backward, as eager
    does. Either way the numbers are eager's."""
    from fxtrain.capture import pipeline
    from fxtrain.cost.launches import ACCELERATOR
    monkeypatch.setattr(pipeline, "rates_for", lambda device_type: ACCELERATOR if device_rates else None)
    torch.manual_seed(0)
    tm, ref = wrap_pair(_Classifier("mean", -100, 0.0, classes=8192), label_sparsity="off")
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(n, 16, generator=g), "y": torch.randint(0, 8192, (n,), generator=g)}
               for n in (512, 384)]
    train_parity(tm, ref, batches, lambda out, _: out)
    (record,) = tm.capture_info().records
    assert tm.capture_info().optimizations["cross_entropy_grad"].startswith("on:")
    assert record.runtime.startswith(f"{mode}: "), record.runtime
    # What capture_info() prints says it: the backward passes it lists act only in the graph mode.
    assert f"  runtime graph 0 (train): {record.runtime}" in str(tm.capture_info()).splitlines()
    if device_rates:
        assert "replaying" in record.runtime and "on accelerator" in record.runtime, record.runtime
    else:
        assert "backward passes save " in record.runtime, record.runtime
