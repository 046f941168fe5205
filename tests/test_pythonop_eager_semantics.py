"""Issue 27: every custom Function behaves inside a TrainModule exactly as in eager.

Each test builds the same model twice (same seed): one runs in a TrainModule, the other eagerly, the
oracle. Two or more calls on different data compare outputs (tensors and Python values alike, NaN
positions included), gradients, parameters after an optimizer step, and the Python state the
Function touches (each copy has its own). Functions are built per model by a factory, so that state
kept by the class (a list it appends to) is the copy's own too.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

import numpy as np
import pytest
import torch
from torch import nn
from torch.autograd.function import once_differentiable

import fxtrain
from fxtrain.torch_private import is_fake

pytestmark = pytest.mark.cpu_only("Functions that leave torch for numpy and .item()")


# ----------------------------------------------------------------------------------- harness
def assert_same(a: Any, b: Any, where: str = "output") -> None:
    """Same structure, types, values (NaN where eager has NaN) and requires_grad."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs eager's {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert not is_fake(a), f"{where}: a fake tensor"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert a.requires_grad == b.requires_grad, f"{where}: requires_grad {a.requires_grad} vs {b.requires_grad}"
        torch.testing.assert_close(a.detach(), b.detach(), atol=1e-5, rtol=1e-4, equal_nan=True, msg=lambda m: f"{where}: {m}")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), f"{where}: {a} vs {b}"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _loss(out: Any) -> torch.Tensor:
    """Sum of every floating tensor in the output that requires grad."""
    total = None
    for t in _tensors(out):
        if t.requires_grad and t.is_floating_point():
            s = t.float().sum()
            total = s if total is None else total + s
    assert total is not None, "no differentiable output"
    return total


def _tensors(out: Any) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    if dataclasses.is_dataclass(out):
        return [t for f in dataclasses.fields(out) for t in _tensors(getattr(out, f.name))]
    return []


def parity(build: Callable[[], Tuple[nn.Module, Any]], batches: List[Any], *, loss: Callable[[Any], torch.Tensor] = _loss,
           options: Dict[str, Any] = None, backward: bool = True, reseed: bool = False) -> fxtrain.TrainModule:
    """``build()`` -> (model, python state): called once for each copy, same seed. ``reseed``: the
    random generator is seeded alike before each copy's call (models that draw random numbers)."""
    torch.manual_seed(0)
    model, state = build()
    torch.manual_seed(0)
    ref, ref_state = build()
    ref.load_state_dict(model.state_dict())
    tm = fxtrain.TrainModule(model, fxtrain.Options(**({"fallback": "raise"} if options is None else options)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, batch in enumerate(batches):
        args = batch if isinstance(batch, tuple) else (batch,)
        if reseed:
            torch.manual_seed(100 + step)
        out = tm(*args)
        if reseed:
            torch.manual_seed(100 + step)
        r = ref(*args)
        assert_same(out, r, f"step {step} output")
        if backward:
            _loss(out).backward() if loss is _loss else loss(out).backward()
            _loss(r).backward() if loss is _loss else loss(r).backward()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert (p.grad is None) == (q.grad is None), f"step {step} {name}: grad presence"
                if p.grad is not None:
                    torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, equal_nan=True,
                                               msg=lambda m: f"step {step} grad {name}: {m}")
            opt.step(); ref_opt.step()
            opt.zero_grad(); ref_opt.zero_grad()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=lambda m: f"step {step} param {name}: {m}")
        assert_same(state, ref_state, f"step {step} Python state")
    return tm


class Scaled(nn.Module):
    """``forward(x)`` applies ``fn`` to ``x * w``, w a parameter (the issue's minimal model)."""

    def __init__(self, fn: Callable[..., Any], size: int = 4) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(size))
        self.fn = fn

    def forward(self, x: torch.Tensor) -> Any:
        return self.fn(x * self.w)


def _batches(n: int = 2, size: int = 4, rows: int = 3) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(rows, size, generator=g) for _ in range(n)]


def _clean(tm: fxtrain.TrainModule, graphs: int = 1) -> None:
    info = tm.capture_info()
    assert (info.graphs, info.graph_breaks, info.fallback_reason, info.python_op_handoffs) == (graphs, 0, None, []), str(info)


# ------------------------------------------------------------------- case 1: fresh non-tensor outputs
def _item_twice() -> Any:
    class ItemTwice(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x ** 2, x.sum().item() * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.two_x = output[1]

        @staticmethod
        def backward(ctx, g, _):
            return g * ctx.two_x
    return ItemTwice


def test_case1_data_dependent_float_output_is_this_calls_value():
    def build():
        F = _item_twice()
        return Scaled(lambda h: F.apply(h)), None
    tm = parity(build, _batches(3))
    _clean(tm)


def test_case1_python_numbers_of_each_type_used_by_the_model():
    """int, bool and float outputs, used in arithmetic, returned, and branched on (a branch on data
    splits the graph, as torch.compile does, but never freezes the value)."""
    def build():
        class Stats(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                n = int((x > 0).sum())
                return x * 3, n, bool(n % 2), float(x.max())

            @staticmethod
            def backward(ctx, g, *_):
                return g * 3

        def use(h):
            y, n, odd, top = Stats.apply(h)
            z = y * n + top
            return z, n, odd, top
        return Scaled(use), None
    tm = parity(build, _batches(3))
    _clean(tm)

    def build_branching():
        class Sign(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2, bool(x.sum() > 0)

            @staticmethod
            def backward(ctx, g, _):
                return g * 2

        def use(h):
            y, positive = Sign.apply(h)
            return y * 2 if positive else y - 1
        return Scaled(use), None
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(3, 4, generator=g) + 5, torch.randn(3, 4, generator=g) - 5, torch.randn(3, 4, generator=g) + 5]
    tm = parity(build_branching, batches)
    assert tm.capture_info().fallback_reason is None


def test_case1_string_output_runs_by_python_and_says_why():
    """A str cannot travel through a graph: the call runs in Python (a graph break), with eager's
    value every call, and capture_info says which Function and why."""
    def build():
        class Label(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2, "pos" if float(x.sum()) > 0 else "neg"

            @staticmethod
            def backward(ctx, g, _):
                return g * 2
        return Scaled(lambda h: Label.apply(h)), None
    g = torch.Generator().manual_seed(3)
    tm = parity(build, [torch.randn(3, 4, generator=g) + 5, torch.randn(3, 4, generator=g) - 5])
    info = tm.capture_info()
    assert len(info.python_op_handoffs) == 1 and "Label" in info.python_op_handoffs[0]
    assert "str" in info.python_op_handoffs[0]


# ------------------------------------------------------------- case 2: side effects once, on real tensors
def _appender(log: List[torch.Tensor]) -> Any:
    class Append(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            log.append(x.sin())
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2
    return Append


def test_case2_forward_side_effect_once_per_call_on_real_tensors():
    def build():
        log: List[torch.Tensor] = []
        F = _appender(log)
        return Scaled(lambda h: F.apply(h)), log
    tm = parity(build, _batches(3))
    _clean(tm)


def test_case2_counter_and_numpy_forward_count_exactly():
    def build():
        calls = {"n": 0, "sizes": []}

        class Counted(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                calls["n"] += 1
                calls["sizes"].append(tuple(x.shape))
                return torch.from_numpy(np.tanh(x.detach().numpy()))

            @staticmethod
            def backward(ctx, g):
                return g
        return Scaled(lambda h: Counted.apply(h)), calls
    parity(build, _batches(3))


def test_case2_pure_forward_keeps_one_graph_for_every_batch_size():
    """A forward dynamo can trace is shaped symbolically without running it: one graph serves all
    sizes, and its ``is_capturing()`` branch never runs for real."""
    def build():
        seen: List[bool] = []

        class Pure(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x.tanh()

            @staticmethod
            def backward(ctx, g):
                (x,) = ctx.saved_tensors
                seen.append(fxtrain.is_capturing())
                return g * (1 - x.tanh() ** 2)
        return Scaled(lambda h: Pure.apply(h)), seen
    g = torch.Generator().manual_seed(0)
    tm = parity(build, [torch.randn(b, 4, generator=g) for b in (3, 5, 2)], options={"fallback": "raise", "dynamic": True})
    _clean(tm)


# ----------------------------------------------------------- case 3: a leaked tensor read by the model
@pytest.mark.parametrize("fallback", ["eager", "raise"])
def test_case3_model_reading_what_the_function_appended(fallback):
    def build():
        log: List[torch.Tensor] = []

        class Leak(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                log.append(x.view(-1))
                return x.sum()

            @staticmethod
            def backward(ctx, g):
                return g.expand(4)

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.randn(4))

            def forward(self, x):
                y = Leak.apply(x * self.w)
                return y + log[0].sum() * 2
        return M(), log
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxtrain.FallbackWarning)
        tm = parity(build, [torch.randn(4) for _ in range(2)], options={"fallback": fallback})
    assert tm.capture_info().fallback_reason is None


# ------------------------------------------------------------------------- case 4: no more hand-offs
def test_case4_keyword_arguments_defaults_as_eager_binds_them():
    def build():
        class Affine(torch.autograd.Function):
            @staticmethod
            def forward(x, scale=2.0, bias=1.0):
                return x * scale + bias

            @staticmethod
            def setup_context(ctx, inputs, output):
                ctx.scale = inputs[1]

            @staticmethod
            def backward(ctx, g):
                return g * ctx.scale, None, None

        def use(h):
            return Affine.apply(h, bias=4.0) + Affine.apply(h, scale=3.0) + Affine.apply(h, 0.5, bias=h)
        return Scaled(use), None
    if not _eager_apply_takes_keywords():
        # torch 2.11's eager apply refuses every keyword argument (it binds them, then passes them on
        # to the C apply anyway): the model fails in eager, and fxtrain gives eager's very error.
        x = _batches(1)[0]
        with pytest.raises(TypeError) as eager:
            build()[0](x)
        with pytest.raises(TypeError) as captured:
            fxtrain.TrainModule(build()[0], fxtrain.Options(fallback="raise"))(x)
        assert str(captured.value) == str(eager.value)
        return
    tm = parity(build, _batches(2))
    _clean(tm)


def _eager_apply_takes_keywords() -> bool:
    """Whether eager's ``apply`` binds keyword arguments of a new-style forward (torch 2.13 does)."""
    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(x, k=0):
            return x

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass
    try:
        Probe.apply(torch.ones(1), k=1)
    except TypeError:
        return False
    return True


def test_case4_keyword_arguments_eager_refuses_are_refused_and_catchable():
    """Keyword-only parameters, and keywords to an old-style forward: eager's apply raises TypeError;
    a model that catches it takes the same branch as eager."""
    def build():
        class KwOnly(torch.autograd.Function):
            @staticmethod
            def forward(x, *, scale=2.0):
                return x * scale

            @staticmethod
            def setup_context(ctx, inputs, output):
                pass

            @staticmethod
            def backward(ctx, g):
                return g * 2.0

        class OldStyle(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, scale=2.0, bias=1.0):
                return x * scale + bias

            @staticmethod
            def backward(ctx, g):
                return g * 2.0, None, None

        def use(h):
            try:
                a = KwOnly.apply(h, scale=3.0)
            except TypeError:
                a = h * 10
            try:
                b = OldStyle.apply(h, bias=3.0)
            except TypeError:
                b = h - 1
            return a + b
        return Scaled(use), None
    tm = parity(build, _batches(2), options={})
    assert tm.capture_info().fallback_reason is None


def test_case4_apply_error_reaches_the_models_code():
    """A forward that raises on the capturing call: eager's error, caught by the model's own
    try/except, which takes the branch eager takes; the call runs in Python and capture_info says so."""
    def build():
        class Picky(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, mode):
                if mode not in ("double", "triple"):
                    raise ValueError(f"unknown mode {mode}")
                return x * (2 if mode == "double" else 3)

            @staticmethod
            def backward(ctx, g):
                return g * 2, None

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.randn(4))
                self.mode = "quadruple"

            def forward(self, x):
                h = x * self.w
                try:
                    return Picky.apply(h, self.mode)
                except ValueError:
                    return h * 4
        return M(), None
    tm = parity(build, _batches(2), options={})
    info = tm.capture_info()
    assert info.fallback_reason is None
    assert any("Picky" in h and "ValueError" in h for h in info.python_op_handoffs), info.python_op_handoffs


def test_case4_apply_error_uncaught_is_eagers_error():
    class Strict(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            if x.shape[-1] != 5:
                raise ValueError("Strict wants 5 columns")
            return x

        @staticmethod
        def backward(ctx, g):
            return g
    tm = fxtrain.TrainModule(Scaled(lambda h: Strict.apply(h)), fxtrain.Options(fallback="raise"))
    with pytest.raises(ValueError, match="Strict wants 5 columns"):
        tm(torch.randn(3, 4))


def _dirty(twice: bool, numpy: bool) -> Any:
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            if numpy:
                arr = x.detach().numpy()
                arr *= 2.0
            else:
                x.mul_(2)
            ctx.mark_dirty(x)
            return (x, x) if twice else x

        @staticmethod
        def backward(ctx, *grads):
            total = None
            for g in grads:
                if g is not None:
                    total = g * 2 if total is None else total + g * 2
            return total
    return Double


@pytest.mark.parametrize("twice", [False, True], ids=["once", "twice"])
@pytest.mark.parametrize("numpy", [False, True], ids=["torch", "numpy"])
def test_case4_mark_dirty_updates_the_callers_tensor(twice, numpy):
    def build():
        F = _dirty(twice, numpy)

        def use(h):
            h = h.clone()
            out = F.apply(h)
            y = out[0] if twice else out
            same = (y is h) and (not twice or out[1] is h)
            return y * 3 + h, same, (out[1] * 5 if twice else y)
        return Scaled(use), None
    tm = parity(build, _batches(2))
    _clean(tm)
    assert tm.capture_info().python_ops


def test_case4_list_dataclass_namedtuple_and_dict_outputs():
    @dataclasses.dataclass
    class Out:
        y: torch.Tensor
        aux: List[torch.Tensor]
        scale: float

    class Pair(NamedTuple):
        a: torch.Tensor
        b: torch.Tensor

    def build():
        class AsList(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return [x * 2, x.sum()]

            @staticmethod
            def backward(ctx, g):
                return g

        class AsObjects(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 3, Out(x.cos(), [x.sin(), x], float(x.mean())), Pair(x + 1, x - 1), {"k": x * 4, "n": 2}

            @staticmethod
            def backward(ctx, g, *_):
                return g * 3

        def use(h):
            lst = AsList.apply(h)
            y, out, pair, d = AsObjects.apply(h)
            return y + lst[0].detach(), lst, out, pair, d, out.aux[1] is h
        return Scaled(use), None
    tm = parity(build, _batches(2))
    _clean(tm)


def test_case4_list_argument_made_in_the_traced_code():
    """``z = []; F.apply(x, z)``: the Function appends to the very list, with eager's requires_grad,
    every call; the model reads it."""
    def build():
        class Collect(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, out, opts):
                out.append(x * 2)
                out.append(x)
                return x * opts["k"]

            @staticmethod
            def backward(ctx, g):
                return g * 3, None, None

        def use(h):
            z = []
            y = Collect.apply(h, z, {"k": 3.0})
            return y + z[0], len(z), z[0].requires_grad, z[1] is h, z
        return Scaled(use), None
    tm = parity(build, _batches(2))
    _clean(tm)


def test_case4_gradient_for_a_non_tensor_argument_raises_as_in_eager():
    class BadGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, k, opts):
            return x * k

        @staticmethod
        def backward(ctx, g):
            return g * 2, g, None

    def use(h):
        return BadGrad.apply(h, 2.0, [1])
    torch.manual_seed(0)
    model = Scaled(use)
    ref = Scaled(use)
    ref.load_state_dict(model.state_dict())
    tm = fxtrain.TrainModule(model, fxtrain.Options(fallback="raise"))
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError) as eager_error:
        ref(x).sum().backward()
    with pytest.raises(RuntimeError) as error:
        tm(x).sum().backward()
    assert "returned a gradient different than None at position 2" in str(eager_error.value)
    assert "returned a gradient different than None at position 2" in str(error.value)


# --------------------------------------------------------------- case 5: graph breaks after a reset
def test_case5_break_counts_do_not_leak_across_dynamo_reset():
    class Breaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            torch._dynamo.graph_break()
            return y.sum()

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).sum()

    import torch._dynamo
    first = fxtrain.TrainModule(Breaks())
    first(torch.randn(2, 4)).backward()
    assert first.capture_info().graph_breaks == 1
    torch._dynamo.reset()
    fresh = fxtrain.TrainModule(Plain())
    fresh(torch.randn(2, 4)).backward()
    assert (fresh.capture_info().graph_breaks, fresh.capture_info().break_reasons) == (0, [])
    torch._dynamo.reset()
    again = fxtrain.TrainModule(Breaks())
    again(torch.randn(2, 4)).backward()
    assert again.capture_info().graph_breaks == 1


# --------------------------------------------------------------------- what Function authors do
def test_setup_context_saved_non_tensors_needs_input_grad_and_materialize():
    def build():
        seen: List[Any] = []

        class Mixed(torch.autograd.Function):
            @staticmethod
            def forward(x, w, alpha, flag):
                return x * w * alpha, (x * 2).detach()

            @staticmethod
            def setup_context(ctx, inputs, output):
                x, w, alpha, flag = inputs
                ctx.save_for_backward(x, w)
                ctx.alpha, ctx.flag = alpha, flag
                ctx.set_materialize_grads(False)
                ctx.mark_non_differentiable(output[1])

            @staticmethod
            def backward(ctx, g, g_unused):
                x, w = ctx.saved_tensors
                seen.append((tuple(ctx.needs_input_grad), g_unused is None, ctx.flag))
                gx = g * w * ctx.alpha if ctx.needs_input_grad[0] else None
                gw = (g * x * ctx.alpha).sum(0) if ctx.needs_input_grad[1] else None
                return gx, gw, None, None

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.randn(4))
                self.v = nn.Parameter(torch.randn(4))

            def forward(self, x):
                y, side = Mixed.apply(x * self.v, self.w, 0.5, "tag")
                frozen, _ = Mixed.apply(x, self.w.detach(), 2.0, "frozen")
                return y + frozen, side
        return M(), seen
    tm = parity(build, _batches(2))
    _clean(tm)


def test_once_differentiable_and_views_returned():
    def build():
        class RowView(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.shape = x.shape
                return x[0], x.view(-1), x.t()

            @staticmethod
            @once_differentiable
            def backward(ctx, g0, g1, g2):
                out = g1.view(ctx.shape) + g2.t()
                out[0] += g0
                return out
        return Scaled(lambda h: RowView.apply(h)), None
    tm = parity(build, _batches(2))
    _clean(tm)


def test_nested_functions_and_functions_calling_functions():
    def build():
        calls: List[str] = []

        class Inner(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                calls.append("inner.forward")
                return x.exp()

            @staticmethod
            def backward(ctx, g):
                return g

        class Outer(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                calls.append("outer.forward")
                y = Inner.apply(x) + 1      # no graph inside forward, as in eager
                ctx.save_for_backward(x)
                return y

            @staticmethod
            def backward(ctx, g):
                (x,) = ctx.saved_tensors
                calls.append("outer.backward")
                with torch.enable_grad():
                    xd = x.detach().requires_grad_()
                    (gx,) = torch.autograd.grad(Inner.apply(xd).sum(), xd)
                return g * gx

        return Scaled(lambda h: Outer.apply(Inner.apply(h))), calls
    tm = parity(build, _batches(2))
    _clean(tm)


def test_liger_style_fused_linear_cross_entropy():
    """Computes the loss and the gradients in forward (chunked), saves them, and scales them by
    the incoming gradient in backward (Liger's FusedLinearCrossEntropy pattern)."""
    def build():
        class FusedLinearCE(torch.autograd.Function):
            @staticmethod
            def forward(ctx, h, weight, target, chunk):
                grad_h = torch.zeros_like(h)
                grad_w = torch.zeros_like(weight)
                loss = torch.zeros((), dtype=torch.float32)
                for start in range(0, h.shape[0], chunk):
                    hc = h[start:start + chunk]
                    logits = hc @ weight.t()
                    tc = target[start:start + chunk]
                    lse = logits.logsumexp(-1)
                    loss += (lse - logits.gather(1, tc[:, None]).squeeze(1)).sum()
                    p = (logits - lse[:, None]).exp()
                    p[torch.arange(p.shape[0]), tc] -= 1
                    grad_h[start:start + chunk] = p @ weight
                    grad_w += p.t() @ hc
                n = h.shape[0]
                ctx.save_for_backward(grad_h / n, grad_w / n)
                return loss / n

            @staticmethod
            def backward(ctx, g):
                grad_h, grad_w = ctx.saved_tensors
                return grad_h * g, grad_w * g, None, None

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = nn.Linear(4, 4)
                self.head = nn.Parameter(torch.randn(7, 4) * 0.1)

            def forward(self, x, y):
                return FusedLinearCE.apply(self.body(x), self.head, y, 2)
        return M(), None
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(5, 4, generator=g), torch.randint(0, 7, (5,), generator=g)) for _ in range(2)]
    tm = parity(build, batches)
    _clean(tm)


def test_flash_attention_style_with_non_differentiable_lse():
    def build():
        class Attention(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, scale):
                s = (q @ k.transpose(-1, -2)) * scale
                lse = s.logsumexp(-1)
                out = (s - lse[..., None]).exp() @ v
                ctx.save_for_backward(q, k, v, out, lse)
                ctx.scale = scale
                ctx.mark_non_differentiable(lse)
                return out, lse

            @staticmethod
            def backward(ctx, g, _glse):
                q, k, v, out, lse = ctx.saved_tensors
                p = ((q @ k.transpose(-1, -2)) * ctx.scale - lse[..., None]).exp()
                gv = p.transpose(-1, -2) @ g
                gp = g @ v.transpose(-1, -2)
                gs = p * (gp - (g * out).sum(-1, keepdim=True))
                return gs @ k * ctx.scale, gs.transpose(-1, -2) @ q * ctx.scale, gv, None

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv = nn.Linear(4, 12)

            def forward(self, x):
                q, k, v = self.qkv(x).chunk(3, -1)
                out, lse = Attention.apply(q, k, v, 0.5)
                return out, lse
        return M(), None
    g = torch.Generator().manual_seed(0)
    tm = parity(build, [torch.randn(2, 3, 4, generator=g) for _ in range(2)])
    _clean(tm)


def test_symbolic_size_and_changing_float_arguments():
    """``F.apply(x, x.shape[0], t)`` with a batch size and a float that change every call: the
    Function receives Python numbers of this call."""
    def build():
        seen: List[Any] = []

        class Temper(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, n, t):
                seen.append((type(n).__name__, n, type(t).__name__, t))
                ctx.t = t
                return x / t + n

            @staticmethod
            def backward(ctx, g):
                return g / ctx.t, None, None

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.randn(4))

            def forward(self, x, t):
                return Temper.apply(x * self.w, x.shape[0], t)
        return M(), seen
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(b, 4, generator=g), t) for b, t in ((3, 0.5), (5, 0.7), (2, 0.9), (4, 1.3))]
    tm = parity(build, batches, options={"fallback": "raise", "dynamic": True})
    assert tm.capture_info().fallback_reason is None


def _guarded(calls: Dict[str, Any]) -> Tuple[Any, Any]:
    """A Function that raises on large values only, after a Function that does not."""
    class Counted(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            calls["counted"].append(tuple(x.shape))
            return x + 1

        @staticmethod
        def backward(ctx, g):
            return g

    class Guarded(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            calls["guarded"].append(float(x.abs().max()))
            if float(x.abs().max()) > 100:
                raise OverflowError("too large")
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2
    return Counted, Guarded


@pytest.mark.parametrize("backward,split", [("graph", False), ("auto", True)])
def test_forward_raising_on_a_later_call_is_caught_by_the_model(backward, split):
    """The graph cannot branch on an exception: the call whose forward raised runs eagerly, its
    Function calls taking what the graph's calls did, so the model's ``except`` catches the very
    error, each forward runs once (the Function before it too, also in an earlier graph of the
    call: ``split``), and later calls run the graph. Both runtimes: the aten graphs ("graph") and
    the torch-level graph under eager autograd ("auto")."""
    def build():
        calls: Dict[str, Any] = {"counted": [], "guarded": [], "caught": 0}
        Counted, Guarded = _guarded(calls)

        def use(h):
            a = Counted.apply(h)
            if split:
                torch._dynamo.graph_break()
            try:
                return Guarded.apply(a)
            except OverflowError:
                calls["caught"] += 1
                return a.clamp(-1, 1)
        return Scaled(use), calls
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g) * 1e4, torch.randn(5, 4, generator=g),
               torch.randn(3, 4, generator=g) * 1e4]
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxtrain.FallbackWarning)
        tm = parity(build, batches, options={"fallback": "raise", "backward": backward})
    info = tm.capture_info()
    # The first call's graphs, and batch size 5's.
    assert (info.graphs, info.fallback_reason, info.python_op_handoffs) == (6 if split else 2, None, []), str(info)


def test_forward_raising_on_a_later_call_uncaught_is_eagers_error_once():
    torch.manual_seed(0)
    calls: Dict[str, Any] = {"counted": [], "guarded": [], "caught": 0}
    ref_calls: Dict[str, Any] = {"counted": [], "guarded": [], "caught": 0}
    Counted, Guarded = _guarded(calls)
    RefCounted, RefGuarded = _guarded(ref_calls)
    model = Scaled(lambda h: Guarded.apply(Counted.apply(h)))
    ref = Scaled(lambda h: RefGuarded.apply(RefCounted.apply(h)))
    ref.load_state_dict(model.state_dict())
    tm = fxtrain.TrainModule(model, fxtrain.Options(fallback="raise"))
    g = torch.Generator().manual_seed(0)
    small, large = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g) * 1e4
    assert_same(tm(small), ref(small))
    with pytest.raises(OverflowError, match="too large"):
        ref(large)
    with pytest.raises(OverflowError, match="too large"):
        tm(large)
    assert_same(calls, ref_calls, "Python state")
    assert_same(tm(small), ref(small))
    assert_same(calls, ref_calls, "Python state")
    _clean(tm)


def test_random_numbers_drawn_by_a_function_shaped_by_its_real_run():
    """A Function that draws random numbers after a dropout (and logs, so dynamo will not trace it):
    its capturing run drew them where eager draws them, and the generator moves on past them."""
    def build():
        log: List[int] = []

        class Noisy(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                log.append(x.shape[0])
                noise = torch.rand_like(x)
                ctx.save_for_backward(noise)
                return x * noise

            @staticmethod
            def backward(ctx, g):
                (noise,) = ctx.saved_tensors
                return g * noise

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, x):
                h = nn.functional.dropout(self.lin(x), 0.5)
                return nn.functional.dropout(Noisy.apply(h), 0.5)
        return M(), log
    tm = parity(build, _batches(3), reseed=True)
    _clean(tm)


def test_untraceable_function_inside_checkpoint_runs_by_python():
    """Inside a checkpointed region the arguments' real values are not known while capturing: a
    Function dynamo cannot trace runs in Python there (a graph break), as in eager, and says so."""
    import torch.utils.checkpoint as cp

    def build():
        log: List[int] = []

        class Numpy(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                log.append(x.shape[0])
                return torch.from_numpy(np.tanh(x.detach().numpy()))

            @staticmethod
            def backward(ctx, g):
                return g
        return Scaled(lambda h: cp.checkpoint(lambda t: Numpy.apply(t.sin()) * 2, h, use_reentrant=False)), log
    tm = parity(build, _batches(2), options={})
    info = tm.capture_info()
    assert info.fallback_reason is None and len(info.python_op_handoffs) == 1
    assert "checkpointed region" in info.python_op_handoffs[0]


# ------------------------------------- the capture's real run is the step's run, even when Python calls apply
# A Function dynamo cannot trace runs for real on the capturing call; when that run shows the graph
# cannot hold the call (a str returned, an error raised), or the frame ends up running as plain
# Python, or the capture fails and the step reruns eagerly, Python calls apply again on that step.
# That call takes the capture's run: the forward runs once per call, as the Python state shows.
def _counting_label(calls: Dict[str, Any]) -> Any:
    class CountingLabel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, out):
            calls["n"] += 1
            out.append(x * 2)
            ctx.save_for_backward(x)
            # The label tells the calls apart: a second run of the first call would say "call 2".
            return x.sin(), f"call {calls['n']}: {'pos' if float(x.sum()) > 0 else 'neg'}"

        @staticmethod
        def backward(ctx, g, _):
            (x,) = ctx.saved_tensors
            calls["grads"] += 1
            return g * x.cos(), None
    return CountingLabel


def test_str_output_handed_to_python_runs_once_per_call():
    """The str goes to Python: its call on the capturing step takes the capture's run (its label,
    the list the traced code passed filled, a gradient through the user's backward once)."""
    def build():
        calls = {"n": 0, "grads": 0}
        F = _counting_label(calls)

        def use(h):
            z = []
            y, label = F.apply(h * 2, z)
            return y * 3 + z[0], label, len(z)
        return Scaled(use), calls
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(3, 4, generator=g) + 5, torch.randn(3, 4, generator=g) - 5, torch.randn(3, 4, generator=g)]
    tm = parity(build, batches)
    info = tm.capture_info()
    assert info.fallback_reason is None and len(info.python_op_handoffs) == 1
    assert "CountingLabel" in info.python_op_handoffs[0] and "str" in info.python_op_handoffs[0]


def test_object_output_after_a_python_op_runs_once_per_call():
    """A PythonOp shaped by its real run, then a Function returning an object of the model's own
    class: both run once on the capturing step, the object is the one that run made."""
    class Token:
        def __init__(self, n: int) -> None:
            self.n = n

        def __eq__(self, other: Any) -> bool:
            return type(other) is Token and other.n == self.n

    def build():
        seen: List[Any] = []

        class Log(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                seen.append(("log", x.shape[0]))
                return torch.from_numpy(np.tanh(x.detach().numpy()))

            @staticmethod
            def backward(ctx, g):
                return g

        class Tag(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                seen.append(("tag", len(seen)))
                return x * 2, Token(len(seen))

            @staticmethod
            def backward(ctx, g, _):
                return g * 2

        def use(h):
            y, token = Tag.apply(Log.apply(h))
            return y + 1, token
        return Scaled(use), seen
    tm = parity(build, _batches(3))
    assert tm.capture_info().fallback_reason is None


@pytest.mark.parametrize("where", ["same_frame", "helper"])
def test_forward_raising_on_the_capturing_call_runs_once(where):
    """The forward raised on the capturing call: the model's except gets that run's error (dynamo
    gives up a frame that breaks inside a try block, which then runs as plain Python), and the
    forward does not run a second time on that step."""
    def build():
        # The Function's record and the model's are two lists: on the capturing step the Function
        # ran when the capture reached it, before the model's append above it (see "Limits").
        calls: Dict[str, List[Any]] = {"forward": [], "model": []}

        class Picky(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, mode):
                calls["forward"].append((mode, x.shape[0]))
                if mode != "double":
                    raise ValueError(f"unknown mode {mode} (call {len(calls['forward'])})")
                return x * 2

            @staticmethod
            def backward(ctx, g):
                return g * 2, None

        def helper(h, mode):
            return Picky.apply(h, mode)

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.randn(4))
                self.mode = "quadruple"

            def forward(self, x):
                h = x * self.w
                calls["model"].append("before")
                try:
                    y = Picky.apply(h, self.mode) if where == "same_frame" else helper(h, self.mode)
                except ValueError as e:
                    calls["model"].append(str(e))
                    y = h * 4
                calls["model"].append("after")
                return y
        return M(), calls
    tm = parity(build, _batches(3), options={})
    info = tm.capture_info()
    assert info.fallback_reason is None
    assert any("Picky" in h and "ValueError" in h for h in info.python_op_handoffs), info.python_op_handoffs


def test_forward_raising_uncaught_is_eagers_error_once():
    """Not caught: the step ends with the capture's run's error, as eager's ends with its own, and
    the forward ran once (no eager rerun to tell a capture failure from the model's error)."""
    calls = {"n": 0}

    class Strict(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            calls["n"] += 1
            if x.shape[-1] != 5:
                raise ValueError("Strict wants 5 columns")
            return x

        @staticmethod
        def backward(ctx, g):
            return g
    for fallback in ("raise", "eager"):
        calls["n"] = 0
        tm = fxtrain.TrainModule(Scaled(lambda h: Strict.apply(h)), fxtrain.Options(fallback=fallback))
        with pytest.raises(ValueError, match="Strict wants 5 columns"):
            tm(torch.randn(3, 4))
        assert calls["n"] == 1, (fallback, calls)
        # A later step's error comes from eager's own call; TrainModule reruns that step eagerly to
        # tell it from a capture failure (see "Limits"), and raises eager's error.
        with pytest.raises(ValueError, match="Strict wants 5 columns"):
            tm(torch.randn(3, 4))
        assert tm.capture_info().fallback_reason is None


@pytest.mark.parametrize("kind", ["counter", "str"])
def test_failed_capture_rerun_eagerly_runs_each_forward_once(kind):
    """The capture fails after the Function ran for real (fullgraph=True and a graph break below
    it): the eager rerun's call takes that run, so on that step the forward ran once, as in eager;
    later steps run eagerly, as fallback="eager" says."""
    def build():
        calls = {"n": 0, "grads": 0, "sizes": []}

        class Counted(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                calls["n"] += 1
                calls["sizes"].append(tuple(x.shape))
                ctx.n = calls["n"]
                return torch.from_numpy(np.tanh(x.detach().numpy())) * calls["n"]

            @staticmethod
            def backward(ctx, g):
                calls["grads"] += 1
                return g * ctx.n

        F = Counted if kind == "counter" else _counting_label(calls)

        def use(h):
            out = F.apply(h) if kind == "counter" else F.apply(h, [])
            y = out if kind == "counter" else out[0]
            torch._dynamo.graph_break()
            return y * 2, out
        return Scaled(use), calls
    with pytest.warns(fxtrain.FallbackWarning):
        tm = parity(build, _batches(3), options={"fullgraph": True})
    assert tm.capture_info().fallback_reason is not None


# ------------------------------------------- the backward op's direct call of the Function's node
def _adjusted(kind: str) -> Any:
    """A Function whose backward returns what the autograd engine adjusts or refuses: the PythonOp
    calls the node itself and must leave those results to the engine, as eager does."""
    class Adjusted(torch.autograd.Function):
        calls: List[Tuple[int, ...]] = []

        @staticmethod
        def forward(ctx, x, y, k):
            ctx.k = k
            return x * k + y

        @staticmethod
        def backward(ctx, g):
            Adjusted.calls.append(tuple(g.shape))
            gx = g * ctx.k
            if kind == "broadcast":      # an expanded gradient: the engine sums it back to x's shape
                return gx.expand(2, *gx.shape), None, None
            if kind == "dtype":          # float64 for a float32 input: the engine casts it
                return gx.double(), g, None
            if kind == "extra_none":     # more results than arguments, the extra ones None
                return gx, None, None, None
            if kind == "count":          # too few results: eager's error
                return (gx,)
            if kind == "shape":          # a shape the engine cannot reduce: eager's error
                return gx[:1], None, None
            return gx, g, None           # plain: y's gradient counts only where y takes one
    return Adjusted


@pytest.mark.parametrize("kind", ["plain", "twice", "broadcast", "dtype", "extra_none"])
def test_backward_results_the_engine_adjusts_are_eagers(kind):
    """backward="graph" runs the AOTAutograd graphs, where python_op_backward calls the Function's
    node without a nested engine run."""
    backward = "graph"
    def build():
        F = _adjusted(kind)

        def use(h):
            y = h if kind == "twice" else h.detach() * 3   # the same tensor twice, or one without grad
            return F.apply(h, y, 0.5)
        return Scaled(use), F.calls
    tm = parity(build, _batches(3), options={"fallback": "raise", "backward": backward})
    _clean(tm)


@pytest.mark.parametrize("kind", ["count", "shape"])
def test_backward_results_the_engine_refuses_raise_eagers_error(kind):
    torch.manual_seed(0)
    F = _adjusted(kind)
    model = Scaled(lambda h: F.apply(h, h.detach(), 0.5))
    ref = Scaled(lambda h: F.apply(h, h.detach(), 0.5))
    ref.load_state_dict(model.state_dict())
    tm = fxtrain.TrainModule(model, fxtrain.Options(fallback="raise", backward="graph"))
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError) as eager_error:
        ref(x).sum().backward()
    with pytest.raises(RuntimeError) as error:
        tm(x).sum().backward()
    assert str(error.value) == str(eager_error.value)
    assert F.calls == [(3, 4), (3, 4)]   # the user's backward ran once for each


def test_same_tensor_returned_twice_gets_eagers_gradients():
    """Eager's node sees one output (the later position) for a tensor returned twice: the first
    position's gradient is zeros and the second gets both uses' sum."""
    def build():
        seen: List[Tuple[float, float]] = []

        class Twice(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                y = x * 2
                return y, y

            @staticmethod
            def backward(ctx, g1, g2):
                seen.append((float(g1.sum()), float(g2.sum())))
                return g1 * 10 + g2

        def use(h):
            a, b = Twice.apply(h)
            return a * 3 + b
        return Scaled(use), seen
    tm = parity(build, _batches(3), options={"fallback": "raise", "backward": "graph"})
    _clean(tm)


def test_failed_recapture_after_a_graph_ran_takes_that_graphs_function_runs():
    """A later call's capture fails (the recompile limit, in the frame after a graph break) after the
    call's first graph ran a Function: the eager rerun takes that run, so the forward ran once on
    that step too."""
    class Flagged(nn.Module):
        def __init__(self, fn: Any) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))
            self.fn, self.scale = fn, 2

        def forward(self, x):
            a = self.fn(x * self.w)
            torch._dynamo.graph_break()
            return a * self.scale

    torch.manual_seed(0)
    calls: Dict[str, Any] = {"counted": [], "guarded": [], "caught": 0}
    ref_calls: Dict[str, Any] = {"counted": [], "guarded": [], "caught": 0}
    counted, ref_counted = _guarded(calls)[0], _guarded(ref_calls)[0]
    model, ref = Flagged(lambda h: counted.apply(h)), Flagged(lambda h: ref_counted.apply(h))
    ref.load_state_dict(model.state_dict())
    tm = fxtrain.TrainModule(model, fxtrain.Options(recompile_limit=1))
    for step, x in enumerate(_batches(3)):
        model.scale = ref.scale = 2 + step   # the second frame's guard fails on each later call
        if step == 1:
            with pytest.warns(fxtrain.FallbackWarning, match="recompile limit"):
                out = tm(x)
        else:
            out = tm(x)
        r = ref(x)
        assert_same(out, r, f"step {step} output")
        out.sum().backward()
        r.sum().backward()
        torch.testing.assert_close(model.w.grad, ref.w.grad)
        assert_same(calls, ref_calls, f"step {step} Python state")
