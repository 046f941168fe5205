"""The same features through every way fxtrain runs a step: the eager executor's autograd and
aten-graph runtimes, and the inductor executor. Eager PyTorch is the oracle."""
import os

import pytest
import torch
from torch import nn

import fxtrain
from fxtrain import models
from utils import assert_grads_equal, long_params, to_device, train_parity, wrap_pair

RUNS = {"eager-autograd": dict(executor="eager", backward="autograd"),
        "eager-graph": dict(executor="eager", backward="graph"),
        "inductor": dict(executor="inductor")}


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k: float):
        ctx.k = k
        return x * k

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


class WithFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(Scale.apply(torch.tanh(self.a(x)), 1.5)).sum()


@pytest.mark.usefixtures("passes_whatever_they_cost")
@pytest.mark.parametrize("run", long_params(sorted(RUNS), keep=[r for r in RUNS if r != "inductor"]))
def test_sparse_lm_step_with_every_feature(run, tmp_path):
    """Label sparsity and padding elimination fire, logits are deferred and read, densities are
    measured, graphs are dumped: all with eager's numbers."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=400), save_graphs_dir=str(tmp_path),
                        **RUNS[run])
    g = torch.Generator().manual_seed(0)
    batches = [models.synthetic_batch("mlm", 4, n, 400, padding=0.5, label_density=0.15, generator=g)
               for n in (24, 20)]
    train_parity(tm, ref, batches, lambda out, _: out.loss,
                 compare_outputs=lambda a, b: torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-4))
    info = tm.capture_info()
    assert info.optimizations["label_sparsity"].startswith("on:"), info.optimizations
    assert info.optimizations["padding_elimination"].startswith("on:"), info.optimizations
    assert set(info.density) == {"label density", "token density"}
    expected = "graph" if run != "eager-autograd" else "autograd"
    assert all(r.runtime.startswith(expected) for r in info.records), [r.runtime for r in info.records]
    dumped = os.listdir(tmp_path)
    assert dumped and all(os.path.exists(tmp_path / d / "backward_graph.py") for d in dumped)


@pytest.mark.parametrize("run", long_params(sorted(RUNS), keep=[r for r in RUNS if r != "inductor"]))
def test_python_op_and_absent_gradient(run):
    torch.manual_seed(0)
    tm, ref = wrap_pair(WithFunction(), **RUNS[run])
    for b in (4, 6):
        x = to_device(torch.randn(b, 8))
        tm(x).backward(); ref(x).backward()
        assert_grads_equal(tm.module, ref)
        tm.zero_grad(); ref.zero_grad()
    assert tm.capture_info().python_ops == [f"{__name__}.Scale"]


@pytest.mark.parametrize("run", long_params(["eager-autograd", "eager-graph", "inductor"],
                                             keep=["eager-autograd", "eager-graph"]))
def test_cache_hit_runs_through_the_same_runtime(run, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # none of its entries from before
    x = to_device(torch.randn(5, 8))
    grads = []
    from torch._dynamo.utils import counters
    for attempt in range(2):
        torch.manual_seed(0)
        model = to_device(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2)))
        tm = fxtrain.TrainModule(model, fxtrain.Options(fallback="raise", cache_dir=str(tmp_path), **RUNS[run]))
        bypassed, missed = counters["inductor"]["fxgraph_cache_bypass"], counters["inductor"]["fxgraph_cache_miss"]
        tm(x).pow(2).sum().backward()
        # inductor's own graph cache serves loaded graphs too (it bypassed itself without a shape env)
        assert counters["inductor"]["fxgraph_cache_bypass"] == bypassed
        if attempt == 1:
            # ... and holds both graphs already: the capture compiled the form fxtrain's cache stores
            # (it missed on graphs inductor had rewritten in place, or whose attributes came back from
            # the pickle in another order)
            assert counters["inductor"]["fxgraph_cache_miss"] == missed
        grads.append([p.grad.clone() for p in model.parameters()])
        info = tm.capture_info()
        assert (info.cache_hits, info.cache_misses) == ((0, 1) if attempt == 0 else (1, 0)), info.cache_log
        # the hit runs the runtime mode the live capture ran
        assert info.records[0].runtime.startswith("graph" if run == "inductor" else run.split("-")[1]), \
            info.records[0].runtime
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    torch.manual_seed(0)
    ref = to_device(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2)))
    ref(x).pow(2).sum().backward()
    for a, p in zip(grads[1], ref.parameters()):
        torch.testing.assert_close(a, p.grad)


@pytest.mark.cpu_only(reason="option parsing: no tensors")
def test_unknown_backward_mode_is_refused():
    with pytest.raises(ValueError, match="backward"):
        fxtrain.Options(backward="sometimes")


def test_inductor_convolution_saved_input_keeps_its_layout():
    """The forward and backward are compiled apart: the input a convolution saves must reach the
    backward with the strides it was compiled for (inductor's layout optimisation changed them)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 4, stride=4), nn.Flatten(), nn.Linear(8 * 4 * 4, 5))
    tm, ref = wrap_pair(model, executor="inductor")
    for _ in range(2):
        x = to_device(torch.randn(2, 3, 16, 16))
        tm(x).pow(2).sum().backward(); ref(x).pow(2).sum().backward()
        assert_grads_equal(tm.module, ref)
        tm.zero_grad(); ref.zero_grad()


def test_profiler_costs_the_graphs_of_either_executor():
    """The profiler runs the graphs of the executor the options name (inductor: its decompositions
    and recomputing partitioner), marked and on fake tensors: the matmuls cost the same."""
    model = to_device(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10)))
    x = to_device(torch.randn(16, 32))
    reports = {name: fxtrain.profile(model, x, options=fxtrain.Options(executor=name)) for name in ("eager", "inductor")}
    matmuls = 2 * 16 * (32 * 64 + 64 * 10)
    for name, report in reports.items():
        assert report.flops_forward >= matmuls, (name, report.flops_forward)
        assert report.flops_backward >= matmuls, (name, report.flops_backward)
        assert report.peak_memory_bytes > 0
    assert abs(reports["inductor"].flops_forward - reports["eager"].flops_forward) <= 0.05 * matmuls


@pytest.mark.parametrize("run", sorted(RUNS))
def test_dropout_in_training_runs_with_every_executor(run):
    """Random ops in a training graph: inductor's joint-graph passes turn them into its own seed
    ops, which needs the fake mode torch.compile provides around them (a capture error before).
    The eager executors draw eager's masks (same seed, same values); inductor draws its own, so
    there only the mechanics are checked: dropout is live, gradients are finite and non-zero."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.5), nn.Linear(32, 1))
    tm, ref = wrap_pair(model, fallback="raise", **RUNS[run])
    x = to_device(torch.randn(8, 16))
    torch.manual_seed(1)
    loss = tm(x).sum()
    loss.backward()
    torch.manual_seed(1)
    ref_loss = ref(x).sum()
    ref_loss.backward()
    if run != "inductor":
        torch.testing.assert_close(loss, ref_loss)
        assert_grads_equal(tm.module, ref)
    grads = [p.grad for p in tm.module.parameters()]
    assert all(g is not None and bool(torch.isfinite(g).all()) and bool(g.abs().sum() > 0) for g in grads)
    assert not torch.equal(tm(x).detach(), tm(x).detach())   # masks drawn afresh on each call
