"""Every private torch API the runtime and the executors lean on, in one place.

Checked on torch ``CHECKED_ON``. Each function says what it needs from torch in words, so that a
torch upgrade is one file to read: if a name moved, fix it here (the test suite exercises each).
Modules outside this one import private torch names only for capture-time analysis that is tied
to dynamo's internals by nature (capture/, pythonop/route.py, cache/recipe.py, profile/tracker.py).
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Dict, Iterable, List, Optional, Sequence

import torch
import torch.fx

CHECKED_ON = "2.13.0"

aten = torch.ops.aten
# Ops fxtrain's backward passes (passes/cross_entropy_grad.py, embedding_grad.py) rewrite: a code
# generator's decomposition table must leave them whole for the passes to find them.
BACKWARD_PASS_OPS = (aten.nll_loss_backward.default, aten._log_softmax_backward_data.default,
                     aten.embedding_dense_backward.default)


# ------------------------------------------------------------------------- dynamo entry points
_around_classes: Dict[type, type] = {}


def _run_around_compile(converter: Any, around: Callable[[], ContextManager[Any]]) -> None:
    """Make dynamo's frame converter enter ``around()`` whenever it converts a frame (a cache miss),
    never on a hit. Settings that matter only while dynamo analyses a frame (its config, fxtrain's
    PythonOp routing) are applied there instead of around every call (~10 config writes per step).

    The converter's class is swapped for a subclass: the eval-frame C++ code reads these objects
    and crashed on a look-alike wrapper."""
    base = type(converter)
    cls = _around_classes.get(base)
    if cls is None:
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self._fxtrain_around():
                return base.__call__(self, *args, **kwargs)
        cls = _around_classes[base] = type(f"FxtrainAround{base.__name__}", (base,), {"__call__": __call__})
    converter.__class__ = cls
    converter._fxtrain_around = around


def dynamo_compile(fn: Callable[..., Any], backend: Callable[..., Any], dynamic: Optional[bool], fullgraph: bool,
                   around_compile: Callable[[], ContextManager[Any]]) -> Callable[..., Any]:
    """``torch.compile(fn, backend=backend, ...)`` whose compilations run inside ``around_compile()``.

    Needs: ``torch._dynamo.optimize`` returning a context whose ``callback`` (a CatchErrorsWrapper)
    the eval-frame code calls only for a frame without a usable cache entry, and which converts it
    itself or, under DistributedDataParallel, through a converter it builds on the spot (so the
    wrapper, not the converter it holds, is where every compilation passes).
    """
    ctx = torch._dynamo.optimize(backend=backend, nopython=fullgraph, dynamic=dynamic)
    _run_around_compile(ctx.callback, around_compile)
    return ctx(fn)


def dynamo_config_patch(settings: Dict[str, Any]) -> ContextManager[Any]:
    return torch._dynamo.config.patch(settings)


# ------------------------------------------------------------------------------- AOTAutograd
def default_partition(joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
    from torch._functorch.partitioners import default_partition as partition
    return partition(joint, joint_inputs, **kwargs)


def min_cut_partition(joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
    from torch._functorch.partitioners import min_cut_rematerialization_partition as partition
    return partition(joint, joint_inputs, **kwargs)


def aot_autograd(**kwargs: Any) -> Callable[..., Any]:
    """AOTAutograd as a dynamo backend (fw_compiler, bw_compiler, partition_fn, decompositions...)."""
    from torch._dynamo.backends.common import aot_autograd as aot
    return aot(**kwargs)


def aot_metadata() -> Any:
    """AOTAutograd's ViewAndMutationMeta of the graph being compiled (read inside fw_compiler)."""
    from torch._guards import TracingContext
    context = TracingContext.try_get()
    return context.fw_metadata if context is not None else None


def current_graph_task_keeps_graph() -> bool:
    """Whether the running backward was called with ``retain_graph=True``."""
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


def release_saved_tensors(ctx: Any) -> None:
    """Drop an autograd.Function node's saved tensors now, not when its backward returns, so the
    backward graph can free each one after its last use (as eager's engine frees per node)."""
    if not current_graph_task_keeps_graph():
        ctx.maybe_clear_saved_tensors()


# ---------------------------------------------------------------------------------- graphs
def boxed_copy(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``graph`` whose ``forward`` takes one list and clears it (``_BoxedCodeGen``).

    With the list cleared, the generated code holds the only reference to each input and drops it
    after its last use (FX emits ``x = None`` there): a backward frees every saved activation as soon
    as it has been read. The original graph (dumped, cached) keeps the ordinary calling convention.
    """
    from torch.fx.graph import _BoxedCodeGen
    copy = torch.fx.Graph()
    out = copy.graph_copy(graph.graph, {})
    copy.output(out)
    copy.set_codegen(_BoxedCodeGen())
    return torch.fx.GraphModule(graph, copy)


# ---------------------------------------------------------------------------------- inductor
def inductor_compile(graph: torch.fx.GraphModule, example_inputs: Sequence[Any], *, is_backward: bool,
                     is_inference: bool) -> Callable[[List[Any]], Any]:
    """Inductor's compiler for one aten graph (what its own AOTAutograd compilers call).

    Needs: ``compile_fx_inner(gm, example_inputs, is_backward=..., is_inference=...)`` returning a
    boxed callable; it looks the graph up in inductor's on-disk FX graph cache first.
    """
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor import config
    _inductor_runs_backward_pass_ops()
    # fxtrain compiles the forward and the backward apart, each against AOTAutograd's fake values:
    # the forward must hand the backward its saved tensors with those strides, which inductor's
    # layout optimisation (channels-last convolutions) would change.
    with config.patch(layout_optimization=False):
        return compile_fx_inner(graph, list(example_inputs), is_backward=is_backward, is_inference=is_inference)


_fallbacks_made = False


def _inductor_runs_backward_pass_ops() -> None:
    """Ops kept whole for the backward passes but left in a graph (the pass did not fire) run as
    aten kernels inside inductor's code. Inductor lowers only ops it has no decomposition for, so
    those with one need a fallback of their own (registered once; torch's own compiles decompose
    these ops before lowering and never meet it)."""
    global _fallbacks_made
    if _fallbacks_made:
        return
    from torch._inductor import lowering
    for op in BACKWARD_PASS_OPS:
        if op not in lowering.lowerings:
            lowering.make_fallback(op, override_decomp=True)
    _fallbacks_made = True


def inductor_decompositions(keep: Iterable[Any] = ()) -> Dict[Any, Callable[..., Any]]:
    from torch._inductor.decomposition import select_decomp_table
    kept = set(keep)
    return {op: fn for op, fn in select_decomp_table().items() if op not in kept}


def placeholder_examples(graph: torch.fx.GraphModule) -> List[Any]:
    """Fake values of a graph's inputs as AOTAutograd left them on the placeholders ("val")."""
    return [n.meta.get("val") for n in graph.graph.nodes if n.op == "placeholder"]
