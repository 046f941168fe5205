"""Options(memory_budget=...): the step is planned to fit, the plan is exact and costed right.

Oracles: eager PyTorch for the numbers (loss and gradients, dropout masks included), and the
profiler's real-mode counter (``profile/measure.py: measure_step``: live tensor bytes of a real
step on the test device, what torch's MemTracker reads) for the peak the plan promises. Models are
tiny so that the planning (a handful of fake steps) and the real steps take seconds.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fxtrain
from fxtrain import models
from fxtrain.capture.budget import MemoryBudgetWarning
from fxtrain.module import CaptureError
from fxtrain.options import Options, resolve
from fxtrain.profile.measure import measure_step
from utils import current_device, to_device

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

VOCAB = 500


def _gpt2(dropout: float = 0.0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, n_positions=64, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False)
    torch.manual_seed(0)
    return to_device(GPT2LMHeadModel(cfg))


def _batch(b: int = 4, s: int = 48):
    return models.synthetic_batch("clm", b, s, VOCAB, generator=torch.Generator().manual_seed(0),
                                  device=current_device())


@pytest.fixture(scope="module")
def eager_peak() -> int:
    """Whole-step peak of eager PyTorch (AdamW): parameters, state, batch, activations, grads."""
    return measure_step(_gpt2(), optimizer="adamw", **_batch()).peak_bytes


@pytest.mark.cpu_only(reason="option parsing: no tensors")
def test_budget_option_parsing(monkeypatch) -> None:
    assert Options(memory_budget="6GiB").memory_budget == 6 * 2 ** 30
    assert Options(memory_budget="512 MB").memory_budget == 512 * 10 ** 6
    assert Options(memory_budget=1000).memory_budget == 1000
    monkeypatch.setenv("FXTRAIN_MEMORY_BUDGET", "2MiB")
    monkeypatch.setenv("FXTRAIN_OPTIMIZER", "adamw")
    effective = resolve(None)
    assert effective.memory_budget == 2 * 2 ** 20 and effective.optimizer == "adamw"
    for bad in ({"memory_budget": "lots"}, {"memory_budget": 0}, {"optimizer": "lion"},
                {"memory_budget": "1GiB", "backward": "autograd"}):
        with pytest.raises(ValueError):
            Options(**bad)


def test_plan_fits_and_the_measured_peak_is_the_planned_one(eager_peak: int) -> None:
    budget = int(0.75 * eager_peak)
    model = _gpt2()
    tm = fxtrain.TrainModule(model, Options(memory_budget=budget, optimizer="adamw", fallback="raise"))
    measured = measure_step(tm, optimizer="adamw", params_model=model, **_batch())
    info = tm.capture_info()
    plan = info.memory_plan
    assert plan is not None and plan.fits, plan
    assert plan.budget_bytes == budget and plan.optimizer == "adamw"
    assert plan.planned_peak_bytes <= budget < plan.unplanned_peak_bytes
    assert plan.saved_bytes > 0 and plan.dropped_values > 0 and plan.extra_flops >= 0
    # The promise: the real step peaks where the plan says (within 5%; it is exact to a few bytes
    # here) and below the budget.
    if info.executor == "inductor":   # costed before fusion: its buffer reuse only lowers the peak
        assert measured.peak_bytes <= plan.planned_peak_bytes
    else:
        assert abs(measured.peak_bytes - plan.planned_peak_bytes) <= 0.05 * plan.planned_peak_bytes
    assert measured.peak_bytes <= budget
    assert info.records[0].runtime.startswith("graph: memory budget")
    assert "memory plan:" in str(info)
    # The profiler costs the budgeted capture the same way (its own capture, the same plan).
    report = fxtrain.profile(_gpt2(), optimizer="adamw", options=Options(memory_budget=budget), **_batch())
    assert report.memory_plan is not None
    if info.executor == "inductor":
        # Known gap: the profiler's inductor-based capture plans on its own (4 vs 10 values dropped
        # on this model, planned peaks 1.7% apart): both fit; docs/profiling.md, "Limits".
        assert report.peak_memory_bytes == report.memory_plan.planned_peak_bytes <= budget
    else:
        assert report.peak_memory_bytes == plan.planned_peak_bytes


def test_a_budget_that_fits_recomputes_nothing(eager_peak: int) -> None:
    model = _gpt2()
    tm = fxtrain.TrainModule(model, Options(memory_budget=4 * eager_peak, optimizer="adamw"))
    tm(**_batch()).loss.backward()
    plan = tm.capture_info().memory_plan
    assert plan.fits and plan.dropped_values == 0 and plan.extra_flops == 0
    assert plan.planned_peak_bytes == plan.unplanned_peak_bytes


def _step(module: torch.nn.Module, seed: int):
    torch.manual_seed(seed)
    out = module(**_batch())
    out.loss.backward()
    return out.loss.detach()


def test_loss_and_grads_equal_eager_with_dropout() -> None:
    """Recomputation never redraws a dropout mask: dropout outputs are recomputed from the saved mask.
    With the eager executor, which draws eager's masks (inductor draws its own random numbers)."""
    eager, graph, budgeted = _gpt2(0.1), _gpt2(0.1), _gpt2(0.1)
    peak = measure_step(_gpt2(0.1), **_batch()).peak_bytes
    ref = fxtrain.TrainModule(graph, Options(backward="graph", fallback="raise", executor="eager"))
    tm = fxtrain.TrainModule(budgeted, Options(memory_budget=int(0.62 * peak), fallback="raise", executor="eager"))
    for seed in (1, 2):   # the second step draws other masks: still eager's
        losses = [_step(m, seed) for m in (eager, ref, tm)]
        assert torch.equal(losses[0], losses[1]) and torch.equal(losses[0], losses[2])
        for (name, e), g, b in zip(eager.named_parameters(), graph.parameters(), budgeted.parameters()):
            assert torch.equal(b.grad, g.grad), name      # the same ops on the same values
            torch.testing.assert_close(b.grad, e.grad, rtol=1e-5, atol=1e-6, msg=name)
        for m in (eager, graph, budgeted):
            m.zero_grad(set_to_none=True)
    plan = tm.capture_info().memory_plan
    assert plan.fits and plan.dropped_values > 0
    backward = tm.capture_info().records[0].backward_graph
    ops = {str(n.target) for n in backward.graph.nodes if n.op == "call_function"}
    assert "aten.native_dropout.default" not in ops           # no mask drawn again
    masks = [n for n in backward.graph.nodes if n.op == "placeholder" and n.meta["val"].dtype == torch.bool]
    assert any(u.target is torch.ops.aten.mul.Tensor for m in masks for u in m.users), \
        "no dropout output recomputed from its saved mask"


def test_below_the_smallest_peak_warns_once_or_raises() -> None:
    model = to_device(torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                          torch.nn.GELU(), torch.nn.Linear(256, 1)))
    x = to_device(torch.randn(1024, 32))
    eager = copy.deepcopy(model)
    tm = fxtrain.TrainModule(model, Options(memory_budget=1024))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            tm(x).sum().backward()
    budget_warnings = [w for w in caught if issubclass(w.category, MemoryBudgetWarning)]
    assert len(budget_warnings) == 1
    plan = tm.capture_info().memory_plan
    assert not plan.fits and plan.smallest_peak_bytes is not None
    assert plan.smallest_peak_bytes <= plan.planned_peak_bytes < plan.unplanned_peak_bytes
    message = str(budget_warnings[0].message)
    assert "below the smallest peak" in message and "KiB" in message
    eager(x).sum().backward()
    eager(x).sum().backward()
    for a, b in zip(eager.parameters(), model.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    strict = fxtrain.TrainModule(copy.deepcopy(eager), Options(memory_budget=1024, fallback="raise"))
    with pytest.raises(CaptureError, match="below the smallest peak"):
        strict(x)


def test_profile_reports_the_largest_batch_with_recomputation() -> None:
    """``fxtrain profile MODEL --budget B``: the largest batch without and with recomputation."""
    with torch.device("meta"):
        model = models.PRESETS["gpt2-tiny"].build()
    batch = models.preset_batch("gpt2-tiny", 4, 64, device=current_device())
    report = fxtrain.profile(model, optimizer="adamw", **batch)   # the meta model: costed on the batch's device
    budget = 2 * report.peak_memory_bytes
    plain = report.max_batch(budget)
    recomputing = report.max_batch_recomputed(budget)
    plan = report.recompute_plan
    assert recomputing > plain >= 4
    assert plan.fits and plan.planned_peak_bytes <= budget < plan.unplanned_peak_bytes
    assert report.recompute_fit.batch == recomputing
    text = str(report)
    assert "max batch, recomputing" in text and "plan" in text


def test_a_cache_hit_runs_and_reports_the_plan(tmp_path, eager_peak: int) -> None:
    options = Options(memory_budget=int(0.75 * eager_peak), optimizer="adamw", cache_dir=str(tmp_path),
                      fallback="raise")
    live, loaded = _gpt2(), _gpt2()
    first = fxtrain.TrainModule(live, options)
    _step(first, 0)
    second = fxtrain.TrainModule(loaded, options)
    _step(second, 0)
    assert second.capture_info().cache_hits == 1, second.capture_info().cache_log
    plan = second.capture_info().memory_plan
    assert plan is not None and plan.fits and plan.dropped_values > 0
    assert plan.planned_peak_bytes == first.capture_info().memory_plan.planned_peak_bytes
    assert second.capture_info().records[0].runtime.startswith("graph")
    for a, b in zip(live.parameters(), loaded.parameters()):
        if second.capture_info().executor == "inductor":   # kernels compiled once more: not bit for bit
            torch.testing.assert_close(a.grad, b.grad)
        else:
            assert torch.equal(a.grad, b.grad)


def test_a_budgeted_step_is_compiled_once_and_then_frozen() -> None:
    """The budget is the partition stage's choice (capture/pipeline.py: compile_step): the executor
    compiles the plan's graphs once (not the default split's first, then the plan's), and nothing
    writes into the step afterwards."""
    import dataclasses
    from fxtrain.capture.backend import Plugins
    from fxtrain.runtime.executors import EagerExecutor
    compiled = []

    class Counting(EagerExecutor):
        def compile(self, graph, kind, example_inputs):
            compiled.append((kind, graph))
            return super().compile(graph, kind, example_inputs)

    peak = measure_step(_gpt2(), **_batch()).peak_bytes
    eager = _gpt2()
    tm = fxtrain.TrainModule(_gpt2(), Options(memory_budget=int(0.62 * peak), fallback="raise"),
                             plugins=Plugins(executor=Counting()))
    torch.testing.assert_close(_step(tm, 1), _step(eager, 1))
    for (name, e), b in zip(eager.named_parameters(), tm.module.parameters()):
        torch.testing.assert_close(b.grad, e.grad, rtol=1e-5, atol=1e-6, msg=name)
    record = tm.capture_info().records[0]
    assert record.memory_plan.fits and record.memory_plan.dropped_values > 0
    assert [kind for kind, _ in compiled] == ["forward", "backward"], compiled
    assert compiled[0][1] is record.forward_graph
    assert record.runtime.startswith("graph: memory budget")
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.step.forward_graph = None
