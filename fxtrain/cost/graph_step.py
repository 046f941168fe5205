"""Cost one captured step's aten graphs on fake tensors, as the graph runtime runs them.

This is what a memory budget plans with (``capture/budget.py``): each candidate split of the joint
graph into a forward and a backward is costed here, while the capture is still in progress, before
anything runs. It is the profiler's cost model on a smaller stage: the same ``CostTracker`` (live
storages, peak, FLOPs), the same runtime (``runtime/replay.py``: one autograd.Function whose boxed
backward frees each saved tensor after its last use, ``AbsentGradBackward`` for outputs nobody
differentiates), the autograd engine accumulating the gradients, and the loop ``cost/step.py``
defines, in steady state::

    out = step(*inputs)                 # the replayed forward graph
    loss.backward()                     # the loss: the 0-d output (else the first output, summed)
    del out
    optimizer.step(); optimizer.zero_grad(set_to_none=True)

with the outputs held through the backward (the profiler's default loop; a loop that drops them
peaks lower, never higher). What it leaves out is what lies around the graphs: the model's Python
between graphs of a model with graph breaks, deferred outputs and the dense route of the sparsity
passes. ``fxtrain.profile`` costs the whole module and is the check of these numbers.

Sizes: the capture's graphs may be symbolic. Every input is made a fake tensor of concrete sizes,
the capturing call's (``torch_private.size_hint``) unless ``sizes`` sets some symbols (the profiler's
largest-batch search); the graphs' size arithmetic then runs on ints.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx

from .. import torch_private as tp
from ..runtime.absent_grads import AbsentGradBackward
from ..runtime.replay import ReplaySpec, replayed
from .step import OptimizerSpec, optimizer_over, warm_optimizer_state
from .tracker import CostTracker


@dataclass
class GraphStepCost:
    """What one fake step of a forward/backward pair cost (bytes and FLOPs; ``seconds`` to cost it)."""

    peak_bytes: int
    peak_phase: str
    flops_forward: int
    flops_backward: int
    saved_bytes: int
    optimizer_state_bytes: int
    seconds: float


GraphInput = Tuple[Any, bool]   # (the forward graph placeholder's value, whether it takes a gradient)


def graph_inputs(forward: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> List[GraphInput]:
    """What ``GraphStepCoster`` needs of a graph's inputs: the placeholders' values (fake tensors
    and sizes, symbolic where the capture is) and which inputs take a gradient (the parameters), as
    the examples dynamo handed the backend say. No reference to the examples is kept: they are the
    user's first batch, which must not outlive its step."""
    values = tp.placeholder_examples(forward)
    return [(v, isinstance(x, torch.Tensor) and x.requires_grad) for v, x in zip(values, example_inputs)]


def _concrete(value: Any, requires_grad: bool, mode: Any, sizes: Optional[Dict[Any, int]]) -> Any:
    """A fake tensor of ``mode`` with ``value``'s layout at concrete sizes (an int for a size)."""
    if isinstance(value, torch.SymInt):
        return tp.size_hint(value, sizes)
    if not isinstance(value, torch.Tensor):
        return value
    shape = [tp.size_hint(s, sizes) for s in value.shape]
    stride = [tp.size_hint(s, sizes) for s in value.stride()]
    with mode:
        out = torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device)
    return out.requires_grad_(requires_grad)


def _loss(returns: Sequence[Any]) -> torch.Tensor:
    """What the loop calls ``backward()`` on: the first 0-d output that takes a gradient (an HF
    model's loss), else the first output that does, summed (``cost/step.py: loss_of``)."""
    differentiable = [r for r in returns if isinstance(r, torch.Tensor) and r.requires_grad]
    if not differentiable:
        raise ValueError("no output of the graph takes a gradient: nothing to cost a backward for")
    scalars = [r for r in differentiable if r.dim() == 0]
    return scalars[0] if scalars else differentiable[0].sum()


class GraphStepCoster:
    """Costs steps of one capture's graph pairs: the same inputs and optimizer, other splits.

    The optimizer's part of the step does not depend on the split (by then every activation is
    freed: parameters, state, gradients and the batch are live, whatever the forward saved), so it
    is costed once, with the first pair; later pairs run the forward and backward only, with the
    optimizer state laid out as the first step left it, and their peak is the larger of theirs and
    the optimizer's. That halves the cost of a costing with a per-parameter optimizer.
    """

    def __init__(self, inputs: Sequence[GraphInput], optimizer: OptimizerSpec = None,
                 sizes: Optional[Dict[Any, int]] = None, keep_outputs: bool = True) -> None:
        """``inputs``: ``graph_inputs(forward, example_inputs)``; ``sizes``: values for some size
        symbols (the rest at the capture's values)."""
        self.inputs = list(inputs)
        self.optimizer = optimizer
        self.sizes = sizes
        self.keep_outputs = keep_outputs
        self._state_layout: Optional[List[Tuple[List[int], List[int], torch.dtype, torch.device]]] = None
        self._optimizer_peak = 0

    def cost(self, forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, spec: ReplaySpec) -> GraphStepCost:
        """Cost a steady-state training step that runs ``forward``/``backward`` through the replay."""
        started = time.perf_counter()
        first = self._state_layout is None
        # Outside the profiler's own fake mode and tracker (if a capture runs under them), and as at
        # run time rather than inside dynamo's compile.
        with tp.disable_current_modes(), tp.outside_compile():
            mode = tp.FakeTensorMode(allow_non_fake_inputs=False)
            args = [_concrete(v, grad, mode, self.sizes) for v, grad in self.inputs]
            params = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            others = [a for a in args if isinstance(a, torch.Tensor) and not a.requires_grad]
            run = replayed(tp.boxed_copy(forward).forward,
                           AbsentGradBackward(backward, lambda g: tp.boxed_copy(g).forward), spec)
            # The optimizer's step counts are real values (shadows) that its next step reads: the
            # warm-up runs under a tracker of its own, sharing its shadows with the measured one.
            warm = CostTracker(mode)
            tracker = CostTracker(mode)
            tracker.shadows = warm.shadows
            opt = None
            state: List[Any] = []
            with mode, warm, torch.enable_grad():
                if first:
                    opt = optimizer_over(self.optimizer, params)
                    if opt is not None:
                        warm_optimizer_state(opt, params)
                        state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
                    self._state_layout = [(list(t.shape), list(t.stride()), t.dtype, t.device) for t in state]
                else:
                    assert self._state_layout is not None
                    state = [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                             for shape, stride, dtype, device in self._state_layout]
            tracker.register(params, "parameters")
            tracker.register(state, "optimizer state")
            tracker.register(others, "inputs")
            tracker.start_measuring()
            with mode, tracker, torch.enable_grad():
                tracker.phase = "forward"
                with tracker.watching_saved():
                    out: Any = run(*args)
                loss = _loss(out)
                if not self.keep_outputs:
                    out = None
                tracker.phase = "backward"
                loss.backward()
                del out, loss
                tracker.phase = "optimizer"
                if opt is not None:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                else:
                    for p in params:
                        p.grad = None
                tracker.phase = "end"
            tracker.counting = False   # later frees (a collection, the caller's outputs) are not this step's
            if first:
                self._optimizer_peak = max((b for phase, b in tracker.timeline if phase == "optimizer"), default=0)
            peak, phase = tracker.peak, tracker.peak_phase
            if self._optimizer_peak > peak:
                peak, phase = self._optimizer_peak, "optimizer"
            return GraphStepCost(peak_bytes=peak, peak_phase=phase,
                                 flops_forward=tracker.flops.get("forward", 0),
                                 flops_backward=tracker.flops.get("backward", 0),
                                 saved_bytes=sum(tracker.saved.values()),
                                 optimizer_state_bytes=tracker.initial.get("optimizer state", 0),
                                 seconds=time.perf_counter() - started)

