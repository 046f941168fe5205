"""Custom autograd.Functions run intact inside one graph as PythonOps; eager PyTorch is the oracle."""
import copy

import numpy as np
import pytest
import torch
from torch import nn

import fxtrain
from fxtrain.pythonop.op import POOL
from utils import assert_grads_equal, wrap_pair

# Inherently CPU: many Functions here leave torch for numpy (CPU tensors only); the PythonOp step on
# FXTRAIN_TEST_DEVICE is covered by tests/test_syncs.py.
pytestmark = pytest.mark.cpu_only("Functions that leave torch for numpy")


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


class Host(nn.Module):
    """A linear layer whose output goes through ``fn(h, *extra)``; loss = sum of tensor outputs."""

    def __init__(self, fn, *extra, reduce=None):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fn, self.extra, self.reduce = fn, extra, reduce

    def forward(self, x):
        out = self.fn(self.lin(x), *self.extra)
        if self.reduce is not None:
            return self.reduce(out)
        outs = out if isinstance(out, tuple) else (out,)
        return sum(o.float().sum() for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point())


def _parity(model, batches=(3, 5, 2), **options):
    tm, ref = wrap_pair(model, **options)
    for b in batches:
        x = torch.randn(b, 4)
        out, r = tm(x), ref(x)
        _close(out, r)
        out.backward(); r.backward()
        assert_grads_equal(tm.module, ref)
        tm.zero_grad(); ref.zero_grad()
    return tm


# ------------------------------------------------------------------ one graph, identity, args
class NumpySquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.from_numpy(np.square(x.detach().numpy()))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g

    @staticmethod
    def infer_shape(x):
        return torch.empty_like(x)


class ItemScale(torch.autograd.Function):
    """Leaves torch with .item(): not traceable on fake tensors; its infer_shape keeps the batch size dynamic."""

    @staticmethod
    def forward(ctx, x):
        s = float(x.abs().max().item())
        ctx.s = s
        return x / s

    @staticmethod
    def backward(ctx, g):
        return g / ctx.s

    @staticmethod
    def infer_shape(x):
        return torch.empty_like(x)


def test_functions_leaving_torch_stay_in_one_graph():
    model = Host(lambda h: ItemScale.apply(NumpySquare.apply(h)))
    tm = _parity(model)
    info = tm.capture_info()
    assert (info.graphs, info.graph_breaks) == (1, 0)
    assert info.python_ops == [f"{__name__}.NumpySquare", f"{__name__}.ItemScale"]
    nodes = [n for n in info.records[0].forward_graph.graph.nodes if "python_op" in str(n.target)]
    assert len(nodes) == 2
    assert any("python_op_backward" in str(n.target) for n in info.records[0].backward_graph.graph.nodes)
    assert not POOL


def _make_scale(factor):
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * factor

        @staticmethod
        def backward(ctx, g):
            return g * factor
    return Scale


def test_same_name_in_different_scopes_never_confused():
    A, B = _make_scale(2.0), _make_scale(-3.0)
    assert A.__qualname__ == B.__qualname__
    model = Host(lambda h: A.apply(h) + B.apply(h))
    tm = _parity(model)
    assert tm.capture_info().python_ops == [f"{__name__}._make_scale.<locals>.Scale"]


class Recorder(torch.autograd.Function):
    seen = []

    @staticmethod
    def forward(ctx, a, x, f, b, i, tup, s, none, lst, dct, mod):
        Recorder.seen.append((a, f, b, i, tup, s, none, lst, dct, mod))
        ctx.f = f
        return x * f if b else x

    @staticmethod
    def backward(ctx, g):
        return (None, g * ctx.f) + (None,) * 9


def test_non_tensor_arguments_keep_exact_values_types_and_identity():
    lst, dct, sub = [1, 2], {"k": "v"}, nn.Identity()
    f = 0.1234567890123456789  # not representable in float32
    model = Host(lambda h: Recorder.apply(7, h, f, True, 3, (1.5, 2.5), "name", None, lst, dct, sub))
    Recorder.seen.clear()
    _parity(model, batches=(3,))
    a, f2, b, i, tup, s, none, lst2, dct2, mod = Recorder.seen[-1]
    assert type(a) is int and a == 7 and type(f2) is float and f2 == f and b is True and type(i) is int
    assert type(tup) is tuple and tup == (1.5, 2.5) and all(type(v) is float for v in tup)
    assert s == "name" and none is None and lst2 is lst and dct2 is dct and mod is sub


class TensorsAnywhere(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, x, w, y):
        ctx.save_for_backward(x, w, y)
        return x * w + y * k

    @staticmethod
    def backward(ctx, g):
        x, w, y = ctx.saved_tensors
        return None, g * w, (g * x).sum(0), g * 2.0


def test_tensor_arguments_at_any_position():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.w = nn.Linear(4, 4), nn.Parameter(torch.randn(4))

        def forward(self, x):
            h = self.lin(x)
            return TensorsAnywhere.apply(2.0, h, self.w, h.tanh()).sum()

    _parity(M())


# ------------------------------------------------------------------------------ outputs
class MultiOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        idx = x.argmax(-1)
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(x)
        return x.sin(), x.cos(), idx

    @staticmethod
    def backward(ctx, ga, gb, gidx):
        (x,) = ctx.saved_tensors
        return ga * x.cos() - gb * x.sin()


def test_multiple_outputs_integer_output_and_non_differentiable():
    def use(h):
        a, b, idx = MultiOut.apply(h)
        assert idx.dtype == torch.int64 and not idx.requires_grad
        return a * 2 + b + idx.unsqueeze(-1).float()
    _parity(Host(use, reduce=lambda o: o.sum()))


class Passthrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, how):
        ctx.shape = x.shape
        if how == "self":
            return x
        if how == "detach":
            return x.detach()
        return x.view(-1)

    @staticmethod
    def backward(ctx, g):
        return g.reshape(ctx.shape) * 3, None


@pytest.mark.parametrize("how", ["self", "detach", "view"])
def test_output_aliasing_an_input(how):
    _parity(Host(lambda h: Passthrough.apply(h, how) * h.sum(), reduce=lambda o: o.sum()))


class NeedsGrad(torch.autograd.Function):
    seen = []

    @staticmethod
    def forward(ctx, x, y):
        return x * y

    @staticmethod
    def backward(ctx, g):
        NeedsGrad.seen.append(tuple(ctx.needs_input_grad))
        return g if ctx.needs_input_grad[0] else None, g if ctx.needs_input_grad[1] else None


def test_needs_input_grad_matches_eager():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return NeedsGrad.apply(self.lin(x), x).sum()

    NeedsGrad.seen.clear()
    tm, ref = wrap_pair(M())
    x = torch.randn(3, 4)
    tm(x).backward(); ref(x).backward()
    assert NeedsGrad.seen == [(True, False), (True, False)]
    assert_grads_equal(tm.module, ref)


class Materialize(torch.autograd.Function):
    seen = []

    @staticmethod
    def forward(ctx, x, materialize):
        ctx.set_materialize_grads(materialize)
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, ga, gb):
        Materialize.seen.append((ga is None, gb is None))
        total = ga * 2 if ga is not None else 0
        return total + (gb * 3 if gb is not None else 0), None


@pytest.mark.parametrize("materialize", [False, True])
def test_materialize_grads(materialize):
    Materialize.seen.clear()
    _parity(Host(lambda h: Materialize.apply(h, materialize)[0], reduce=lambda o: o.sum()), batches=(3,))
    expected = (False, not materialize)
    assert Materialize.seen == [expected, expected]  # fxtrain's call and eager's call saw the same


class NewStyle(torch.autograd.Function):
    @staticmethod
    def forward(x, k):
        return x * k

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.k = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


class OnceDiff(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.exp()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.exp()


class NewStyleProbe(torch.autograd.Function):
    """New-style: forward without ctx; setup_context sees inputs and output as eager gives them."""
    seen = []

    @staticmethod
    def forward(x, k):
        return x * k

    @staticmethod
    def setup_context(ctx, inputs, output):
        NewStyleProbe.seen.append((type(inputs[1]), inputs[1], tuple(output.shape)))
        ctx.k = inputs[1]
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * ctx.k + x * 0.5, None   # not the true derivative: the user's must be used


def test_new_style_setup_context():
    NewStyleProbe.seen.clear()
    _parity(Host(lambda h: NewStyleProbe.apply(h, 0.5)), batches=(3,))
    assert NewStyleProbe.seen[-1] == (float, 0.5, (3, 4))
    assert NewStyleProbe.seen[-2] == NewStyleProbe.seen[-1]  # fxtrain's real run, then eager's


class OnceDiffProbe(torch.autograd.Function):
    grad_modes = []

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.exp()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        OnceDiffProbe.grad_modes.append(torch.is_grad_enabled())
        (x,) = ctx.saved_tensors
        return g * x.exp() * 3.0   # deliberately not the true derivative


def test_once_differentiable():
    OnceDiffProbe.grad_modes.clear()
    _parity(Host(lambda h: OnceDiffProbe.apply(h)), batches=(3, 5))
    assert OnceDiffProbe.grad_modes == [False] * 4  # backward ran without grad mode, as in eager


def test_setup_context_and_once_differentiable_chained():
    _parity(Host(lambda h: OnceDiff.apply(NewStyle.apply(h, 0.5))))


def test_same_function_twice_on_a_shared_input():
    def use(h):
        a = OnceDiff.apply(h)
        b = OnceDiff.apply(h)     # same Function, same input: two ctx, two backward calls
        return a * b
    tm = _parity(Host(use, reduce=lambda o: o.mean()))
    info = tm.capture_info()
    assert info.python_ops == [f"{__name__}.OnceDiff"]
    fwd = [n for n in info.records[0].forward_graph.graph.nodes if n.target is torch.ops.fxtrain.python_op.default]
    bwd = [n for n in info.records[0].backward_graph.graph.nodes
           if n.target is torch.ops.fxtrain.python_op_backward.default]
    assert len(fwd) == 2 and len(bwd) == 2
    assert not POOL


def test_function_output_not_a_model_output():
    """One output feeds the loss only through another op, one is never used at all."""
    def use(h):
        a = OnceDiff.apply(h)                 # intermediate, not returned
        _unused = NewStyle.apply(h, 2.0)      # never used: still runs, its ctx is freed
        return (a * 2).sum() + h.sum()
    tm = _parity(Host(use, reduce=lambda o: o))
    assert tm.capture_info().python_ops == [f"{__name__}.OnceDiff", f"{__name__}.NewStyle"]
    assert not POOL


def test_two_forwards_before_one_backward():
    torch.manual_seed(0)
    tm, ref = wrap_pair(Host(lambda h: OnceDiff.apply(h)))
    x1, x2 = torch.randn(3, 4), torch.randn(5, 4)
    (tm(x1) + tm(x2)).backward()
    (ref(x1) + ref(x2)).backward()
    assert_grads_equal(tm.module, ref)
    assert not POOL


class ParamStorage(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, x):
        return w.detach()  # the parameter's own storage

    @staticmethod
    def backward(ctx, g):
        return g, None


def test_function_returning_parameter_storage_accumulates_without_zero_grad():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, x):
            return (ParamStorage.apply(self.w, x) * x).sum()

    torch.manual_seed(0)
    tm, ref = wrap_pair(M())
    for b in (2, 3, 4):  # no zero_grad: gradients accumulate
        x = torch.randn(b, 4)
        tm(x).backward(); ref(x).backward()
        _close(tm.module.w.grad, ref.w.grad)


class NonDiff(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return (x > 0).float()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("NonDiff has no gradient")


def test_non_differentiable_function_whose_backward_raises():
    def use(h):
        return h * NonDiff.apply(h.detach())
    _parity(Host(use, reduce=lambda o: o.sum()))
    # and when the gradient does flow into it, the user's error surfaces as in eager
    tm, ref = wrap_pair(Host(lambda h: NonDiff.apply(h), reduce=lambda o: o.sum()))
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="NonDiff has no gradient"):
        ref(x).backward()
    with pytest.raises(RuntimeError, match="NonDiff has no gradient"):
        tm(x).backward()


def test_eval_and_no_grad():
    torch.manual_seed(0)
    tm, ref = wrap_pair(Host(lambda h: NumpySquare.apply(h)))
    tm.eval(); ref.eval()
    x = torch.randn(3, 4)
    _close(tm(x), ref(x))
    with torch.no_grad():
        _close(tm(x), ref(x))
    assert not POOL
    assert tm.capture_info().python_ops == [f"{__name__}.NumpySquare"]


class PureTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.tanh()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 5.0 * (1 - x.tanh() ** 2)  # deliberately not the true derivative: must be honoured


@pytest.mark.parametrize("custom_autograd", [True, False])
def test_user_backward_honoured_with_and_without_pythonop(custom_autograd):
    tm = _parity(Host(lambda h: PureTorch.apply(h)), custom_autograd=custom_autograd)
    assert tm.capture_info().python_ops == ([f"{__name__}.PureTorch"] if custom_autograd else [])
    assert tm.capture_info().graphs == 1  # dynamic batch: shaped by dynamo's trace of it, no recapture


def test_is_capturing_seen_by_function_during_capture_only():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(fxtrain.is_capturing())
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            return g

    tm, _ = wrap_pair(Host(lambda h: Probe.apply(h)))
    tm(torch.randn(2, 4)).backward()
    seen.clear()
    tm(torch.randn(3, 4)).backward()
    assert seen == [False]  # the real run is not a capture
    assert not fxtrain.is_capturing()


class NumpyDoubleInPlace(torch.autograd.Function):
    """In place through numpy, ctx.mark_dirty: not traceable by torch."""

    @staticmethod
    def forward(ctx, x):
        arr = x.detach().numpy()
        arr *= 2.0
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2

    @staticmethod
    def infer_shape(x):
        return x


class TorchDoubleInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_mark_dirty_keeps_in_place_semantics():
    """The updated input is used after apply: the op returns its new value and the graph writes it
    back into the caller's tensor, which apply returns, as eager does."""
    def use(h):
        h = h.clone()
        y = TorchDoubleInPlace.apply(h)
        assert y is h
        return y * 3 + h  # h was doubled in place
    tm = _parity(Host(use, reduce=lambda o: o.sum()))
    assert tm.capture_info().python_ops == [f"{__name__}.TorchDoubleInPlace"]


def test_untraceable_mark_dirty_still_matches_eager():
    """In place through numpy (shaped by infer_shape, which returns its input: dirty)."""
    def use(h):
        h = h.clone()
        y = NumpyDoubleInPlace.apply(h)
        return y * 3 + h
    tm = _parity(Host(use, reduce=lambda o: o.sum()))
    assert tm.capture_info().python_ops == [f"{__name__}.NumpyDoubleInPlace"]


class SideEffect(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, x):
        if not fxtrain.is_capturing():  # false whenever forward really runs (dynamo's trace sees true)
            SideEffect.calls += 1
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_function_called_for_its_side_effect_runs_every_step():
    def use(h):
        SideEffect.apply(h)  # output unused
        return h
    SideEffect.calls = 0
    _parity(Host(use, reduce=lambda o: o.sum()), batches=(3, 4, 5))
    assert SideEffect.calls == 6  # three steps, fxtrain and eager each


class NonDiffFloat(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.round()
        ctx.mark_non_differentiable(y)
        return x * 2, y

    @staticmethod
    def backward(ctx, g, gy):
        return g * 2


def test_non_differentiable_float_output_does_not_require_grad():
    seen = []

    def use(h):
        a, y = NonDiffFloat.apply(h)
        seen.append(y.requires_grad)
        return a + y
    _parity(Host(use, reduce=lambda o: o.sum()), batches=(3,))
    x = torch.randn(2, 4)
    tm = fxtrain.TrainModule(Host(lambda h: NonDiffFloat.apply(h)[1], reduce=lambda o: o), fxtrain.Options(fallback="raise"))
    assert tm(x).requires_grad is False


class Cfg:
    def __init__(self, k):
        self.k = k


class UsesCfg(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cfg, items):
        ctx.k = cfg.k
        if not fxtrain.is_capturing():
            items.append(1)
        return x * cfg.k

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None, None


def test_reference_arguments_are_the_users_objects_and_guarded():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.cfg, self.items = nn.Linear(4, 4), Cfg(2.0), []

        def forward(self, x):
            return UsesCfg.apply(self.lin(x), self.cfg, self.items).sum()

    torch.manual_seed(0)
    tm, ref = wrap_pair(M())
    x = torch.randn(3, 4)
    _close(tm(x), ref(x))
    assert tm.module.items == [1] and ref.items == [1]  # the very list object, appended once per real run
    import gc
    import weakref
    old = weakref.ref(tm.module.cfg)
    tm.module.cfg = Cfg(5.0)
    ref.cfg = Cfg(5.0)
    _close(tm(x), ref(x))  # a replaced object is seen (the capture is guarded on its identity)
    gc.collect()
    # the first capture may still run (the old object could come back): fxtrain keeps it alive, so
    # its id cannot be taken by another object and fool the identity guard
    assert old() is not None and old().k == 2.0


@pytest.mark.parametrize("reentrant", [True, False])
def test_torch_utils_checkpoint(reentrant):
    import torch.utils.checkpoint as cp

    def use(h):
        return cp.checkpoint(lambda t: OnceDiff.apply(t.tanh()) * 2, h, use_reentrant=reentrant)
    tm = _parity(Host(use, reduce=lambda o: o.sum()))
    assert tm.capture_info().graph_breaks == 0


def test_pool_entry_freed_when_no_backward_comes():
    import gc
    gc.collect()
    before = len(POOL)
    # The aten-graph runtime hands the Function's state from its forward op to its backward op
    # through the pool (the autograd runtime applies the Function itself: no pool entry).
    tm, _ = wrap_pair(Host(lambda h: OnceDiff.apply(h)), backward="graph")
    out = tm(torch.randn(3, 4))
    assert len(POOL) == before + 1  # waiting for a backward
    del out
    gc.collect()
    assert len(POOL) == before


def test_returned_but_undifferentiated_output_arrives_as_none():
    """The Function's second output is a model output nobody differentiates: None, as in eager."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            a, b = Materialize.apply(self.lin(x), False)
            return a.sum(), b

    Materialize.seen.clear()
    tm, ref = wrap_pair(M())
    x = torch.randn(3, 4)
    tm(x)[0].backward()
    ref(x)[0].backward()
    assert Materialize.seen == [(False, True), (False, True)]
    assert_grads_equal(tm.module, ref)


# ------------------------------------------------------------- custom_autograd=False (inlining)
class ItemInBackward(torch.autograd.Function):
    """Traceable forward, backward that leaves torch (``.item()``): dynamo cannot inline it whole."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * float(x.abs().max().item())


@pytest.mark.parametrize("fn", [ItemScale, ItemInBackward], ids=["forward", "backward"])
def test_inlining_an_untraceable_function_fails_naming_it(fn):
    tm, ref = wrap_pair(Host(lambda h: fn.apply(h)), custom_autograd=False)
    x = torch.randn(3, 4)
    with pytest.raises(fxtrain.CaptureError, match=f"custom_autograd=False.*{__name__}.{fn.__qualname__}"):
        tm(x)
    # fallback="eager": the same reason in the warning, then eager's answer
    tm, ref = wrap_pair(Host(lambda h: fn.apply(h)), custom_autograd=False, fallback="eager")
    with pytest.warns(fxtrain.FallbackWarning, match=f"{__name__}.{fn.__qualname__}"):
        out = tm(x)
    r = ref(x)
    _close(out, r)
    out.backward(); r.backward()
    assert_grads_equal(tm.module, ref)
    assert fn.__qualname__ in tm.capture_info().fallback_reason


def test_inline_error_only_for_fxtrain_captures():
    """A user's own torch.compile elsewhere keeps dynamo's behaviour (graph break, eager Function)."""
    torch.manual_seed(0)
    tm = fxtrain.TrainModule(Host(lambda h: ItemInBackward.apply(h)), fxtrain.Options(custom_autograd=False, fallback="raise"))
    model = Host(lambda h: ItemInBackward.apply(h))
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(3, 4)
    out, r = compiled(x), ref(x)
    _close(out, r)
    out.backward(); r.backward()
    assert_grads_equal(model, ref)
    with pytest.raises(fxtrain.CaptureError, match="ItemInBackward"):
        tm(x)


# ------------------------------------------------------------------------------------ shapes
class TorchRowNorm(torch.autograd.Function):
    """Pure torch, output shape differs from the input's: shaped by dynamo's trace of its forward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.norm(dim=-1)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g.unsqueeze(-1) * x / x.norm(dim=-1, keepdim=True)


class NumpyRowNorm(torch.autograd.Function):
    """Counts its calls (a side effect, which dynamo will not trace) and has no infer_shape: shaped
    by its real run on the capturing batch, which is that step's run."""
    calls = 0

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        norms = np.linalg.norm(x.detach().numpy(), axis=-1)
        NumpyRowNorm.calls += 1
        return torch.from_numpy(norms).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g.unsqueeze(-1) * x / x.norm(dim=-1, keepdim=True)


class NumpyRowNormInferred(NumpyRowNorm):
    """The same, with infer_shape: the batch size stays symbolic."""

    @staticmethod
    def infer_shape(x):
        return x.new_empty(x.shape[:-1])


class NumpyFlatten(torch.autograd.Function):
    """Output size batch x 4, which no single input size explains: a real run's shapes then hold for
    its input sizes only."""
    calls = 0

    @staticmethod
    def forward(ctx, x):
        NumpyFlatten.calls += 1
        return torch.from_numpy(x.detach().numpy().reshape(-1).copy()).sum(0, keepdim=True) * x.new_ones(x.numel())

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("not differentiated")


@pytest.mark.parametrize("fn,graphs", [(TorchRowNorm, 1), (NumpyRowNormInferred, 1), (NumpyRowNorm, 1)],
                         ids=["traced", "infer_shape", "example-run"])
def test_shapes_fake_run_infer_shape_or_example_run(fn, graphs):
    """Batch sizes 3, 5, 3, 2: all three ways keep one dynamic graph (the example run's output size
    follows the one input size equal to it, and every call is checked against that)."""
    NumpyRowNorm.calls = 0
    tm = _parity(Host(lambda h: fn.apply(h) * h.sum(-1), reduce=lambda o: o.sum()), batches=(3, 5, 3, 2))
    info = tm.capture_info()
    assert info.python_ops == [f"{__name__}.{fn.__qualname__}"]
    assert (info.graphs, info.graph_breaks) == (graphs, 0)
    # once per step in each copy, as in eager: the capturing runs were the steps' runs
    assert NumpyRowNorm.calls == (8 if fn is not TorchRowNorm else 0)


def test_example_run_sizes_no_input_size_explains_recapture_per_size():
    NumpyFlatten.calls = 0
    tm = _parity(Host(lambda h: h * NumpyFlatten.apply(h.detach()).sum(), reduce=lambda o: o.sum()),
                 batches=(3, 5, 3, 2))
    assert (tm.capture_info().graphs, tm.capture_info().graph_breaks) == (3, 0)
    assert NumpyFlatten.calls == 8


class NumpyPositives(torch.autograd.Function):
    """Output length depends on the data: an example run's shape cannot hold for other batches."""

    @staticmethod
    def forward(ctx, x):
        return torch.from_numpy(x.detach().numpy()[x.detach().numpy() > 0].copy())

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("not needed")


def test_example_run_shape_mismatch_is_a_clear_error():
    tm, ref = wrap_pair(Host(lambda h: NumpyPositives.apply(h.detach()).sum() + h.sum(), reduce=lambda o: o))
    x = torch.randn(3, 4)
    _close(tm(x), ref(x))
    y = x.clone()
    y[0, :] = 0.0
    tm.module.lin.bias.data.add_(100.0)  # all positive now: a different number of outputs
    ref.lin.bias.data.add_(100.0)
    with pytest.raises(RuntimeError, match=f"{__name__}.NumpyPositives returned"):
        tm(y)


# --------------------------------------------------------------------------- identity, nesting
class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


class Outer:
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * -5.0

        @staticmethod
        def backward(ctx, g):
            return g * -5.0


def test_same_name_module_level_nested_and_local_each_by_qualified_name():
    Local = _make_scale(7.0)
    assert Scale.__name__ == Outer.Scale.__name__ == Local.__name__
    tm = _parity(Host(lambda h: Scale.apply(h) + Outer.Scale.apply(h) * 0.5 + Local.apply(h) * 0.25))
    assert tm.capture_info().python_ops == [f"{__name__}.Scale", f"{__name__}.Outer.Scale",
                                            f"{__name__}._make_scale.<locals>.Scale"]


class ThroughInner(torch.autograd.Function):
    """Calls ``inner`` in forward (no grad) and again in backward (recompute, then autograd.grad):
    in the fxtrain model ``inner`` is itself a TrainModule, in eager a plain module."""

    @staticmethod
    def forward(ctx, x, inner):
        ctx.inner = inner
        ctx.save_for_backward(x)
        return inner(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xd = x.detach().requires_grad_()
            (gx,) = torch.autograd.grad(ctx.inner(xd), xd, g)
        return gx, None


class InnerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x)) * 2


class UsesInner(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.lin, self.inner = nn.Linear(4, 4), inner

    def forward(self, x):
        return ThroughInner.apply(self.lin(x), self.inner).sum()


def test_train_module_inside_function_forward_and_backward():
    torch.manual_seed(0)
    inner = InnerNet()
    ref = UsesInner(copy.deepcopy(inner))
    inner_tm = fxtrain.TrainModule(inner, fxtrain.Options(fallback="raise", dynamic=True))
    model = UsesInner(inner_tm)
    model.lin.load_state_dict(ref.lin.state_dict())
    tm = fxtrain.TrainModule(model, fxtrain.Options(fallback="raise", dynamic=True))
    for b in (3, 5, 2):
        x = torch.randn(b, 4)
        out, r = tm(x), ref(x)
        _close(out, r)
        out.backward(); r.backward()
        _close(model.lin.weight.grad, ref.lin.weight.grad)
        _close(model.lin.bias.grad, ref.lin.bias.grad)
        tm.zero_grad(); ref.zero_grad()
    info = tm.capture_info()
    assert (info.graphs, info.graph_breaks, info.python_ops) == (1, 0, [f"{__name__}.ThroughInner"])
    # the inner TrainModule really ran from its own graphs: one without grad (forward), one with (backward)
    assert inner_tm.capture_info().graphs == 2 and inner_tm.capture_info().fallback_reason is None


class WithIds(torch.autograd.Function):
    """Returns the integer tensor it was given (labels riding along) next to a float result."""

    @staticmethod
    def forward(ctx, x, ids):
        return x * 2, ids, ids + 1

    seen = []

    @staticmethod
    def backward(ctx, g, gids, gids1):
        WithIds.seen.append(tuple(None if t is None else (t.dtype, tuple(t.shape), bool(t.any()))
                                  for t in (gids, gids1)))
        return g * 2, None


def test_integer_tensor_outputs_passed_through():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, ids):
            y, same, nxt = WithIds.apply(self.lin(x), ids)
            return (y * nxt.unsqueeze(-1)).sum(), same, nxt

    torch.manual_seed(0)
    tm, ref = wrap_pair(M())
    WithIds.seen.clear()
    for b in (3, 5):
        x, ids = torch.randn(b, 4), torch.randint(0, 9, (b,))
        (loss, same, nxt), (rloss, rsame, rnxt) = tm(x, ids), ref(x, ids)
        _close(loss, rloss)
        for a, r in ((same, rsame), (nxt, rnxt)):
            assert a.dtype == r.dtype == torch.int64 and not a.requires_grad and not r.requires_grad
            assert torch.equal(a, r)
        loss.backward(); rloss.backward()
        assert_grads_equal(tm.module, ref)
        tm.zero_grad(); ref.zero_grad()
        assert WithIds.seen[-2] == WithIds.seen[-1]  # the backward saw what eager's saw for int outputs
    assert tm.capture_info().python_ops == [f"{__name__}.WithIds"]
