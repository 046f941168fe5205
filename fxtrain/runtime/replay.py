"""Run aten forward/backward graphs without AOTAutograd's runtime: live captures and cache hits.

AOTAutograd wraps its graphs in a runtime that handles input mutations, aliased outputs, tensor
subclasses, effect tokens and RNG state, in several layers of Python per call. For graphs that need
none of that but in-place updates of inputs that take no gradient (BatchNorm's running statistics),
checked from AOTAutograd's own metadata at capture (:func:`replay_spec`), the runtime is one
autograd.Function: run the forward graph, write the updated buffers back, save what the backward
needs, and hand the backward graph the saved values and the gradients of the outputs that have one.
The same object runs a graph just captured and one loaded from the cache, where rebuilding it costs
milliseconds instead of a re-trace. Graphs outside that (``NotReplayable``) keep AOTAutograd's runtime.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.fx
from torch.autograd.function import once_differentiable

from ..torch_private import output_needs_tangent, release_saved_tensors
from . import weight_split
from .absent_grads import AbsentGradBackward
from ..errors import Error


class NotReplayable(Error):
    """The captured graph needs AOTAutograd's full runtime; it is not cached (the reason says why)."""


@dataclass(frozen=True)
class ReplaySpec:
    """Where things are among the forward graph's outputs, and which outputs get gradients."""

    n_inputs: int
    n_returns: int                      # user outputs, first among the forward graph's outputs
    saved: slice                        # tensors saved with a version-counter check
    saved_no_check: slice               # tensors saved without one
    symints: slice                      # sizes saved for backward
    non_differentiable: Tuple[int, ...]  # returns that do not require grad
    tangents: Tuple[int, ...]           # returns whose gradient the backward graph takes, in order
    inference: bool                     # no backward graph: the forward is all there is
    unsafe_views: Tuple[int, ...] = ()  # returns that view a graph intermediate: handed out as non-views
    mutated: Tuple[int, ...] = ()       # inputs updated in place: their new values are the first returns


def replay_spec(metadata: Any, n_inputs: int, inference: bool) -> ReplaySpec:
    """Build the spec from AOTAutograd's ViewAndMutationMeta, or raise NotReplayable."""
    for i in metadata.input_info:
        if i.mutates_metadata or getattr(i, "mutates_storage_metadata", False):
            raise NotReplayable("the graph changes an input's shape or storage in place")
        if i.mutates_data and i.requires_grad:
            raise NotReplayable("the graph updates an input that takes a gradient in place")
    mutated = tuple(i for i, info in enumerate(metadata.input_info) if info.mutates_data)
    if len(mutated) != metadata.num_mutated_inp_runtime_indices:
        raise NotReplayable("the graph's input updates are not laid out as expected")
    m = len(mutated)
    if metadata.num_intermediate_bases or metadata.num_outputs_aliased:
        raise NotReplayable("an output aliases an input or another output")
    if metadata.tokens:
        raise NotReplayable("the graph has ordered side effects (effect tokens)")
    if metadata.is_rng_op_functionalized:
        raise NotReplayable("the graph functionalizes random number generation")
    # AOTAutograd records fake/functional tensor types here; a real subclass flattens itself.
    if any(isinstance(o.raw_type, type) and hasattr(o.raw_type, "__tensor_flatten__") for o in metadata.output_info):
        raise NotReplayable("an output is a tensor subclass")
    if getattr(metadata, "subclass_inp_meta", None) and any(
            not isinstance(m, int) and type(m).__name__ != "PlainTensorMeta" for m in metadata.subclass_inp_meta):
        raise NotReplayable("an input is a tensor subclass")
    n_returns = metadata.num_forward_returns
    # AOTAutograd's runtime re-wraps these with _unsafe_view so that the caller holds a plain tensor,
    # not a view whose base is an intermediate it never sees; the replay does the same.
    unsafe = tuple(m + i for i, o in enumerate(metadata.output_info) if o.output_type.name == "unsafe_view_alias")
    if inference:
        empty = slice(0, 0)
        return ReplaySpec(n_inputs, n_returns, empty, empty, empty, tuple(range(m)), (), True, unsafe, mutated)
    if getattr(metadata, "num_opaque_objects_saved_for_bw", 0):
        raise NotReplayable("the backward needs opaque objects")
    tangents = tuple(
        m + i for i, o in enumerate(metadata.output_info)
        if o.output_type.name in ("non_alias", "unsafe_view_alias", "custom_function_view")
        and o.raw_type is not None and issubclass(o.raw_type, torch.Tensor) and output_needs_tangent(o))
    non_diff = tuple(range(m)) + tuple(m + i for i, o in enumerate(metadata.output_info) if not o.requires_grad)
    return ReplaySpec(
        n_inputs=n_inputs, n_returns=n_returns,
        saved=metadata.tensors_saved_for_backwards_with_vc_check_slice,
        saved_no_check=metadata.tensors_saved_for_backwards_no_vc_check_slice,
        symints=metadata.symints_saved_for_backwards_slice,
        non_differentiable=non_diff, tangents=tangents, inference=False, unsafe_views=unsafe, mutated=mutated)


def _plain_returns(outs: Sequence[Any], spec: ReplaySpec) -> Tuple[Any, ...]:
    returns = list(outs[:spec.n_returns])
    for i in spec.unsafe_views:
        returns[i] = torch.ops.aten._unsafe_view(returns[i], returns[i].size())
    return tuple(returns)


class _Runner:
    """The compiled pieces one _ReplayFunction.apply needs (passed as its first argument).

    ``forward``: boxed (takes the argument list); ``backward``: AbsentGradBackward, boxed too."""

    def __init__(self, forward: Callable[[List[Any]], Any], backward: Optional[AbsentGradBackward],
                 spec: ReplaySpec) -> None:
        self.forward, self.backward, self.spec = forward, backward, spec
        # Argument positions of the tensors among the graph's inputs (the same on every call of
        # one capture), recorded on the first call: the backward maps the node's next_functions,
        # one per tensor input, back to them when it splits off weight gradients.
        self.tensor_positions: Optional[Tuple[int, ...]] = None


class _ReplayFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, runner: _Runner, *args: Any) -> Any:  # type: ignore[override]
        spec = runner.spec
        if runner.tensor_positions is None:
            runner.tensor_positions = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        outs = runner.forward(list(args))
        returns = _plain_returns(outs, spec)
        # A view saved for backward would keep its base's autograd history: AOTAutograd detaches too.
        ctx.save_for_backward(*[x.detach() if x._is_view() else x for x in outs[spec.saved]])
        ctx.unchecked = [x.detach() if x._is_view() else x for x in outs[spec.saved_no_check]]
        ctx.symints = list(outs[spec.symints])
        ctx.runner = runner
        ctx.n_args = len(args)
        non_diff = [returns[i] for i in spec.non_differentiable if isinstance(returns[i], torch.Tensor)]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        assert runner.backward is not None
        ctx.set_materialize_grads(not runner.backward.accepts_none)
        return returns

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Any) -> Any:
        runner: _Runner = ctx.runner
        tangents = [grads[i].contiguous() if isinstance(grads[i], torch.Tensor) else grads[i]
                    for i in runner.spec.tangents]
        args = [*ctx.symints, *ctx.saved_tensors, *ctx.unchecked, *tangents]
        ctx.unchecked = []
        del tangents, grads
        # The list is the only owner of the saved tensors now: the boxed backward graph frees each
        # one after its last use, as eager's engine frees a node's saved tensors when it has run.
        release_saved_tensors(ctx)
        assert runner.backward is not None
        pending = weight_split.current()
        weights: Tuple[int, ...] = ()
        if pending is not None and runner.tensor_positions is not None:
            weights, accumulators = weight_split.weight_positions(ctx, runner.tensor_positions, pending)
        if weights and pending is not None:
            # A zero-bubble schedule's B step: input gradients now, parameter gradients queued (W).
            input_grads, run_weights = runner.backward.split_call(args, weights)
            if run_weights is not None:
                pending.defer(run_weights, accumulators)
        else:
            input_grads = list(runner.backward(args))
        if len(input_grads) < ctx.n_args:
            input_grads += [None] * (ctx.n_args - len(input_grads))
        return (None, *input_grads[:ctx.n_args])


def _write_back(spec: ReplaySpec, args: Sequence[Any], returns: Sequence[Any]) -> List[Any]:
    """Apply the graph's in-place input updates; the user's outputs follow them."""
    m = len(spec.mutated)
    if m:
        with torch.no_grad():
            for i, new in zip(spec.mutated, returns):
                args[i].copy_(new)
    return list(returns[m:])


def replayed(forward: Callable[[List[Any]], Any], backward: Optional[AbsentGradBackward],
             spec: ReplaySpec) -> Callable[..., List[Any]]:
    """A callable with the calling convention of AOTAutograd's: flat graph inputs in, outputs out.

    ``forward`` is an executor's compiled forward graph (boxed), ``backward`` the backward graph's
    runner (None for an inference graph)."""
    if spec.inference:
        def run_inference(*args: Any) -> List[Any]:
            # No output takes a gradient, so nothing is recorded (AOTAutograd's runtime does the
            # same); inductor's out= kernels refuse inputs that require grad when grad is on.
            with torch.no_grad():
                outs = forward(list(args))
            return _write_back(spec, args, _plain_returns(outs, spec))
        return run_inference
    if backward is None:
        raise NotReplayable("no backward graph was saved")
    runner = _Runner(forward, backward, spec)

    def run(*args: Any) -> List[Any]:
        return _write_back(spec, args, _ReplayFunction.apply(runner, *args))

    return run


def check_graph_arity(forward_graph: torch.fx.GraphModule, backward_graph: Optional[torch.fx.GraphModule],
                      spec: ReplaySpec, dynamo_inputs: Sequence[Any]) -> None:
    """AOTAutograd may dedupe or merge aliased inputs: then its graphs' inputs are not dynamo's."""
    n_fw = sum(1 for n in forward_graph.graph.nodes if n.op == "placeholder")
    if n_fw != len(dynamo_inputs):
        raise NotReplayable(f"the forward graph takes {n_fw} inputs for dynamo's {len(dynamo_inputs)}")
    if backward_graph is not None:
        out = next(n for n in reversed(backward_graph.graph.nodes) if n.op == "output")
        n_grads = len(out.args[0]) if isinstance(out.args[0], (list, tuple)) else 1
        if n_grads != spec.n_inputs:
            raise NotReplayable(f"the backward graph returns {n_grads} gradients for {spec.n_inputs} inputs")
