"""The fallback policy on every call, scalar arguments that change, and what capture_info() reports.

Eager PyTorch is the oracle: after a fallback the module must train exactly as eager does (loss,
gradients, buffers), a user's own error must surface as eager raises it, and the graph-break count
must be this module's own, with its reasons.
"""
import copy
import dataclasses
import inspect
import os
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxtrain
import fxtrain.capture.backend as backend
import fxtrain.capture.pipeline as pipeline
from fxtrain import models
from utils import assert_grads_equal, assert_state_equal, current_device, to_device, wrap_pair


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    """These tests are about the default options: no FXTRAIN_* variable of the caller may leak in.
    Dynamo's automatic-dynamic state lives on the model's code objects, which every instance of a
    class shares once it breaks: start each test from a clean dynamo so that captures count alike
    whatever ran before."""
    for name in list(os.environ):
        if name.startswith("FXTRAIN_") and name != "FXTRAIN_LOG_LEVEL":
            monkeypatch.delenv(name)
    torch._dynamo.reset()


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def _fallbacks(caught):
    return [w for w in caught if issubclass(w.category, fxtrain.FallbackWarning)]


def _step(tm, ref, *args, **kwargs):
    """One forward and backward of both; outputs, gradients and buffers must agree."""
    out, r = tm(*args, **kwargs), ref(*args, **kwargs)
    _close(out, r)
    out.sum().backward(); r.sum().backward()
    assert_grads_equal(tm.module, ref)
    assert_state_equal(tm.module, ref)
    tm.zero_grad(); ref.zero_grad()


class Tempered(nn.Module):
    """The issue's model: a float argument that changes every step."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x, temperature: float):
        return self.l(x) / temperature


class Normed(nn.Module):
    """BatchNorm (a buffer updated in place by every training call) and an int argument."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x, k: int = 1):
        return self.bn(self.lin(x)) * k


class NormedBranch(nn.Module):
    """A BatchNorm update before a data-dependent branch: two graphs per call, the first of which
    updates buffers; the int argument reaches both graphs."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x, k: int = 1):
        h = self.bn(self.lin(x)) * k
        if h.sum() > -1e9:  # always true, but dynamo cannot know: a graph break
            return h * 2 + k
        return h - k


# ---------------------------------------------------------------------- scalars that change
def test_float_argument_changing_every_call_captures_at_most_three_times():
    torch.manual_seed(0)
    model = to_device(Tempered())
    ref = copy.deepcopy(model)
    tm = fxtrain.TrainModule(model)  # defaults, as a new user would
    opt, ref_opt = torch.optim.SGD(tm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxtrain.FallbackWarning)
        for i in range(80):
            x, t = to_device(torch.randn(2, 4)), 1 + i / 100
            loss, ref_loss = tm(x, t).sum(), ref(x, t).sum()
            _close(loss, ref_loss)
            loss.backward(); ref_loss.backward()
            assert_grads_equal(tm.module, ref)
            opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
    info = tm.capture_info()
    assert info.graphs <= 3 and info.fallback_reason is None, info.capture_reasons
    assert "float argument changed value" in info.records[1].reason
    assert_state_equal(tm.module, ref)


def test_float_inside_a_structure_and_int_arguments_become_symbolic():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x, cfg, steps: int):
            return self.l(x) * cfg["scale"] + steps

    torch.manual_seed(0)
    tm, ref = wrap_pair(Scaled(), dynamic=None)
    for i in range(30):
        _step(tm, ref, to_device(torch.randn(3, 4)), {"scale": 0.5 + i / 7}, steps=i % 5)
    assert tm.capture_info().graphs <= 4, tm.capture_info().capture_reasons


def test_first_capture_keeps_floats_constant():
    """The first capture specialises floats (fast first step); only a change makes them inputs."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(Tempered(), dynamic=None)
    for _ in range(3):
        _step(tm, ref, to_device(torch.randn(2, 4)), 2.0)
    assert tm.capture_info().graphs == 1 and tm._specialize_float


# ------------------------------------------------------------- failures on a later call
@pytest.mark.parametrize("fallback", ["eager", "raise"])
def test_recompile_limit_on_a_later_call_follows_the_policy(monkeypatch, fallback):
    monkeypatch.setenv("FXTRAIN_RECOMPILE_LIMIT", "1")
    torch.manual_seed(0)
    tm, ref = wrap_pair(Normed(), fallback=fallback, dynamic=None)
    for _ in range(3):
        _step(tm, ref, to_device(torch.randn(4, 4)))
    x = to_device(torch.randn(6, 4))  # a new batch size: a second capture, over the limit
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if fallback == "raise":
            with pytest.raises(fxtrain.CaptureError, match="recompile limit"):
                tm(x)
            ref(x)  # the call ran once, eagerly, to tell a capture failure from a user error
            assert_state_equal(tm.module, ref)
            return
        _step(tm, ref, x)
        for b in (5, 7, 4):
            _step(tm, ref, to_device(torch.randn(b, 4)))
    assert len(_fallbacks(caught)) == 1
    assert "recompile limit" in tm.capture_info().fallback_reason
    assert int(tm.module.bn.num_batches_tracked) == 7


def test_recompile_limit_on_hf_bert_batch_size_change_falls_back(monkeypatch):
    """The issue's second repro: FXTRAIN_RECOMPILE_LIMIT=1 and a new batch size on HF BERT."""
    monkeypatch.setenv("FXTRAIN_RECOMPILE_LIMIT", "1")
    torch.manual_seed(0)
    model = to_device(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=1000))
    ref = copy.deepcopy(model)
    tm = fxtrain.TrainModule(model)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b, s in ((4, 16), (3, 16), (5, 16)):
            batch = models.synthetic_batch("mlm", b, s, 1000, padding=0.3, label_density=0.3, generator=g,
                                           device=current_device())
            out, r = tm(**batch), ref(**batch)
            _close(out.loss, r.loss)
            out.loss.backward(); r.loss.backward()
            assert_grads_equal(tm.module, ref)
    assert len(_fallbacks(caught)) == 1 and "recompile limit" in tm.capture_info().fallback_reason


def _failing_passes(monkeypatch, fail_on_call):
    """run_passes raises on its ``fail_on_call``-th invocation (1-based) and after."""
    real, calls = pipeline.run_passes, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) >= fail_on_call:
            raise NotImplementedError("pass cannot handle aten.frobnicate")
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "run_passes", flaky)


@pytest.mark.parametrize("fallback", ["eager", "raise"])
def test_recapture_that_fails_after_a_graph_of_the_call_ran(monkeypatch, fallback):
    """A guard fails (a new int), the entry graph is recaptured and runs (BatchNorm updates), then
    capturing the piece after the graph break fails: the buffers are put back before eager reruns."""
    _failing_passes(monkeypatch, fail_on_call=4)  # call 1 makes graphs 1-2; call 2 fails on its second
    torch.manual_seed(0)
    tm, ref = wrap_pair(NormedBranch(), fallback=fallback, dynamic=None)
    x = to_device(torch.randn(4, 4))
    _step(tm, ref, x, k=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if fallback == "raise":
            with pytest.raises(fxtrain.CaptureError, match="aten.frobnicate"):
                tm(x, k=2)
            ref(x, k=2)
            assert_state_equal(tm.module, ref)  # BatchNorm updated once (by the eager rerun)
            return
        for k in (2, 3, 1):
            _step(tm, ref, to_device(torch.randn(4, 4)), k=k)
    assert len(_fallbacks(caught)) == 1
    assert "NotImplementedError: pass cannot handle aten.frobnicate" == tm.capture_info().fallback_reason
    assert int(tm.module.bn.num_batches_tracked) == 4


def _failing_runtime(monkeypatch, fail_on_run, graphs=lambda index: True, after=False):
    """Graphs compiled from now on raise on the ``fail_on_run``-th run (counted over all of them);
    ``after``: once the graph ran (its in-place buffer updates written), not before."""
    real, runs, built = backend.runner.build, [], []

    def build(step, executor, context, preference="auto", tiered=None):
        runtime = real(step, executor, context, preference, tiered)
        compiled = runtime.call
        built.append(step)
        if not graphs(len(built) - 1):
            return runtime

        def run(*args):
            runs.append(1)
            if len(runs) == fail_on_run and not after:
                raise RuntimeError("fxtrain runtime: replay buffer exhausted")
            out = compiled(*args)
            if len(runs) == fail_on_run:
                raise RuntimeError("fxtrain runtime: replay buffer exhausted")
            return out
        return dataclasses.replace(runtime, call=run)

    monkeypatch.setattr(backend.runner, "build", build)


@pytest.mark.parametrize("backward", ["autograd", "graph"])
def test_failure_after_a_single_graph_updated_buffers_updates_them_once(monkeypatch, backward):
    """The autograd runtime writes batch norm's statistics while the graph runs: a failure after
    that must not let the eager rerun update them a second time."""
    _failing_runtime(monkeypatch, fail_on_run=4, after=True)
    torch.manual_seed(0)
    tm, ref = wrap_pair(Normed(), backward=backward, fallback="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b in (3, 5, 6, 7, 3):
            _step(tm, ref, to_device(torch.randn(b, 4)))
    assert len(_fallbacks(caught)) == 1
    assert int(tm.module.bn.num_batches_tracked) == 5


@pytest.mark.parametrize("fallback", ["eager", "raise"])
def test_runtime_error_on_the_nth_call_follows_the_policy(monkeypatch, fallback):
    _failing_runtime(monkeypatch, fail_on_run=6)
    torch.manual_seed(0)
    tm, ref = wrap_pair(Normed(), fallback=fallback)
    for b in (3, 5, 6, 7, 3):  # not 4: a batch of 4 would share its symbol with the 4 features
        _step(tm, ref, to_device(torch.randn(b, 4)))
    assert tm.capture_info().graphs == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if fallback == "raise":
            x = to_device(torch.randn(3, 4))
            with pytest.raises(fxtrain.CaptureError, match="replay buffer exhausted"):
                tm(x)
            ref(x)
            assert_state_equal(tm.module, ref)
            return
        for b in (3, 7, 2):
            _step(tm, ref, to_device(torch.randn(b, 4)))
    assert len(_fallbacks(caught)) == 1
    assert tm.capture_info().fallback_reason == "RuntimeError: fxtrain runtime: replay buffer exhausted"
    assert int(tm.module.bn.num_batches_tracked) == 8


def test_runtime_error_in_a_later_graph_does_not_update_buffers_twice(monkeypatch):
    """Several graphs per call and the first updates BatchNorm: a failure in the second graph, on a
    call that captures nothing, must leave the statistics as one eager step would."""
    _failing_runtime(monkeypatch, fail_on_run=4, graphs=lambda index: index > 0)
    torch.manual_seed(0)
    tm, ref = wrap_pair(NormedBranch(), fallback="eager")
    for _ in range(3):
        _step(tm, ref, to_device(torch.randn(4, 4)))
    with pytest.warns(fxtrain.FallbackWarning, match="replay buffer exhausted"):
        _step(tm, ref, to_device(torch.randn(4, 4)))
    _step(tm, ref, to_device(torch.randn(4, 4)))
    assert int(tm.module.bn.num_batches_tracked) == 5


# ------------------------------------------------------------------------------ user errors
def test_user_error_on_a_later_call_is_eagers_error_and_capture_goes_on():
    class Checked(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x, n: int):
            if n > 3:
                raise ValueError(f"n must be at most 3, got {n}")
            return self.l(x) * n

    torch.manual_seed(0)
    tm, ref = wrap_pair(Checked(), fallback="eager")
    for n in (1, 2, 3):
        _step(tm, ref, to_device(torch.randn(2, 4)), n)
    graphs = tm.capture_info().graphs
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxtrain.FallbackWarning)
        with pytest.raises(ValueError, match="n must be at most 3, got 5") as err:
            tm(to_device(torch.randn(2, 4)), 5)
        assert type(err.value) is ValueError
        # a shape error too: eager's RuntimeError, not dynamo's
        with pytest.raises(RuntimeError) as eager_err:
            ref(to_device(torch.randn(2, 7)), 1)
        with pytest.raises(RuntimeError) as err:
            tm(to_device(torch.randn(2, 7)), 1)
        assert type(err.value) is type(eager_err.value) and str(err.value) == str(eager_err.value)
        _step(tm, ref, to_device(torch.randn(2, 4)), 2)
    info = tm.capture_info()
    assert info.fallback_reason is None and not tm._eager and info.graphs >= graphs


# ---------------------------------------------------------------------------- graph breaks
class CountsLabels(nn.Module):
    """Branches on a count known only at run time (as HF DeBERTa's loss does): dynamo files this
    break under counters["unimplemented"], not counters["graph_break"]."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 3)

    def forward(self, x, labels):
        logits = self.l(x)
        n = (labels >= 0).nonzero().size(0)
        if n > 0:
            return F.cross_entropy(logits, labels.clamp(min=0))
        return logits.sum() * 0


class TensorBranch(nn.Module):
    """A branch on a tensor's value: filed under counters["graph_break"]."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        h = self.l(x)
        if h.sum() > 0:
            return (h * 2).sum()
        return (h - 1).sum()


def test_break_filed_as_unimplemented_is_counted_with_its_reason():
    torch.manual_seed(0)
    tm, ref = wrap_pair(CountsLabels())
    x, y = to_device(torch.randn(5, 4)), to_device(torch.tensor([0, 2, -1, 1, 0]))
    _step(tm, ref, x, y)
    info = tm.capture_info()
    assert (info.graphs, info.graph_breaks) == (2, 1)
    assert len(info.break_reasons) == 1 and "Data-dependent branching" in info.break_reasons[0]
    assert "test_fallback.py" in info.break_reasons[0]  # where the break is
    assert [r.reason for r in info.records] == ["first call", "after a graph break"]


def test_two_modules_do_not_report_each_others_breaks():
    torch.manual_seed(0)
    a, ref_a = wrap_pair(CountsLabels())
    b, ref_b = wrap_pair(TensorBranch())
    c, ref_c = wrap_pair(Normed())
    y = to_device(torch.tensor([0, 2, -1, 1, 0]))
    for _ in range(2):
        _step(a, ref_a, to_device(torch.randn(5, 4)), y)
        _step(b, ref_b, to_device(torch.randn(5, 4)))
        _step(c, ref_c, to_device(torch.randn(5, 4)))
    a2, ref_a2 = wrap_pair(CountsLabels())  # a second instance of the same class breaks on its own
    _step(a2, ref_a2, to_device(torch.randn(5, 4)), y)
    ia, ib, ic, ia2 = (m.capture_info() for m in (a, b, c, a2))
    assert ic.graph_breaks == 0 and ic.break_reasons == []
    assert ia.graph_breaks == 1 and ia2.graph_breaks == 1 and ib.graph_breaks >= 1
    assert len(ib.break_reasons) == ib.graph_breaks
    # each reason points into its own module's forward, never the other's
    assert {_break_line(r) for r in ia.break_reasons + ia2.break_reasons} <= _lines(CountsLabels.forward)
    assert {_break_line(r) for r in ib.break_reasons} <= _lines(TensorBranch.forward)


def _break_line(reason):
    match = re.search(r"test_fallback\.py:(\d+) in forward", reason)
    assert match, reason
    return int(match.group(1))


def _lines(fn):
    source, first = inspect.getsourcelines(fn)
    return set(range(first, first + len(source)))


def test_hf_deberta_v2_counts_its_graph_break():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DebertaV2Config(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=32, max_position_embeddings=32, num_labels=3,
                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pooler_dropout=0.0)
    torch.manual_seed(0)
    tm, ref = wrap_pair(transformers.DebertaV2ForSequenceClassification(cfg))
    g = torch.Generator().manual_seed(0)
    for b, s in ((4, 12), (3, 9)):
        batch = to_device(dict(input_ids=torch.randint(0, 100, (b, s), generator=g),
                               labels=torch.randint(0, 3, (b,), generator=g)))
        out, r = tm(**batch), ref(**batch)
        _close(out.loss, r.loss)
        _close(out.logits, r.logits)
        out.loss.backward(); r.loss.backward()
        assert_grads_equal(tm.module, ref)
        tm.zero_grad(); ref.zero_grad()
    info = tm.capture_info()
    assert (info.graphs, info.graph_breaks) == (2, 1), info
    assert "Data-dependent branching" in info.break_reasons[0] and "modeling_deberta_v2.py" in info.break_reasons[0]


def test_nested_train_module_breaks_are_its_own():
    """An inner TrainModule that breaks, called from a custom Function inside an outer one."""

    class ThroughInner(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, inner):
            return inner(x)

        @staticmethod
        def backward(ctx, g):
            return g, None

    class Branches(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            h = self.l(x)
            if h.sum() > 0:
                return h * 2
            return h - 1

    class Outer(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.l, self.inner = nn.Linear(4, 4), inner

        def forward(self, x):
            return ThroughInner.apply(self.l(x), self.inner).sum()

    torch.manual_seed(0)
    inner = fxtrain.TrainModule(to_device(Branches()), fxtrain.Options(fallback="raise", dynamic=True))
    outer = fxtrain.TrainModule(to_device(Outer(inner)), fxtrain.Options(fallback="raise", dynamic=True))
    for b in (3, 5):
        outer(to_device(torch.randn(b, 4))).backward()
    assert outer.capture_info().graph_breaks == 0 and outer.capture_info().break_reasons == []
    assert inner.capture_info().graph_breaks >= 1


# --------------------------------------------------------------------------- on-disk cache
def test_cache_entry_never_serves_other_scalar_values(tmp_path):
    class Affine(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x, t: float = 1.0, k: int = 1):
            return self.l(x) / t + k

    torch.manual_seed(0)
    model, x = to_device(Affine()), to_device(torch.randn(2, 4))

    def run(calls):
        tm = fxtrain.TrainModule(copy.deepcopy(model), fxtrain.Options(cache_dir=str(tmp_path), fallback="raise"))
        for kw in calls:
            out = tm(x, **kw)
            out.sum().backward()
            _close(out, model(x, **kw))
        return tm.capture_info()

    run([dict(t=1.0, k=1), dict(t=2.0, k=1)])   # the recapture for t=2.0 must not replace t=1.0's entry
    info = run([dict(t=1.0, k=1), dict(t=1.0, k=3), dict(t=2.0, k=1), dict(t=1.0, k=1)])
    assert info.cache_hits >= 1, info.cache_log


# A custom op whose registered backward reads tensor values in Python, as transformers'
# grouped_mm_fallback before 5.2x (``for end in offs.tolist()``). AOTAutograd cannot trace it.
_SEGMENT_CALLS = {"forward": 0, "backward": 0}


@torch.library.custom_op("fxtrain_test_fallback::scale_segments", mutates_args=())
def scale_segments(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    _SEGMENT_CALLS["forward"] += 1
    out, start = torch.empty_like(x), 0
    for i, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] * (i + 1)
        start = end
    return out


@scale_segments.register_fake
def _(x, offs):
    return torch.empty_like(x)


def _scale_segments_backward(ctx, grad):
    # Counted when it runs for real: a capture may run it on fake tensors to see whether it traces.
    _SEGMENT_CALLS["backward"] += type(grad) is torch.Tensor
    out, start = torch.empty_like(grad), 0
    for i, end in enumerate(ctx.offs.tolist()):
        out[start:end] = grad[start:end] * (i + 1)
        start = end
    return out, None


def _keep_offs(ctx, inputs, output):
    ctx.offs = inputs[1]


torch.library.register_autograd("fxtrain_test_fallback::scale_segments", _scale_segments_backward,
                                setup_context=_keep_offs)


# The same op with a backward that is itself a custom op (with a fake implementation), as
# transformers 5.2x writes grouped_mm_fallback's: AOTAutograd traces it, and it stays in the graph.
@torch.library.custom_op("fxtrain_test_fallback::scale_segments_traced", mutates_args=())
def scale_segments_traced(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return scale_segments(x, offs)


@scale_segments_traced.register_fake
def _(x, offs):
    return torch.empty_like(x)


torch.library.register_autograd("fxtrain_test_fallback::scale_segments_traced",
                                lambda ctx, grad: (scale_segments_traced(grad, ctx.offs), None), setup_context=_keep_offs)


class SegmentLayer(nn.Module):
    def __init__(self, traced):
        super().__init__()
        self.up, self.down, self.traced = nn.Linear(8, 8), nn.Linear(8, 8), traced

    def forward(self, x, offs):
        op = scale_segments_traced if self.traced else scale_segments
        return x + self.down(op(torch.relu(self.up(x)), offs))


class SegmentStack(nn.Module):
    def __init__(self, traced=False, layers=3):
        super().__init__()
        self.layers = nn.ModuleList(SegmentLayer(traced) for _ in range(layers))

    def forward(self, x, offs):
        for layer in self.layers:
            x = layer(x, offs)
        return x


def test_custom_op_whose_backward_cannot_be_traced_runs_between_graphs(monkeypatch):
    """Found once, before AOTAutograd's trace of the whole graph fails on it (capture/untraceable_ops.py):
    the backend raises once, dynamo then breaks at each call, and the layers around the op run from
    graphs. Before, every capture failed in AOTAutograd and dynamo ran the whole model eagerly (0
    graphs). What one module learnt is its own: a second module finds it again. Outside fxtrain's
    captures, dynamo keeps the op in its graphs."""
    from fxtrain.capture import untraceable_ops
    raised = []
    check = untraceable_ops.UntraceableOps.check

    def counted(self, gm):
        try:
            check(self, gm)
        except Exception as error:
            raised.append(error)
            raise
    monkeypatch.setattr(untraceable_ops.UntraceableOps, "check", counted)
    torch.manual_seed(0)
    tm, ref = wrap_pair(SegmentStack())
    offs = to_device(torch.tensor([3, 5, 8]))
    for step in range(3):
        before = dict(_SEGMENT_CALLS)
        _step(tm, ref, to_device(torch.randn(8, 8)), offs)
        # fxtrain's call and eager's: the op's forward and backward once per layer each, as eager runs them
        assert {k: _SEGMENT_CALLS[k] - before[k] for k in before} == {"forward": 6, "backward": 6}, step
    info = tm.capture_info()
    assert len(raised) == 1 and type(raised[0]).__name__ == "DataDependentOutputException", raised
    assert info.graphs >= 2 and info.graph_breaks >= 1, info
    assert any("the backward of custom op fxtrain_test_fallback::scale_segments cannot be traced" in r
               for r in info.break_reasons), info.break_reasons
    other, other_ref = wrap_pair(SegmentStack())
    _step(other, other_ref, to_device(torch.randn(8, 8)), offs)
    assert len(raised) == 2 and other.capture_info().graphs >= 2, other.capture_info()

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    with torch.no_grad():
        torch.compile(lambda x, o: scale_segments(x * 2, o), backend=record)(torch.randn(8, 8), torch.tensor([3, 8]))
    assert len(graphs) == 1 and any("scale_segments" in str(n.target) for n in graphs[0].graph.nodes), graphs


def test_custom_op_whose_backward_is_an_op_stays_in_the_graph():
    torch.manual_seed(0)
    tm, ref = wrap_pair(SegmentStack(traced=True))
    offs = to_device(torch.tensor([3, 5, 8]))
    for _ in range(2):
        _step(tm, ref, to_device(torch.randn(8, 8)), offs)
    info = tm.capture_info()
    assert (info.graphs, info.graph_breaks) == (1, 0), info
