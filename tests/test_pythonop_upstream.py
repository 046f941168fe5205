"""Custom Functions from PyTorch's own tests, inside a TrainModule (``fallback="raise"``: through
the graph, never an eager rerun), against eager PyTorch on the test device (FXTRAIN_TEST_DEVICE).

- A backward returning None for an input that requires grad (``test_function_returns_undefined_tensor``
  in test/test_autograd.py): eager passes no gradient on, so a parameter no other path reaches keeps
  ``.grad`` None, which AdamW skips (zeros it would decay). Checked per parameter over AdamW steps.
- A tensor subclass made inside the model and passed to a Function
  (``test_tensor_subclass_intermediary_input`` in test/dynamo/test_autograd_function.py): a wrapper
  subclass whose ``__torch_dispatch__`` implements almost nothing, unwrapped and made again by the
  Function's forward.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List

import pytest
import torch
from torch import nn

import fxtrain
from utils import current_device, to_device


def _adamw_parity(model: nn.Module, batches: List[torch.Tensor], options: Dict[str, Any]) -> fxtrain.TrainModule:
    """Train ``model`` in a TrainModule and a copy eagerly with AdamW (weight decay on): losses, each
    parameter's gradient (None where eager's is None) and the parameters after each step agree."""
    model = to_device(model)
    ref = copy.deepcopy(model)
    tm = fxtrain.TrainModule(model, fxtrain.Options(fallback="raise", **options))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    for step, x in enumerate(batches):
        x = to_device(x)
        loss, ref_loss = tm(x), ref(x)
        torch.testing.assert_close(loss, ref_loss, equal_nan=True, msg=lambda m: f"step {step} loss: {m}")
        loss.backward()
        ref_loss.backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), \
                f"step {step} {name}: grad {'None' if p.grad is None else 'a tensor'}, eager's " \
                f"{'None' if q.grad is None else 'a tensor'}"
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, equal_nan=True, msg=lambda m: f"step {step} grad {name}: {m}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, equal_nan=True, msg=lambda m: f"step {step} param {name}: {m}")
    return tm


def _batches(n: int = 3, rows: int = 3, size: int = 4) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(rows, size, generator=g) for _ in range(n)]


def _clean(tm: fxtrain.TrainModule) -> None:
    info = tm.capture_info()
    assert (info.graph_breaks, info.fallback_reason, info.python_op_handoffs) == (0, None, []), str(info)


# ------------------------------------------------------------- a backward returning None
def _none_functions(calls: List[str]) -> Any:
    class NoGradient(torch.autograd.Function):
        """Returns no gradient at all (upstream's MyFunction); its forward counts its calls, a
        side effect, so the capture shapes it by its real run (the op's formula runs the capturing
        step's backward)."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            calls.append("none")
            return x * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> Any:
            return None

    class FirstOnly(torch.autograd.Function):
        """A gradient for its first input, None for its second (shaped by its real run too)."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            calls.append("first")
            return x * y

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> Any:
            return g * 3, None

    return NoGradient, FirstOnly


class NoneGradients(nn.Module):
    """``a`` and ``b`` reach the loss only through None gradients (``b`` through ``b ** 2`` first);
    ``c`` through a None gradient and a real one; ``lin`` through a real gradient only."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: List[str] = []
        self.NoGradient, self.FirstOnly = _none_functions(self.calls)
        self.lin = nn.Linear(4, 4)
        self.a = nn.Parameter(torch.randn(4))
        self.b = nn.Parameter(torch.randn(4))
        self.c = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.FirstOnly.apply(self.lin(x), self.a)
        h = h + self.NoGradient.apply(self.b ** 2) + self.NoGradient.apply(self.c) + self.c
        return (h * h).mean()


@pytest.mark.parametrize("options", [{}, {"backward": "graph"}], ids=["default", "graph"])
def test_backward_returning_none_leaves_parameters_without_grad(options):
    tm = _adamw_parity(NoneGradients(), _batches(), options)
    _clean(tm)


class PickOne(nn.Module):
    """Two parameters into one Function, which gives the first a gradient and the second None."""

    def __init__(self) -> None:
        super().__init__()
        self.NoGradient, self.FirstOnly = _none_functions([])
        self.w = nn.Parameter(torch.randn(4))
        self.v = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.FirstOnly.apply(self.w, self.v) * x).sum()


@pytest.mark.parametrize("options", [{}, {"backward": "graph"}], ids=["default", "graph"])
def test_backward_returning_none_for_one_input_and_a_gradient_for_the_other(options):
    tm = _adamw_parity(PickOne(), _batches(), options)
    _clean(tm)


# --------------------------------------------------------- a tensor subclass through a Function
class Wrapped(torch.Tensor):
    """A wrapper subclass as upstream's FooTensor: it holds a tensor and metadata, and implements
    clone and view only (enough for dynamo to make fake copies); any other op raises."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, config: Any, scale: torch.Tensor) -> "Wrapped":
        self = torch.Tensor._make_wrapper_subclass(cls, config[0], strides=config[1], storage_offset=config[2],
                                                   dtype=config[3], layout=config[4], requires_grad=config[5],
                                                   device=data.device)
        self._data = data
        self._config = config
        self._scale = scale
        return self

    def __repr__(self) -> str:
        return "Wrapped"

    def __tensor_flatten__(self) -> Any:
        return ("_data",), (self._config, self._scale)

    @staticmethod
    def __tensor_unflatten__(tensors: Dict[str, torch.Tensor], metadata: Any, outer_size: Any, outer_stride: Any) -> "Wrapped":
        return Wrapped(tensors["_data"], metadata[0], metadata[1])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any, kwargs: Any = None) -> Any:
        if func == torch.ops.aten.clone.default:
            return Wrapped(args[0]._data.clone(), args[0]._config, args[0]._scale)
        if func == torch.ops.aten.view.default:
            return Wrapped(args[0]._data.view(*args[1:]), args[0]._config, args[0]._scale)
        raise NotImplementedError(f"Wrapped does not implement {func}")


class Unwrap(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Wrapped) -> torch.Tensor:
        x2 = x._data * x._scale + 1.0
        return Wrapped(x2, x._config, x._scale)._data   # a subclass made inside forward too

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


class SubclassModel(nn.Module):
    """Upstream's ``foo`` inside a model: ``h`` wrapped (a new leaf that requires grad: no gradient
    reaches ``h`` through it, as in eager) and passed through ``Unwrap``; ``h`` itself also reaches
    the loss, so the parameters train."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        # storage_offset() would break the graph (dynamo: "torch.* op returned non-Tensor"); h has none
        config = (h.size(), h.stride(), 0, h.dtype, h.layout, h.requires_grad)
        y = Unwrap.apply(Wrapped(h, config, self.scale))
        return (y * h).mean()


@pytest.mark.parametrize("options", [{}, {"dynamic": True}, {"backward": "graph"}], ids=["default", "dynamic", "graph"])
def test_tensor_subclass_made_in_the_model_through_a_function(options):
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(rows, 4, generator=g) for rows in (3, 5, 3)]
    tm = _adamw_parity(SubclassModel(), batches, options)
    _clean(tm)
    assert tm.capture_info().python_ops == [f"{Unwrap.__module__}.{Unwrap.__qualname__}"]
