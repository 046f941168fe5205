"""PythonOps outside AOTAutograd: the dynamo-level graph run directly under eager autograd, so
``fxtrain::python_op`` is called with grad enabled and its Autograd kernel builds the gradient; plus
the op pair on a device other than the CPU (its handle stays on the CPU). Eager PyTorch is the oracle.

Two kernels are checked: on plain tensors the user's Function is applied directly (``plain``); under
a dispatch mode or on fake tensors (what tracers and the profiler see) the op stays opaque and its
formula, ``python_op_backward`` through the pool, gives the gradient (``opaque``, forced here with a
pass-through TorchDispatchMode around the graph).
"""
import copy
import gc

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fxtrain.pythonop import routing
from fxtrain.pythonop.op import POOL
from fxtrain.pythonop.registry import CONSTANT, TENSOR, CallSpec, OutputMeta, register
from utils import assert_grads_equal, current_device, to_device

PYTHON_OP = torch.ops.fxtrain.python_op.default
PYTHON_OP_BACKWARD = torch.ops.fxtrain.python_op_backward.default


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


class _PassThrough(TorchDispatchMode):
    """Runs every op unchanged; its presence alone puts the Python key on each call."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class Compiled(nn.Module):
    """``model`` captured by dynamo with Function.apply routed to PythonOps, its graph run as is
    (no AOTAutograd): eager autograd differentiates the graph."""

    def __init__(self, model, kernel):
        super().__init__()
        self.model = model
        self.graphs = []
        torch._dynamo.reset()   # every test's Host shares one forward code object: start its cache afresh
        self._compiled = torch.compile(model, backend=self._backend, fullgraph=True, dynamic=False)
        self.kernel = kernel

    def _backend(self, gm, example_inputs):
        self.graphs.append(gm)
        if self.kernel == "plain":
            return gm.forward

        def run(*args):
            with _PassThrough():
                return gm(*args)
        return run

    def python_op_calls(self):
        return sum(1 for gm in self.graphs for n in gm.graph.nodes if n.target in (PYTHON_OP, torch.ops.fxtrain.python_op))

    def forward(self, *args):
        with routing(lambda name, why=None: None):
            return self._compiled(*args)


def _pair(model, kernel):
    model = to_device(model)
    ref = copy.deepcopy(model)
    return Compiled(model, kernel), ref


def _parity(model, kernel, batches=(3, 5), backward=lambda loss: loss.backward()):
    gc.collect()
    pooled = len(POOL)
    compiled, ref = _pair(model, kernel)
    for b in batches:
        x = torch.randn(b, 4, device=current_device())
        out, r = compiled(x), ref(x)
        _close(out, r)
        # plain: no pool entry at all; opaque: one per Function call, waiting for the backward
        assert (len(POOL) > pooled) == (kernel == "opaque")
        backward(out); backward(r)
        assert_grads_equal(compiled.model, ref)
        compiled.model.zero_grad(); ref.zero_grad()
        del out
        gc.collect()
        assert len(POOL) == pooled
    assert compiled.python_op_calls() >= 1, "the Function must be a PythonOp in the graph"
    return compiled


class Host(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.lin(x), x).sum()


class Scale(torch.autograd.Function):
    """Saves its input, takes a float argument, has a backward that is not the true derivative."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.save_for_backward(x)
        ctx.k = k
        return x * k

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * ctx.k + x * 0.25, None


class NeedsGrad(torch.autograd.Function):
    seen = []

    @staticmethod
    def forward(ctx, x, y):
        return x * y

    @staticmethod
    def backward(ctx, g):
        NeedsGrad.seen.append(tuple(ctx.needs_input_grad))
        return g if ctx.needs_input_grad[0] else None, g if ctx.needs_input_grad[1] else None


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


class NonDifferentiable(torch.autograd.Function):
    """A second, integer output marked non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        idx = x.argmax(dim=-1)
        ctx.mark_non_differentiable(idx)
        return x * 2, idx

    @staticmethod
    def backward(ctx, g, gi):
        assert gi is None or not gi.any()
        return g * 2


class NewStyleOnceDiff(torch.autograd.Function):
    grad_modes = []

    @staticmethod
    def forward(x, k):
        return x.exp() * k

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.k = inputs[1]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        NewStyleOnceDiff.grad_modes.append(torch.is_grad_enabled())
        (x,) = ctx.saved_tensors
        return g * x.exp() * ctx.k * 3.0, None   # deliberately not the true derivative


KERNELS = ["plain", "opaque"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_saved_tensors_and_non_tensor_argument(kernel):
    _parity(Host(lambda h, x: Scale.apply(h, 0.5)), kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_needs_input_grad(kernel):
    NeedsGrad.seen.clear()
    _parity(Host(lambda h, x: NeedsGrad.apply(h, x)), kernel, batches=(3,))
    assert NeedsGrad.seen == [(True, False), (True, False)]


@pytest.mark.parametrize("materialize", [False, True])
@pytest.mark.parametrize("kernel", KERNELS)
def test_materialize_grads(kernel, materialize):
    Materialize.seen.clear()
    _parity(Host(lambda h, x: Materialize.apply(h, materialize)[0]), kernel, batches=(3,))
    expected = (False, not materialize)
    assert Materialize.seen == [expected, expected]


@pytest.mark.parametrize("kernel", KERNELS)
def test_mark_non_differentiable(kernel):
    def use(h, x):
        y, idx = NonDifferentiable.apply(h)
        assert not idx.requires_grad and idx.dtype == torch.int64
        return y * (idx.float().unsqueeze(-1) + 1)
    _parity(Host(use), kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_setup_context_and_once_differentiable(kernel):
    NewStyleOnceDiff.grad_modes.clear()
    _parity(Host(lambda h, x: NewStyleOnceDiff.apply(h, 0.5)), kernel, batches=(3,))
    assert NewStyleOnceDiff.grad_modes == [False, False]


@pytest.mark.parametrize("kernel", KERNELS)
def test_retain_graph_runs_the_users_backward_again(kernel):
    def twice(loss):
        loss.backward(retain_graph=True)
        loss.backward()
    _parity(Host(lambda h, x: Scale.apply(h, 0.5)), kernel, backward=twice)


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def test_plain_kernel_is_the_users_node_double_backward_included():
    """On plain tensors the graph holds the user's own node: even create_graph works as in eager."""
    compiled, ref = _pair(Host(lambda h, x: Square.apply(h)), "plain")
    x = torch.randn(3, 4, device=current_device())
    grads = []
    for model in (compiled, ref):
        w = model.lin.weight if model is ref else model.model.lin.weight
        (g,) = torch.autograd.grad(model(x), [w], create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), [w])
        grads.append((g, gg))
    _close(grads[0][0], grads[1][0])
    _close(grads[0][1], grads[1][1])


# ------------------------------------------------------------------------ handle never on the data's device
def _scale_spec(device):
    # Output sizes: those of input 0 (dims 0 and 1), on the data's device.
    spec = CallSpec(fn_cls=Scale, args=[(TENSOR, 0), (CONSTANT, 0.5)], kwargs={}, result=(TENSOR, 0),
                    differentiable=[True], record=True, grad_meta=[(2, torch.float32, torch.device(device))],
                    meta=[OutputMeta(torch.float32, torch.device(device), sizes=[(0, 0), (0, 1)])])
    return register(spec)


class _ValueReads(TorchDispatchMode):
    """Records the device of every tensor whose value is read back to Python (int(), .item())."""

    def __init__(self):
        super().__init__()
        self.devices = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            self.devices.append(args[0].device.type)
        return func(*args, **(kwargs or {}))


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")   # the profiler patches that
def test_handle_lives_on_the_cpu_and_is_never_read_from_the_data_device():
    """Data on another device than the CPU: the handle is made on, and read back from, the CPU only,
    so the op pair never synchronises with the device. The fake kernel (what dynamo and AOTAutograd
    see) is checked with fake CUDA tensors; the real kernels, which run the user's Function, with fake
    "meta" tensors, as the profiler runs them (a CPU-only torch cannot apply a Function on CUDA ones),
    and with real tensors on the test device (a GPU's under FXTRAIN_TEST_DEVICE=cuda)."""
    from fxtrain.pythonop.op import python_op, python_op_backward
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.randn(3, 4, device="cuda")
        fake_outs = PYTHON_OP(_scale_spec("cuda"), [x])
    assert fake_outs[0].device.type == "cuda" and fake_outs[-1].device == torch.device("cpu")
    assert fake_outs[-1].dtype == torch.int64 and fake_outs[-1].shape == ()

    key = _scale_spec("meta")
    with FakeTensorMode():
        x = torch.randn(3, 4, device="meta")
        g = torch.ones(3, 4, device="meta")
        reads = _ValueReads()
        with reads:
            outs = python_op._init_fn(key, [x])
            assert outs[0].device.type == "meta" and outs[-1].device == torch.device("cpu")
            (gx,) = python_op_backward._init_fn(key, outs[-1], [g], [3, 4])
        assert gx.device.type == "meta" and gx.shape == (3, 4)
        assert reads.devices == ["cpu"]           # the handle, read once, on the CPU
        # the opaque formula under autograd, then the engine's backward through it
        xg = x.detach().requires_grad_()
        y, handle = PYTHON_OP(key, [xg])
        assert handle.device == torch.device("cpu") and y.requires_grad
        (g2,) = torch.autograd.grad(y, [xg], g)
        assert g2.device.type == "meta"

    # Real tensors on the test device: the same kernels, then the opaque formula (forced by a
    # dispatch mode, as the "opaque" kernel above) under the engine.
    x = torch.randn(3, 4, device=current_device())
    key = _scale_spec(x.device)
    reads = _ValueReads()
    with reads:
        outs = python_op._init_fn(key, [x])
        (gx,) = python_op_backward._init_fn(key, outs[-1], [torch.ones_like(x)], [3, 4])
    assert outs[0].device == x.device and outs[-1].device == torch.device("cpu")
    assert reads.devices == ["cpu"]
    _close(gx, 0.5 + x * 0.25)   # Scale's backward: g * k + x / 4
    xg = x.requires_grad_()
    with _PassThrough():
        y, handle = PYTHON_OP(key, [xg])
        (g2,) = torch.autograd.grad(y, [xg], torch.ones_like(y))
    assert handle.device == torch.device("cpu")
    _close(g2, gx)
