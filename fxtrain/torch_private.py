"""Every private torch API fxtrain leans on, in one place.

Checked on torch ``CHECKED_ON``. Each function or constant says what it needs from torch in words,
so that a torch upgrade is one file to read: if a name moved, fix it here (tests/test_torch_private.py
calls each accessor, and checks that no other module under fxtrain/ names a private torch API).
Modules whose logic is about a torch internal by nature (capture/, pythonop/route.py,
capture/recipe.py, cost/tracker.py) keep that logic, but reach the internals through this module.

Names exported as plain aliases (``FakeTensor``, ``tree_flatten``, the dispatch-key helpers) sit in
modules ``import torch`` loads anyway; anything heavier (dynamo, inductor, the graph pickler) is
imported inside the function that needs it, so importing this module costs nothing extra.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import json
import logging
import re
import sys
import threading
import warnings

from typing import Any, Callable, ContextManager, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode, unset_fake_temporarily)
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import Error, FxtrainWarning

# ------------------------------------------------------------------------------ the torch window
# The releases fxtrain is tested on, oldest and newest: `.ci/run` runs the suite on both ends
# (constraints/torch-*.txt). Every difference between releases is a branch on ``torch_at_least``
# in this module, and nowhere else (tests/test_torch_private.py checks both).
WINDOW = ((2, 11), (2, 14))
TESTED = ("2.11.0", "2.14.1")


def parse_version(text: str) -> Tuple[int, int, int]:
    """(major, minor, patch) of a torch version string. Local and pre-release tags count as the
    release they lead to: ``2.11.0a0+git1234`` (a source build) and ``2.15.0.dev20260101`` (a
    nightly) are 2.11.0 and 2.15.0, ``2.14.1+cu130`` is 2.14.1."""
    match = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        raise Error(f"cannot read torch's version {text!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


TORCH_VERSION_TEXT = torch.__version__          # as torch spells it: recorded in cache headers, bench JSON
TORCH_VERSION = parse_version(TORCH_VERSION_TEXT)


def torch_at_least(major: int, minor: int, patch: int = 0) -> bool:
    """Whether the running torch is this release or newer (its nightlies and source builds too)."""
    return TORCH_VERSION >= (major, minor, patch)


_warned: set = set()


def check_supported(version: Optional[str] = None) -> None:
    """Raise :class:`Error` for a torch older than the window; warn once per version for a newer
    one (it may well work, and runs, but nobody has tested that release). ``import fxtrain`` never
    calls this, so an environment with another torch can still import it (TrainModule does)."""
    text = TORCH_VERSION_TEXT if version is None else version
    release = parse_version(text)[:2]
    window = f"{TESTED[0]} to {TESTED[1]}"
    if release < WINDOW[0]:
        raise Error(f"fxtrain needs torch {WINDOW[0][0]}.{WINDOW[0][1]} or newer (tested on {window}); "
                    f"this is torch {text}: pip install 'torch>={TESTED[0]}'")
    if release > WINDOW[1] and text not in _warned:
        _warned.add(text)
        warnings.warn(f"fxtrain is tested on torch {window}; this is torch {text}. It runs, but "
                      "report anything that differs from eager PyTorch.", FxtrainWarning, stacklevel=3)


CHECKED_ON = TESTED

aten = torch.ops.aten
# Ops fxtrain's backward passes (passes/cross_entropy_grad.py, embedding_grad.py) rewrite: a code
# generator's decomposition table must leave them whole for the passes to find them.
BACKWARD_PASS_OPS = (aten.nll_loss_backward.default, aten._log_softmax_backward_data.default,
                     aten.embedding_dense_backward.default)


# ------------------------------------------------------------------------- dynamo entry points
_around_classes: Dict[type, type] = {}


def _run_around_compile(converter: Any, around: Callable[[Optional[str]], ContextManager[Any]]) -> None:
    """Make dynamo's frame converter enter ``around(code_name)`` whenever it converts a frame (a cache
    miss), never on a hit; ``code_name`` is the converted frame's (None if dynamo did not pass it).
    Settings that matter only while dynamo analyses a frame (its config, fxtrain's PythonOp routing)
    are applied there instead of around every call (~10 config writes per step).

    The converter's class is swapped for a subclass: the eval-frame C++ code reads these objects
    and crashed on a look-alike wrapper."""
    base = type(converter)
    cls = _around_classes.get(base)
    if cls is None:
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            code = getattr(args[0], "f_code", None) if args else None   # the frame being converted
            with self._fxtrain_around(getattr(code, "co_name", None)):
                return base.__call__(self, *args, **kwargs)
        cls = _around_classes[base] = type(f"FxtrainAround{base.__name__}", (base,), {"__call__": __call__})
    converter.__class__ = cls
    converter._fxtrain_around = around


def dynamo_compile(fn: Callable[..., Any], backend: Callable[..., Any], dynamic: Optional[bool], fullgraph: bool,
                   around_compile: Callable[[Optional[str]], ContextManager[Any]]) -> Callable[..., Any]:
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
    """Dynamo's config set to ``settings`` within the block (``torch._dynamo.config.patch(dict)``).

    2.13 and later: the patch alone. Before 2.13 (checked on 2.11): with ``ignore_logging_functions``
    set, also :func:`_drop_config_dump_errors` for the block. Its compilation metrics dump dynamo's config
    at the end of every frame's compile (``_get_dynamo_config_for_logging``), sorting each set in
    it; its blocklist names the alias ``ignore_logger_methods`` rather than the set itself, so
    the dump sorts functions and raises a TypeError, which torch catches and logs with its
    traceback (2.13 blocklists ``ignore_logging_functions``). Only torch's own metrics record of
    that compile is lost.

    Before 2.12 (checked on 2.11) also :func:`_user_errors_unfiled` for the block: dynamo's
    ``UserError`` (a data-dependent branch dynamo cannot guard on: "Consider annotating your code
    using torch._check*()") was an ``Unsupported`` and filed its message in dynamo's break counters
    (:func:`dynamo_counters`), once for each frame that met it, beside the "Data-dependent
    branching" break it turns into. 2.12 made it a plain ``TorchDynamoException`` that files nothing,
    and fxtrain counts a call's breaks from those counters (capture/breaks.py): one break read as
    three."""
    patch = torch._dynamo.config.patch(settings)
    if not torch_at_least(2, 12):
        patch = _user_errors_unfiled(patch)
    if torch_at_least(2, 13) or not settings.get("ignore_logging_functions"):
        return patch
    return _drop_config_dump_errors(patch)


class _Unfiled(threading.local):
    depth = 0


_unfiled = _Unfiled()
_unfiled_lock = threading.Lock()


@contextlib.contextmanager
def _user_errors_unfiled(inner: ContextManager[Any]) -> Iterator[None]:
    """``inner``, and within it (on this thread) a ``torch._dynamo.exc.UserError`` raised files
    nothing in dynamo's counters, as from 2.12 on (torch 2.11 only). Its ``add_to_stats`` and
    ``remove_from_stats`` (inherited from ``Unsupported``: ``counters[category][msg]`` plus or
    minus one) are replaced once, by versions that keep the category it would sit in but count
    only for an error made outside such a block, so that one made before the block and moved
    within it (or the other way round) stays balanced."""
    from torch._dynamo.exc import Unsupported, UserError
    with _unfiled_lock:
        if "_fxtrain_unfiled" not in UserError.__dict__:
            def add_to_stats(self: Any, category: str = "unimplemented") -> None:
                if "_fxtrain_unfiled" not in self.__dict__:   # the first filing, from __init__
                    self._fxtrain_unfiled = _unfiled.depth > 0
                if self._fxtrain_unfiled:
                    self.category = category
                else:
                    Unsupported.add_to_stats(self, category)

            def remove_from_stats(self: Any) -> None:
                if not self.__dict__.get("_fxtrain_unfiled", False):
                    Unsupported.remove_from_stats(self)

            UserError.add_to_stats = add_to_stats
            UserError.remove_from_stats = remove_from_stats
            UserError._fxtrain_unfiled = True
    _unfiled.depth += 1
    try:
        with inner:
            yield
    finally:
        _unfiled.depth -= 1


class _ConfigDumpErrorFilter(logging.Filter):
    """Drops the record of an error raised while dynamo dumps its config for its metrics."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        tb = error.__traceback__ if error is not None else None
        while tb is not None:
            if tb.tb_frame.f_code.co_name == "_get_dynamo_config_for_logging":
                return False
            tb = tb.tb_next
        return True


@contextlib.contextmanager
def _drop_config_dump_errors(inner: ContextManager[Any]) -> Iterator[None]:
    """``inner``, and within it no record of 2.11's failing config dump from the logger that
    reports it (``torch._dynamo.metrics_context``: "Unexpected exception logging compilation
    metrics"). Not only noise: the record's traceback holds the compiling call's frames, and a
    handler that keeps records (pytest's) would keep that call's outputs and their autograd graph
    alive."""
    logger = logging.getLogger("torch._dynamo.metrics_context")
    drop = _ConfigDumpErrorFilter()
    logger.addFilter(drop)
    try:
        with inner:
            yield
    finally:
        logger.removeFilter(drop)


@contextlib.contextmanager
def dims_static(marks: Sequence[Tuple[torch.Tensor, Sequence[int]]]) -> Iterator[None]:
    """Dynamo keeps the listed dimensions of these tensors static while the block compiles, even under
    ``dynamic=True`` (``torch._dynamo.mark_static``, whose ``_dynamo_static_indices`` this sets and
    then takes back, so the user's tensors carry no mark afterwards).

    Why taking the mark back is safe: dynamo guards a marked dimension attribute only as "absent, or
    a subset of the marks compiled with", so later calls with unmarked tensors still hit the graph."""
    saved = []
    for tensor, dims in marks:
        had = tensor.__dict__.get("_dynamo_static_indices")
        saved.append((tensor, had, tensor.__dict__.get("_has_dynamo_dim_marking")))
        tensor._dynamo_static_indices = set(had or ()) | set(dims)
        tensor._has_dynamo_dim_marking = True
    try:
        yield
    finally:
        for tensor, had, flag in saved:
            for attr, old in (("_dynamo_static_indices", had), ("_has_dynamo_dim_marking", flag)):
                if old is None:
                    tensor.__dict__.pop(attr, None)
                else:
                    setattr(tensor, attr, old)


# ------------------------------------------------------------------------------- AOTAutograd
def default_partition(joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """AOTAutograd's default joint-graph partitioner (``torch._functorch.partitioners.default_partition``)."""
    from torch._functorch.partitioners import default_partition as partition
    return partition(joint, joint_inputs, **kwargs)


def min_cut_partition(joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """AOTAutograd's min-cut rematerialising partitioner (``min_cut_rematerialization_partition``)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition as partition
    return partition(joint, joint_inputs, **kwargs)


def inductor_partition(joint: torch.fx.GraphModule, joint_inputs: Sequence[Any],
                       before_cut: Optional[Callable[[torch.fx.GraphModule], None]] = None, **kwargs: Any) -> Any:
    """The partition torch.compile makes for inductor (``compile_fx.partition_fn``): inductor's
    joint-graph passes (no-op and pointless-view removal, pattern rewrites) then the min-cut
    partitioner, so fxtrain's inductor executor compiles the graphs torch.compile would.
    ``before_cut`` sees the joint graph as the cut does, after those passes (which rewrite it)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import partition_fn

    def cut(gm: torch.fx.GraphModule, inputs: Sequence[Any], **kw: Any) -> Any:
        if before_cut is not None:
            # The min-cut partitioner first drops dead code and merges duplicate ops (CSE), and
            # names its saved values in that graph: do the same here so ``before_cut`` sees it
            # (both are idempotent, so the partitioner's own run changes nothing more).
            from torch._functorch import config as functorch_config
            from torch._functorch.compile_utils import fx_graph_cse
            gm.graph.eliminate_dead_code()
            if functorch_config.cse:
                gm.graph = fx_graph_cse(gm.graph)
            gm.recompile()
            before_cut(gm)
        return min_cut_rematerialization_partition(gm, inputs, **kw)
    # Inductor's joint-graph passes read the fake mode from its virtualized context (random ops
    # become its seed ops there), which torch.compile sets around the whole AOTAutograd call.
    from torch._guards import detect_fake_mode
    from torch._inductor.virtualized import V
    fake_mode = detect_fake_mode(joint_inputs)
    with V.set_fake_mode(fake_mode) if fake_mode is not None else contextlib.nullcontext():
        if torch_at_least(2, 13):
            return partition_fn(joint, joint_inputs, partitioner_fn_override=cut, **kwargs)
        # 2.11 and 2.12: ``partition_fn`` takes no override, so take its steps here: the joint-graph
        # passes on the joint's device, then the cut, as 2.13's ``partition_fn`` does with one.
        from torch._inductor import compile_fx
        with compile_fx.get_cuda_device_context(joint):
            device = next(iter(compile_fx.get_inputs_devices(joint_inputs, joint)))
            joint = compile_fx._recursive_joint_graph_passes(joint, skip_invoke_subgraph=True, input_device=device)
        return cut(joint, joint_inputs, **kwargs)


def partition_saving(joint: torch.fx.GraphModule, saved: Sequence[torch.fx.Node],
                     saved_sizes: Sequence[torch.fx.Node], *, num_fwd_outputs: int,
                     static_lifetime_input_indices: Optional[Sequence[int]] = None) -> Any:
    """The forward and backward graphs of ``joint`` when the forward saves exactly ``saved`` (tensor
    nodes) and ``saved_sizes`` (SymInt nodes): whatever else the backward reads of the forward, it
    recomputes from those and the primals among ``saved``. Finished as ``default_partition`` finishes
    its own choice: ``_extract_fwd_bwd_modules``, dead code removed (collectives kept),
    ``reordering_to_mimic_autograd_engine`` (each recomputed op moved to just before its first use in
    the backward, not all at its start), ``raise_getitems``. Does not modify ``joint``.
    """
    from torch._functorch.compile_utils import raise_getitems
    from torch._functorch.partitioners import (_extract_fwd_bwd_modules, is_not_collective,
                                               reordering_to_mimic_autograd_engine)
    from torch.utils._ordered_set import OrderedSet
    primals = [n for n in joint.graph.nodes if n.op == "placeholder" and "tangents" not in str(n.target)]
    static = OrderedSet(p for i, p in enumerate(primals) if i in set(static_lifetime_input_indices or ()))
    fw, bw = _extract_fwd_bwd_modules(joint, list(saved), saved_sym_nodes=list(saved_sizes),
                                      num_fwd_outputs=num_fwd_outputs, static_lifetime_input_nodes=static)
    fw.graph.eliminate_dead_code(is_impure_node=is_not_collective)
    bw.graph.eliminate_dead_code(is_impure_node=is_not_collective)
    bw = reordering_to_mimic_autograd_engine(bw)
    return raise_getitems(fw), raise_getitems(bw)


def is_size_node(node: torch.fx.Node) -> bool:
    """Whether an FX node computes a SymInt/SymFloat/SymBool (``proxy_tensor.is_sym_node``)."""
    from torch.fx.experimental.proxy_tensor import is_sym_node
    return bool(is_sym_node(node))


def draws_random_numbers(node: torch.fx.Node) -> bool:
    """Whether an aten node is tagged random (``Tag.nondeterministic_seeded``) and does draw: not an
    op random only for its dropout (attention kernels, ``native_dropout``) called with probability 0.
    Reads the op's ``_schema`` for the dropout argument."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name in ("dropout_p", "p"):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
            return not (isinstance(value, (int, float)) and float(value) == 0.0)
    return True


def dynamo_skip_frames(fn: Any) -> Any:
    """``fn`` with dynamo's frame converter leaving its own frames alone while still converting the
    frames it calls (``torch._dynamo.decorators.skip``: the code is marked to be skipped)."""
    from torch._dynamo.decorators import skip
    return skip(fn)


@contextlib.contextmanager
def outside_compile() -> Any:
    """``torch.compiler.is_compiling()`` false within the block (``torch.compiler._is_compiling_flag``).

    Dynamo holds the flag true for a whole compile, backend included; code that a backend runs for
    real (a memory budget costing a step on fake tensors) must take the paths it takes at run time:
    the optimizers stack their scalars into tensors when they think they are being compiled."""
    import torch.compiler as compiler
    old = compiler._is_compiling_flag
    compiler._is_compiling_flag = False
    try:
        yield
    finally:
        compiler._is_compiling_flag = old


def size_hint(size: Any, overrides: Optional[Dict[Any, int]] = None, fallback: int = 1) -> int:
    """A concrete value for a size that may be symbolic, without adding a guard: the capturing
    call's value (``symbolic_shapes.optimization_hint``), or the expression evaluated with some of
    its symbols set by ``overrides`` (sympy symbol -> int) and the rest at their hints
    (``ShapeEnv.backed_var_to_val``, 2.11 and later)."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    if not overrides:
        # 2.12 named it ``optimization_hint``; 2.11 has only ``hint_int``, which 2.14 removed.
        from torch.fx.experimental import symbolic_shapes
        hint = symbolic_shapes.optimization_hint if torch_at_least(2, 12) else symbolic_shapes.hint_int
        return int(hint(size, fallback=fallback))
    expr = size.node.expr
    known = size.node.shape_env.backed_var_to_val
    values = {s: overrides[s] if s in overrides else known.get(s, fallback) for s in expr.free_symbols}
    return int(expr.xreplace(values))


def output_needs_tangent(info: Any) -> bool:
    """Whether AOTAutograd's backward takes a tangent for this forward output (``OutputAliasInfo``:
    ``requires_grad_for_backward`` since 2.12, ``requires_grad`` in 2.11)."""
    return bool(info.requires_grad_for_backward if torch_at_least(2, 12) else info.requires_grad)


def size_expr(size: Any) -> Any:
    """The sympy expression of a symbolic size (``SymInt.node.expr``)."""
    return size.node.expr


def size_symbol(size: Any) -> Any:
    """The sympy symbol a size is, or None (a constant or a compound expression)."""
    if isinstance(size, torch.SymInt):
        import sympy
        expr = size.node.expr
        return expr if isinstance(expr, sympy.Symbol) else None
    return None


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


def foreach_kernel_devices() -> List[str]:
    """The device types whose optimizers default to the multi-tensor (foreach) step: what
    ``torch.optim``'s default (``_default_to_fused_or_foreach``) asks of real parameters' devices."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices
    return list(_get_foreach_kernels_supported_devices())


def foreach_copy(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``destinations[i].copy_(sources[i])`` for every ``i``, as one dispatched op
    (``torch._foreach_copy_``, in every release of the window): on CUDA a few multi-tensor kernels
    instead of a copy kernel per tensor, and on any device one call from Python instead of one per
    tensor (runtime/deferred.py copies every parameter of a model ahead of an optimizer step)."""
    if destinations:   # torch refuses an empty list
        torch._foreach_copy_(list(destinations), list(sources))


def release_saved_tensors(ctx: Any) -> None:
    """Drop an autograd.Function node's saved tensors now, not when its backward returns, so the
    backward graph can free each one after its last use (as eager's engine frees per node)."""
    if not current_graph_task_keeps_graph():
        ctx.maybe_clear_saved_tensors()


# ---------------------------------------------------------------------------------- graphs
def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A deep copy of ``graph``: its nodes (as ``copy.deepcopy`` copies them) and its code generator.

    Not ``copy.deepcopy(graph)``: torch 2.13 deprecates ``LeafSpec`` and warns whenever one is built,
    and ``Graph.__deepcopy__`` deep-copies the code generator with a fresh memo, building a new leaf
    spec for every leaf of a ``_PyTreeCodeGen``'s specs (AOTAutograd's joint graph has them): the user
    would see torch's FutureWarning about torch's own objects. Leaf specs are immutable and torch keeps
    one for itself (``tree_flatten`` of a leaf returns it): the copy shares it. No warning filter: the
    filters are process-wide, and fxtrain copies graphs on more than one thread."""
    leaf = pytree.tree_flatten(0)[1]
    new = torch.fx.Graph(tracer_cls=graph._tracer_cls)
    out, old_output = new.graph_copy(graph, {}, return_output_node=True)
    new.output(out, type_expr=getattr(old_output, "type", None)).meta = dict(old_output.meta)
    new.set_codegen(copy.deepcopy(graph._codegen, {id(leaf): leaf}))
    return new


def boxed_copy(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``graph`` whose ``forward`` takes one list and clears it (``_BoxedCodeGen``).

    With the list cleared, the generated code holds the only reference to each input and drops it
    after its last use (FX emits ``x = None`` there): a backward frees every saved activation as soon
    as it has been read. The original graph (dumped, cached) keeps the ordinary calling convention.
    """
    from torch.fx.graph import _BoxedCodeGen
    boxed = torch.fx.Graph()
    out = boxed.graph_copy(graph.graph, {})
    boxed.output(out)
    boxed.set_codegen(_BoxedCodeGen())
    return torch.fx.GraphModule(graph, boxed)


# ---------------------------------------------------------------------------------- inductor
class NotInInductorCache(Error):
    """``inductor_compile(cached_only=True)`` found no entry for the graph in inductor's FX graph cache."""


def inductor_compile(graph: torch.fx.GraphModule, example_inputs: Sequence[Any], *, is_backward: bool,
                     is_inference: bool, cached_only: bool = False) -> Callable[[List[Any]], Any]:
    """Inductor's compiler for one aten graph (what its own AOTAutograd compilers call).

    Needs: ``compile_fx_inner(gm, example_inputs, is_backward=..., is_inference=...)`` returning a
    boxed callable; it looks the graph up in inductor's on-disk FX graph cache first.
    ``cached_only``: raise NotInInductorCache instead of generating code on a miss (a graph inductor
    generates no code for, one without calls, is never a miss). A miss
    generates code under ``preserve_rng_state``, which puts the global generator back as it was when
    the compile began: off the main thread that would rewind the random numbers the training loop
    drew meanwhile (runtime/tiered.py loads graphs a worker compiled, on a thread, hits only).
    Needs: ``FxGraphCache.prepare_key(gm, inputs, fx_kwargs, inputs_to_check, remote)`` with the
    keyword defaults compile_fx_inner fills in, and ``FxGraphCache._get_tmp_dir_for_key``.
    """
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor import config
    _inductor_runs_backward_pass_ops()
    # fxtrain compiles the forward and the backward apart, each against AOTAutograd's fake values:
    # the forward must hand the backward its saved tensors with those strides, which inductor's
    # layout optimisation (channels-last convolutions) would change.
    # Inductor's own graph cache keys and guards its entries through the tracing context's shape
    # environment and bypasses itself without one: a graph loaded from fxtrain's cache (compiled
    # outside any capture) gets a context around the fake mode of its placeholders' values.
    context: ContextManager[Any] = contextlib.nullcontext()
    if torch._guards.TracingContext.try_get() is None:
        fake_mode = torch._guards.detect_fake_mode(list(example_inputs))
        if fake_mode is not None:
            context = torch._guards.tracing(torch._guards.TracingContext(fake_mode))
    with context, config.patch(layout_optimization=False):
        if (cached_only and _generates_code(graph)
                and not _in_inductor_cache(graph, list(example_inputs), is_backward, is_inference)):
            raise NotInInductorCache("inductor's FX graph cache has no entry for this graph")
        return compile_fx_inner(graph, list(example_inputs), is_backward=is_backward, is_inference=is_inference)


def _generates_code(graph: torch.fx.GraphModule) -> bool:
    """Whether inductor generates code for ``graph``, and so keeps it in its FX graph cache.
    Needs: ``compile_fx_inner`` returns a graph without calls as it is (``count_calls(gm.graph) == 0``,
    unless functorch's ``bundled_autograd_cache``), with no cache entry. The compiled tier met one: an
    inference graph of HF RoBERTa's after a graph break, returning nothing; its load, refused as a
    cache miss, kept the capture on the eager executor with "the background compile failed"."""
    from torch._dynamo.utils import count_calls
    return count_calls(graph.graph) > 0 or bool(torch._functorch.config.bundled_autograd_cache)


def _in_inductor_cache(graph: torch.fx.GraphModule, inputs: List[Any], is_backward: bool, is_inference: bool) -> bool:
    import os
    from torch._inductor import config
    from torch._inductor.codecache import FxGraphCache
    from torch._inductor.compile_fx import get_input_idxs_to_check
    from torch._inductor.utils import BoxedBool
    if config.force_disable_caches or not config.fx_graph_cache:
        return False
    kwargs: Dict[str, Any] = dict(cudagraphs=BoxedBool(config.triton.cudagraphs), static_input_idxs=(),
                                  is_backward=is_backward, graph_id=None, cpp_wrapper=False, fx_wrapper=False,
                                  is_inference=is_inference, boxed_forward_device_index=None, layout_opt=None,
                                  extern_node_serializer=None)
    with torch.utils._python_dispatch._disable_current_modes():
        key_info, _ = FxGraphCache.prepare_key(graph, inputs, kwargs, get_input_idxs_to_check(inputs, ()), False)
    return key_info is not None and os.path.isdir(FxGraphCache._get_tmp_dir_for_key(key_info[0]))


def dynamo_compile_lock() -> ContextManager[Any]:
    """The lock dynamo holds while it converts a frame (``convert_frame.compile_lock``, an RLock):
    a thread that compiles with inductor takes it, so that no capture runs beside it."""
    from torch._dynamo.convert_frame import compile_lock
    return compile_lock


def retrace(graph: torch.fx.GraphModule, decompositions: Dict[Any, Callable[..., Any]],
            examples: Optional[Sequence[Any]] = None) -> torch.fx.GraphModule:
    """``graph`` traced again on fake values (its placeholders' unless given) with ``decompositions``
    applied (``make_fx``), placeholders keeping their names (the backward finds its tangents by name)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    examples = placeholder_examples(graph) if examples is None else list(examples)
    fake_mode = detect_fake_mode(examples)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        new = make_fx(torch.fx.Interpreter(graph).run, decomposition_table=decompositions)(*examples)
    names = [n.name for n in graph.graph.nodes if n.op == "placeholder"]
    for node, name in zip([n for n in new.graph.nodes if n.op == "placeholder"], names):
        node._rename(name)
        node.target = name
    new.recompile()
    return new


def decompose_calls(graph: torch.fx.GraphModule, ops: Iterable[Any],
                    decompositions: Dict[Any, Callable[..., Any]]) -> int:
    """Each call in ``graph`` of an op in ``ops`` replaced, in place, by its decomposition from
    ``decompositions``, traced (``make_fx``) on the call's own fake input values and spliced in;
    every other node stays as it is, its metadata included (a whole-graph ``retrace`` would rebuild
    them all). Left whole: a call whose inputs carry no fake value, whose trace would need a
    constant, or whose decomposition asks a question of a size only the batch knows (an unbacked
    row count of the sparsity passes: the accumulating scatter ``embedding_dense_backward``
    decomposes to checks ``numel() == 0`` on torch 2.13 and 2.14, not on 2.11, and fake tensors run
    that decomposition too). Needs:
    ``GuardOnDataDependentSymNode``, what the shape environment raises there. Returns how many
    were replaced."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    wanted = {op for op in ops if op in decompositions}
    replaced = 0
    for node in list(graph.graph.nodes):
        if node.op != "call_function" or node.target not in wanted:
            continue
        inputs = node.all_input_nodes
        examples = [n.meta.get("val") for n in inputs]
        if any(e is None for e in examples):
            continue

        def call(*values: Any, node: torch.fx.Node = node, inputs: List[torch.fx.Node] = inputs) -> Any:
            env = dict(zip(inputs, values))
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            return decompositions[node.target](*args, **kwargs)
        fake_mode = detect_fake_mode(examples)
        try:
            with fake_mode if fake_mode is not None else contextlib.nullcontext():
                sub = make_fx(call, decomposition_table=decompositions)(*examples)
        except GuardOnDataDependentSymNode as e:
            logging.getLogger("fxtrain").debug("%s left whole: %s", node.format_node(), str(e).splitlines()[0])
            continue
        result = next(n for n in sub.graph.nodes if n.op == "output").args[0]
        if any(n.op == "get_attr" for n in sub.graph.nodes) or not isinstance(result, torch.fx.Node):
            continue
        env: Dict[torch.fx.Node, torch.fx.Node] = {}
        places = iter(inputs)
        with graph.graph.inserting_before(node):
            for n in sub.graph.nodes:
                if n.op == "placeholder":
                    env[n] = next(places)
                elif n.op != "output":
                    env[n] = graph.graph.node_copy(n, env.__getitem__)
        node.replace_all_uses_with(env[result])
        graph.graph.erase_node(node)
        replaced += 1
    if replaced:
        graph.graph.lint()
        graph.recompile()
    return replaced


_fallbacks_made = False


def _inductor_runs_backward_pass_ops() -> None:
    """Ops kept whole for the backward passes that are still in a graph (no pass rewrote them and
    ``decompose_calls`` could not decompose them) run as aten kernels inside inductor's code.
    Inductor lowers only ops it has no decomposition for, so those with one need a fallback of
    their own (registered once; torch's own compiles decompose these ops before lowering and never
    meet it)."""
    global _fallbacks_made
    if _fallbacks_made:
        return
    from torch._inductor import lowering
    for op in BACKWARD_PASS_OPS:
        if op not in lowering.lowerings:
            lowering.make_fallback(op, override_decomp=True)
    _fallbacks_made = True


def inductor_decompositions(keep: Iterable[Any] = ()) -> Dict[Any, Callable[..., Any]]:
    """Inductor's decomposition table (``select_decomp_table()``) less the ops in ``keep``."""
    from torch._inductor.decomposition import select_decomp_table
    kept = set(keep)
    return {op: fn for op, fn in select_decomp_table().items() if op not in kept}


def inductor_eager_random() -> ContextManager[Any]:
    """Inductor with ``config.fallback_random``: its random ops run as the aten kernels eager runs
    (the same generator, the same numbers for the same draws in the same order) instead of its own
    Philox code, and ``select_decomp_table()`` then leaves ``native_dropout`` whole. The flag is part
    of inductor's cache key: a compile and its cached load must both be inside."""
    from torch._inductor import config
    return config.patch(fallback_random=True)


def placeholder_examples(graph: torch.fx.GraphModule) -> List[Any]:
    """Fake values of a graph's inputs as AOTAutograd left them on the placeholders ("val")."""
    return [n.meta.get("val") for n in graph.graph.nodes if n.op == "placeholder"]


# ----------------------------------------------------------------------- dynamo capture internals
def allow_in_graph(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Let dynamo put calls of ``fn`` in the graph as opaque nodes (``torch._dynamo.allow_in_graph``)."""
    import torch._dynamo
    return torch._dynamo.allow_in_graph(fn)


def dynamo_break_at(fn: Callable[..., Any]) -> bool:
    """Make dynamo break the graph at every call of ``fn`` (an op as dynamo's graph calls it), as
    ``torch._dynamo.disallow_in_graph`` does, but undoably: its id joins
    ``torch._dynamo.trace_rules._disallowed_callable_ids``, which dynamo reads on each lookup
    (``lookup_callable``: a disallowed callable is a skipped function). False where it was there."""
    from torch._dynamo import trace_rules
    if id(fn) in trace_rules._disallowed_callable_ids:
        return False
    trace_rules._disallowed_callable_ids.add(id(fn))
    return True


def dynamo_unbreak_at(fn: Callable[..., Any]) -> None:
    """Undo :func:`dynamo_break_at`."""
    from torch._dynamo import trace_rules
    trace_rules._disallowed_callable_ids.remove(id(fn))


@contextlib.contextmanager
def fake_trial(fake_mode: FakeTensorMode) -> Iterator[None]:
    """Run ops on a capture's fake tensors as a trial that leaves the trace to come nothing to
    account for: the unbacked sizes such ops make are not pending in the shape environment
    (``ShapeEnv.ignore_fresh_unbacked_symbols``), where AOTAutograd would look for them in its graph."""
    shape_env = getattr(fake_mode, "shape_env", None)
    with (shape_env.ignore_fresh_unbacked_symbols() if shape_env is not None else contextlib.nullcontext()):
        yield


# What fake tensors raise where an op's result depends on tensor values (``.tolist()``, ``nonzero``
# without a shape environment that allows it): dynamo meets these from a backend with a graph break.
DATA_DEPENDENT_ERRORS = (DataDependentOutputException, DynamicOutputShapeException)


def op_qualified_name(target: Any) -> Optional[str]:
    """'namespace::name' of an op as a graph calls it: an overload (aten graphs) or a packet
    (dynamo's graphs); None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def dynamo_unsupported() -> type:
    """The exception dynamo raises for code it cannot trace (``torch._dynamo.exc.Unsupported``)."""
    from torch._dynamo.exc import Unsupported
    return Unsupported


def dynamo_recompile_limit_error() -> type:
    """The exception dynamo raises when a frame hits its recompile limit under
    ``fail_on_recompile_limit_hit`` (``torch._dynamo.exc.FailOnRecompileLimitHit``)."""
    from torch._dynamo.exc import FailOnRecompileLimitHit
    return FailOnRecompileLimitHit


def current_instruction_translator() -> Any:
    """The InstructionTranslator converting a frame now (``InstructionTranslator.current_tx()``):
    raises (or returns None) outside dynamo's conversion. Callers read ``f_code`` and
    ``output.side_effects`` from it."""
    from torch._dynamo.symbolic_convert import InstructionTranslator
    return InstructionTranslator.current_tx()


def dynamo_new_object_mutation_types() -> tuple:
    """The mutation types dynamo gives objects created during the traced call
    (``torch._dynamo.variables.base.AttributeMutationNew``, ``ValueMutationNew``)."""
    from torch._dynamo.variables.base import AttributeMutationNew, ValueMutationNew
    return (AttributeMutationNew, ValueMutationNew)


def dynamo_traced_code() -> List[Any]:
    """The code objects dynamo inlined while converting the current frame
    (``torch._dynamo.utils.get_traced_code()``, None read as empty)."""
    from torch._dynamo.utils import get_traced_code
    return get_traced_code() or []


def dynamo_recompile_reason() -> Any:
    """The failed guard dynamo recorded for the compile in progress (``get_metrics_context()``'s
    private ``_metrics["recompile_reason"]``; None on a first compile). May raise if that moved."""
    from torch._dynamo.utils import get_metrics_context
    return get_metrics_context()._metrics.get("recompile_reason")


def dynamo_frame_counter() -> Callable[[], int]:
    """A reader of dynamo's count of frames it started converting (``torch._dynamo.utils.curr_frame``,
    bumped first thing by every conversion)."""
    import torch._dynamo.utils as utils
    return lambda: utils.curr_frame


def dynamo_counters() -> Dict[str, Dict[str, int]]:
    """Dynamo's process-global message counters (``torch._dynamo.utils.counters``: category ->
    message -> count; "graph_break" and "unimplemented" hold the break reasons)."""
    from torch._dynamo.utils import counters
    return counters


def autograd_function_variable() -> type:
    """Dynamo's variable for ``torch.autograd.Function`` classes, whose ``call_apply(self, tx, args,
    kwargs)`` handles ``.apply`` (``torch._dynamo.variables.misc.AutogradFunctionVariable``)."""
    from torch._dynamo.variables.misc import AutogradFunctionVariable
    return AutogradFunctionVariable


def install_id_match_guard(source: Any) -> None:
    """Guard the frame being converted on the identity of the object at ``source``
    (``install_guard(source.make_guard(GuardBuilder.ID_MATCH))``)."""
    from torch._dynamo.guards import GuardBuilder, install_guard
    install_guard(source.make_guard(GuardBuilder.ID_MATCH))


def resolve_source_value(tx: Any, source: Any) -> Any:
    """The object a dynamo ``Source`` names, read from the frame being converted.

    2.13 and later: ``OutputGraph.resolve_source_value(source)``. Before 2.13 (checked on 2.11, whose
    OutputGraph lacks that method): what it does, ``source.get_value({"G": f_globals, "L": f_locals}, {}, {})``
    on the root frame's translator (``Source.get_value`` evaluates the source's name there)."""
    if torch_at_least(2, 13):
        return tx.output.resolve_source_value(source)
    root = tx.output.root_tx
    return source.get_value({"G": root.f_globals, "L": root.f_locals}, {}, {})


def build_variable(tx: Any, value: Any) -> Any:
    """Dynamo's variable for a Python value met during conversion (``VariableTracker.build``)."""
    from torch._dynamo.variables import VariableTracker
    return VariableTracker.build(tx, value)


def wrap_graph_node(tx: Any, fn: Callable[..., Any], node: torch.fx.Node, *constants: Any) -> Any:
    """Dynamo's variable for ``fn(node, *constants)``, a new node of the graph it is building over ``node``, an
    existing node of it (``tx.output.create_proxy`` then ``variables.builder.wrap_fx_proxy``, which
    computes the new node's fake value). Dynamo makes variables only for values it traces itself;
    an argument it recorded into a node (a tensor subclass's constructor call) has none."""
    from torch._dynamo.variables.builder import wrap_fx_proxy
    proxy = tx.output.create_proxy("call_function", fn, (torch.fx.Proxy(node, tx.output.current_tracer), *constants),
                                    {})
    return wrap_fx_proxy(tx, proxy)


def setup_context_defined(fn_cls: type) -> bool:
    """Whether a Function is new-style (``forward`` without ctx, a ``setup_context`` static method):
    ``torch.autograd.function._is_setup_context_defined(fn_cls.setup_context)``."""
    from torch.autograd.function import _is_setup_context_defined
    return bool(_is_setup_context_defined(fn_cls.setup_context))


def symbolic_scalar_type(vt: Any) -> Optional[type]:
    """For dynamo's variable of a Python number it only knows symbolically (a size ``x.shape[0]``
    under dynamic shapes, a float argument that is a graph input), its Python type (int, float,
    bool); None for anything else. Those are ``SymNodeVariable`` and ``UnspecializedPythonVariable``
    (a 0-d tensor standing for the number, ``is_tensor()`` true)."""
    from torch._dynamo.variables.tensor import SymNodeVariable, UnspecializedPythonVariable
    if isinstance(vt, SymNodeVariable):
        kind = vt.python_type()
    elif isinstance(vt, UnspecializedPythonVariable):
        kind = type(vt.raw_value)
    else:
        return None
    return kind if kind in (bool, int, float) else None


def scalar_hint(vt: Any) -> Any:
    """The capturing call's value of a number ``symbolic_scalar_type`` accepts: the symbol's hint
    (``SymNodeVariable.sym_num``, ``node.hint``), an unspecialized number's ``raw_value``."""
    from torch._dynamo.variables.tensor import SymNodeVariable
    kind = symbolic_scalar_type(vt)
    if isinstance(vt, SymNodeVariable):
        num = vt.sym_num
        if isinstance(num, torch.SymInt):
            return size_hint(num)
        hint = num.node.hint if isinstance(num, (torch.SymFloat, torch.SymBool)) else num
        return kind(hint)
    return kind(vt.raw_value)


def sequence_items(vt: Any) -> Optional[List[Any]]:
    """The item variables of dynamo's variable of a plain list or tuple (``BaseListVariable.items``),
    else None (named tuples and other sequences included)."""
    from torch._dynamo.variables.lists import ListVariable, TupleVariable
    if type(vt) in (ListVariable, TupleVariable):
        return list(vt.items)
    return None


def dict_items(vt: Any) -> Optional[List[Any]]:
    """``[(key, value variable)]`` of dynamo's variable of a plain dict whose keys are Python
    constants (``ConstDictVariable.items``, keys wrapped in ``HashableTracker.vt``), else None."""
    from torch._dynamo.variables.dicts import ConstDictVariable
    if type(vt) is not ConstDictVariable or vt.python_type() is not dict:
        return None
    out = []
    for key, value in vt.items.items():
        if not key.vt.is_python_constant():
            return None
        out.append((key.vt.as_python_constant(), value))
    return out


def dynamo_restart_errors() -> tuple:
    """Exceptions that are dynamo's own control flow while converting a frame (restart the analysis,
    skip the frame), never a failure of the code being traced: ``RestartAnalysis``, ``SkipFrame``."""
    from torch._dynamo.exc import RestartAnalysis, SkipFrame
    return (RestartAnalysis, SkipFrame)


class SideEffectsOutside(Error):
    """A traced call changed objects that exist outside it (``speculate``)."""


def _speculation_source_target() -> Optional[str]:
    """What ``speculate`` names its subtracer after (``speculate_subgraph(source_target=...)``,
    which dynamo appends to the subgraph's ``source_fn_stack``; the subgraph is thrown away).

    2.13 and later: None (``SubgraphTracer`` then copies its parent's stack). Before 2.13 (checked
    on 2.11): a name, since its ``SubgraphTracer`` calls ``Graph._target_to_str(source_target)``,
    which asserts on None; and its ``OutputGraph.subtracer`` then pops the frame's root tracer in its
    ``finally`` (it never pushed the new one), hiding the assertion behind an ``IndexError``."""
    if torch_at_least(2, 13):
        return None
    return "fxtrain_shape_run"


def speculate(tx: Any, fn_vt: Any, args: Sequence[Any]) -> Any:
    """Trace ``fn_vt(*args)`` (dynamo variables) into a throwaway subgraph and return its output
    variable: nothing of it reaches the frame's graph, its side effects or its graph-break counts.

    ``speculate_subgraph(..., always_restore=True)`` (what dynamo uses to look at a backward it does
    not keep), in a subtracer of its own. Dynamo refuses (``Unsupported``) changes to objects the
    frame knew before the call; one the trace meets first counts as the subgraph's own, and dynamo
    would let it change and drop the change: that is a side effect all the same (a list outside
    that forward appends to), so it raises ``SideEffectsOutside``, read from the side effects the
    trace recorded (``SideEffects.id_to_variable``: a variable tracked during the trace, not new,
    ``is_modified``), which are then dropped (``track_runahead_tensor_and_symvar_side_effects``
    keeps what dynamo keeps of them). Dynamo's ``Unsupported`` counts itself in
    ``counters["unimplemented"]`` when raised, and nested attempts may file graph breaks: both
    counters are put back as they were, since the frame being converted did not break. The
    variables dynamo made for objects the trace read (``OutputGraph.variable_tracker_cache``) go
    too: the objects may have changed by the time the frame reads them (a Function dynamo refused
    is then run for real). ``capture_scalar_outputs`` is on so that ``.item()`` is a symbol rather
    than a refusal (and a logged warning). Raises whatever the trace raised, except dynamo's
    restarts, with the frame's side effects restored, and its guards (``tracing_context.
    guards_context`` checkpoint): a refused trace decides nothing, while the guards it installed (on
    fxtrain's own state, met in a TrainModule the forward calls) would recapture at every call.
    Grad mode and the rest of dynamo's global state (``tracing_context.global_context``) are put
    back in any case: a trace that stops inside ``with torch.no_grad()`` does not leave it."""
    from torch._dynamo.utils import counters
    from torch._dynamo.variables.higher_order_ops import speculate_subgraph
    before = {k: dict(counters[k]) for k in ("unimplemented", "graph_break")}
    side_effects = tx.output.side_effects.clone()
    cache = tx.output.variable_tracker_cache
    cached = dict(cache)
    guards = tx.output.tracing_context.guards_context
    guards_before = guards.copy_graphstate()
    global_context = tx.output.tracing_context.global_context
    global_before = global_context.copy_graphstate()
    grad_before = torch.is_grad_enabled()
    new_types = dynamo_new_object_mutation_types()
    try:
        with dynamo_scalar_outputs(tx):
            (out, _), _graph, _lifted = speculate_subgraph(
                tx, fn_vt, list(args), {}, "fxtrain: a Function's forward, for its outputs' shapes",
                always_restore=True, restore_side_effects=False, set_subgraph_inputs="automatic",
                source_target=_speculation_source_target())
        traced = tx.output.side_effects
        changed = [vt for key, vt in traced.id_to_variable.items()
                   if key not in side_effects.id_to_variable and vt.mutation_type is not None
                   and not isinstance(vt.mutation_type, new_types) and traced.is_modified(vt)]
        side_effects.track_runahead_tensor_and_symvar_side_effects(traced)
        tx.output.side_effects = side_effects
        if changed:
            raise SideEffectsOutside(f"it changes {type(changed[0]).__name__} from outside the call")
        return out
    except dynamo_restart_errors():
        raise
    except BaseException:
        tx.output.side_effects = side_effects
        guards.restore_graphstate(guards_before)
        raise
    finally:
        # A trace that failed inside ``with torch.no_grad()`` leaves the mode it entered.
        global_context.restore_graphstate(global_before)
        torch.set_grad_enabled(grad_before)
        for k, v in before.items():
            counters[k].clear()
            counters[k].update(v)
        cache.clear()
        cache.update(cached)


def refused_for_side_effects(error: BaseException) -> bool:
    """Whether dynamo's refusal to trace was about an effect on state outside the traced call
    (``Unsupported`` for a "side effect", e.g. "HOP: Unsafe side effect", or ``speculate``'s own)."""
    from torch._dynamo.exc import Unsupported
    if isinstance(error, SideEffectsOutside):
        return True
    text = f"{getattr(error, 'gb_type', '') or ''} {error}" if isinstance(error, Unsupported) else ""
    return "side effect" in text.lower()


def dynamo_restart(reason: str) -> BaseException:
    """The exception that makes dynamo convert the current frame again from its start
    (``torch._dynamo.exc.RestartAnalysis``), for the caller to raise."""
    from torch._dynamo.exc import RestartAnalysis
    return RestartAnalysis(reason, restart_reason=reason)


@contextlib.contextmanager
def dynamo_scalar_outputs(tx: Any) -> Any:
    """Dynamo traces ``Tensor.item()`` as an unbacked symbol within the block: its config says so
    (``torch._dynamo.config.capture_scalar_outputs``, for the block only) and the frame's shape
    environment, which read that config when it was made, allows such symbols
    (``ShapeEnv.settings.allow_scalar_outputs``, a frozen dataclass, replaced). The latter stays:
    AOTAutograd traces the same ``.item()`` again with this shape environment; it only lets fake
    tensors answer ``.item()``, while dynamo still breaks the graph at the model's own ``.item()``
    calls, as its config says outside the block."""
    import dataclasses
    shape_env = tx.output.shape_env
    if not shape_env.settings.allow_scalar_outputs:
        shape_env.settings = dataclasses.replace(shape_env.settings, allow_scalar_outputs=True)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        yield


def dynamo_graph_break(kind: str, what: str, why: str) -> None:
    """Make dynamo break the graph at the call it is converting, with ``why`` as the reason it files
    (``torch._dynamo.exc.unimplemented``): the call then runs in Python between two graphs."""
    from torch._dynamo.exc import unimplemented
    unimplemented(gb_type=kind, context=what, explanation=why, hints=[])


def free_unbacked_symbols(value: Any) -> set:
    """Data-dependent size symbols in a fake tensor's metadata
    (``torch.fx.experimental.symbolic_shapes.free_unbacked_symbols``)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols as free
    return set(free(value))



def shape_env_of(graphs: Iterable[Optional[torch.fx.GraphModule]]) -> Optional[Any]:
    """The ShapeEnv behind the symbolic sizes of ``graphs``' placeholders (None if every size is
    static): ``SymNode.shape_env``."""
    for gm in graphs:
        for node in (gm.graph.nodes if gm is not None else ()):
            if node.op != "placeholder":
                continue
            val = node.meta.get("val")
            for size in (tuple(val.shape) if isinstance(val, torch.Tensor) else (val,)):
                if isinstance(size, torch.SymInt):
                    return size.node.shape_env
    return None


def shape_guards(shape_env: Any) -> List[Any]:
    """The guards on sizes ``shape_env`` has recorded so far, oldest first (``ShapeEnv.guards``:
    ``ShapeGuard``s, each a sympy expression that held for the sizes it was recorded on)."""
    return list(shape_env.guards)


def size_guard_check(shape_env: Any, placeholders: Sequence[Any], guards: Sequence[Any]) -> Callable[[Sequence[Any]], bool]:
    """A function of a call's graph inputs (in ``placeholders``' order) telling whether ``guards``
    hold for their sizes: the expression ``ShapeEnv.produce_guards_expression`` writes for them
    (what inductor's FX graph cache checks an entry's guards with, over the inputs named
    ``L['t<i>']``), compiled once and evaluated as ``ShapeEnv.evaluate_guards_expression`` does,
    with ``SYMPY_INTERP`` as its globals. Raises if a guard names a size the inputs do not
    determine (a data-dependent one). 2.11 to 2.14: the same signatures."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP
    # Only the inputs with a symbolic size, with their static sizes too (ignore_static=False): a guard
    # such as Eq(s0, 8) makes s0 a replacement, so that the size reads as static from then on.
    symbolic = [i for i, p in enumerate(placeholders)
                if any(isinstance(s, torch.SymInt) for s in (tuple(p.shape) if isinstance(p, torch.Tensor) else (p,)))]
    if not guards or not symbolic:
        return lambda args: True
    text = shape_env.produce_guards_expression([placeholders[i] for i in symbolic], guards=list(guards),
                                               ignore_static=False)
    if text is None:
        return lambda args: True
    code = compile(text, "<fxtrain size guards>", "eval")
    names = [f"t{k}" for k in range(len(symbolic))]

    def check(args: Sequence[Any]) -> bool:
        return bool(eval(code, SYMPY_INTERP, {"L": {n: args[i] for n, i in zip(names, symbolic)}}))
    return check

# ---------------------------------------------------------------------------- graph targets
# The C functions behind torch.nn.functional that dynamo records as call_function targets
# (``torch._C._nn.<name>``; several are the very objects ``F.<name>`` are, others are wrapped).
NN_LINEAR = torch._C._nn.linear
NN_GELU = torch._C._nn.gelu
NN_SILU = torch._C._nn.silu
NN_PAD = torch._C._nn.pad
NN_SDPA = torch._C._nn.scaled_dot_product_attention
#: ``torch._assert_async``: an op asserting a boolean tensor without a host synchronisation.
ASSERT_ASYNC = torch._assert_async
#: How dynamo records a model's own ``with torch.autocast(device_type, dtype, enabled, cache)``:
#: ``ctx = _enter_autocast(*those args)`` ... ``_exit_autocast(ctx)`` (2.11 to 2.14.1).
AUTOCAST_ENTER = torch.amp.autocast_mode._enter_autocast
AUTOCAST_EXIT = torch.amp.autocast_mode._exit_autocast


# ---------------------------------------------------------------- activation checkpointing
# Dynamo traces ``torch.utils.checkpoint`` (HF's ``gradient_checkpointing_enable``) as one call of
# the higher-order op ``tag_activation_checkpoint``: its first argument a ``get_attr`` of the body
# graph (an attribute of the traced module), the region's inputs after it, its value a tuple of the
# body's outputs. When AOTAutograd traces the call, torch runs the body with two metadata tags on
# every op, which FX copies from the node being interpreted to each aten node traced from it
# (``torch.fx.proxy._COPY_META_FIELDS`` under ``preserve_node_meta``) and the joint-graph
# partitioners read: ``recompute`` (a ``CheckpointPolicy``; plain checkpointing gives every op
# PREFER_RECOMPUTE: ``TagActivationCheckpoint.tag_nodes`` on 2.11, the always-recompute policy of
# ``create_selective_checkpoint_contexts`` since 2.13) and ``ac_graph_id`` (one id per region, from
# the counter ``torch._higher_order_ops.wrap.uid``, increasing in trace order: the partitioner saves
# a region's output that a later region reads by comparing the ids). A selective checkpoint
# (``context_fn``) keeps its policy in ``body.meta["_checkpoint_context_fn"]``, and its ops' tags
# come from that policy as they run. Checked on 2.11.0, 2.13.0 and 2.14.1.
CHECKPOINT_OP = torch.ops.higher_order.tag_activation_checkpoint


def is_checkpoint_call(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls torch's region op (a checkpointed region)."""
    return node.op == "call_function" and node.target is CHECKPOINT_OP


def checkpoint_context_fn(body: torch.fx.GraphModule) -> Optional[Callable[[], Any]]:
    """A checkpointed region's selective policy (the ``context_fn`` its user gave), or None."""
    return getattr(body, "meta", {}).get("_checkpoint_context_fn")


def new_checkpoint_region() -> int:
    """A fresh region id from torch's own counter: never one torch gives a region it traces itself."""
    from torch._higher_order_ops import wrap
    return next(wrap.uid)


def tag_recompute(node: torch.fx.Node, region: int) -> None:
    """The tags AOTAutograd's trace of plain checkpointing leaves on each of a region's ops."""
    from torch.utils.checkpoint import CheckpointPolicy
    node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    node.meta["ac_graph_id"] = region


# Torch 2.13 runs plain checkpointing through selective checkpointing's machinery, which wraps each
# random op of a region (dropout, and the CPU flash attention kernel, tagged random even at dropout 0)
# in two higher-order ops, so that the backward's recomputation replays the forward's random numbers:
# ``run_and_save_rng_state(op, *args)`` returns (the generator's state, ``op(*args)``) in the forward,
# ``run_with_rng_state(state, op, *args)`` runs ``op`` from that state in the backward (defined in
# ``torch._prims.rng_prims`` on 2.11-2.14). A dispatch mode meets them as calls it must implement:
# ``HigherOrderOperator.py_impl(mode class)`` registers the mode's implementation.
RNG_STATE_OPS = (torch.ops.higher_order.run_and_save_rng_state, torch.ops.higher_order.run_with_rng_state)


def implement_rng_state_ops(mode_class: type, run_and_save: Callable[..., Any], run_with: Callable[..., Any]) -> None:
    """Give ``mode_class`` (a TorchDispatchMode) its implementations of the two ops above; each gets
    the mode, then the op's own arguments, and runs with the mode off as ``__torch_dispatch__`` does."""
    save, replay = RNG_STATE_OPS
    save.py_impl(mode_class)(run_and_save)
    replay.py_impl(mode_class)(run_with)


def untag_recompute(node: torch.fx.Node) -> None:
    """Drop those tags (a region's op moved back into a body, which torch tags as it traces it)."""
    node.meta.pop("recompute", None)
    node.meta.pop("ac_graph_id", None)


def recompute_region(node: torch.fx.Node) -> Optional[int]:
    """The checkpointed region ``node`` is recomputed in (its ``ac_graph_id``), or None."""
    return node.meta.get("ac_graph_id") if node.meta.get("recompute") is not None else None


# ------------------------------------------------------------------- attention kernels with lse
def _cpu_flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       scale: float) -> Any:
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_flash_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, causal: bool, scale: float) -> Any:
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal,
                                                                     scale=scale)


_ATTENTION_WITH_LSE = {"cpu": (_cpu_flash_forward, _cpu_flash_backward)}


def attention_with_lse(device_type: str) -> Optional[Any]:
    """``(forward, backward)`` attention kernels of torch for ``device_type`` that expose the
    softmax's log-sum-exp, or None (callers then use ``F.scaled_dot_product_attention``).

    ``forward(q, k, v, causal, scale) -> (out, lse)`` on ``[batch, heads, len, dim]``, lse
    ``[batch, heads, len]`` float32; ``backward(grad, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``.
    The CPU flash kernel pair (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
    ``_backward``: the kernels ``F.scaled_dot_product_attention`` and its autograd use on the CPU),
    no dropout. On CUDA, fxtrain's varlen attention uses the variable-length kernels of
    ``varlen_kernels`` instead (one call over every sequence), not a per-sequence pair."""
    return _ATTENTION_WITH_LSE.get(device_type)



# ------------------------------------------------------- variable-length attention kernels (CUDA)
# Attention over packed sequences ``[tokens, heads, dim]`` in one kernel call, told where each
# sequence starts by ``cu_seqlens`` (int32 on the device, ``[0, l0, l0 + l1, ..., tokens]``) and the
# longest length (a host int). The positional schemas below are the same on torch 2.11.0, 2.13.0 and
# 2.14.1 (read from each release's ``_schema``; 2.13 added the keyword-only ``block_table`` and
# ``num_splits`` to ``_flash_attention_forward``, which fxtrain leaves at their defaults); shapes are
# those of ``torch/_meta_registrations.py`` of each release:
#
# ``aten._efficient_attention_forward(query, key, value, bias, cu_seqlens_q, cu_seqlens_k,
#   max_seqlen_q, max_seqlen_k, dropout_p, custom_mask_type, compute_log_sumexp=False, *, scale,
#   seqlen_k, window_size) -> (output, logsumexp, philox_seed, philox_offset, max_q, max_k)``:
#   q/k/v ``[1, tokens, heads, dim]`` (cu_seqlens needs batch 1), output ``[1, tokens, heads, dim_v]``,
#   logsumexp float32 ``[sequences, heads, ceil(max_seqlen_q / 32) * 32]`` (CUDA pads to its kernel
#   alignment; ROCm's is compact on 2.14, hence no ROCm route), seed/offset empty CPU scalars when
#   dropout is 0. ``custom_mask_type`` 0 none, 1 causal from the top left, 2 from the bottom right:
#   equal here since every sequence attends to itself (as many queries as keys).
# ``aten._efficient_attention_backward(grad_out, query, key, value, bias, out, cu_seqlens_q,
#   cu_seqlens_k, max_seqlen_q, max_seqlen_k, logsumexp, dropout_p, philox_seed, philox_offset,
#   custom_mask_type, bias_requires_grad, *, scale, num_splits_key, window_size,
#   shared_storage_dqdkdv) -> (dq, dk, dv, dbias)``: the forward's logsumexp as it was; seed and
#   offset are only read with dropout; ``out`` must be contiguous (the kernel derives its row stride).
# ``aten._flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
#   is_causal, return_debug_mask, *, scale, ...) -> (output, softmax_logsumexp, rng_state, unused,
#   debug_attn_mask)``: fp16/bf16 only, q/k/v ``[tokens, heads, dim]`` (3-d: the varlen path), output
#   the same, logsumexp float32 ``[heads, tokens]``; rng_state uint64 ``[2]`` (unused at p=0).
# ``aten._flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
#   max_q, max_k, dropout_p, is_causal, rng_state, unused, *, scale, ...) -> (dq, dk, dv)``: given
#   empty rng tensors at p=0, as torch.nn.attention.varlen does (it passes zeros: a fill kernel).
#
# ``torch.nn.attention.varlen.varlen_attn`` (2.11+) wraps the same flash kernels (or cuDNN) in its
# own autograd op with fp16/bf16 only; fxtrain's op needs forward and backward as separate kernels
# (its backward is a custom op below autograd), so it calls the aten ops directly.

#: The efficient kernel pads its log-sum-exp's last dim to a multiple of this (CUDA, 2.11 to 2.14.1).
EFFICIENT_LSE_ALIGN = 32


def _efficient_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                              max_len: int, causal: bool, scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    out, lse = aten._efficient_attention_forward(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, cu_seqlens, cu_seqlens, max_len, max_len,
        0.0, 1 if causal else 0, True, scale=scale)[:2]
    return out.squeeze(0), lse


def _efficient_varlen_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                               causal: bool, scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    unused = torch.empty((), dtype=torch.long)
    dq, dk, dv, _ = aten._efficient_attention_backward(
        grad.unsqueeze(0), q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, out.contiguous().unsqueeze(0),
        cu_seqlens, cu_seqlens, max_len, max_len, lse, 0.0, unused, unused, 1 if causal else 0, False,
        scale=scale)
    return dq.squeeze(0), dk.squeeze(0), dv.squeeze(0)


def _flash_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                          max_len: int, causal: bool, scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    out, lse = aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, causal,
                                             False, scale=scale)[:2]
    return out, lse


def _flash_varlen_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                           causal: bool, scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng_state = torch.empty((2,), dtype=torch.uint64, device=q.device)   # read only with dropout
    unused = torch.empty((0,), device=q.device)
    dq, dk, dv = aten._flash_attention_backward(grad, q, k, v, out, lse, cu_seqlens, cu_seqlens, max_len, max_len,
                                                0.0, causal, rng_state, unused, scale=scale)
    return dq, dk, dv


_VARLEN_KERNELS = {"efficient": (_efficient_varlen_forward, _efficient_varlen_backward),
                   "flash": (_flash_varlen_forward, _flash_varlen_backward)}


def varlen_kernels(kind: str) -> Tuple[Callable[..., Any], Callable[..., Any]]:
    """``(forward, backward)`` of torch's variable-length attention kernel ``kind`` ("efficient":
    the CUTLASS memory-efficient kernel, float32/fp16/bf16; "flash": FlashAttention-2, fp16/bf16),
    on packed ``[tokens, heads, dim]`` q/k/v, no dropout, checked on 2.11.0, 2.13.0 and 2.14.1 (the
    schemas above).

    ``forward(q, k, v, cu_seqlens, max_len, causal, scale) -> (out [tokens, heads, dim_v], lse)``,
    lse float32 ``[sequences, heads, ceil(max_len / EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN]``
    (efficient) or ``[heads, tokens]`` (flash); ``backward(grad, q, k, v, out, lse, cu_seqlens,
    max_len, causal, scale) -> (dq, dk, dv)``. ``cu_seqlens`` int32 on q's device, one entry per
    non-empty sequence plus one; causal is each sequence's own causal mask."""
    return _VARLEN_KERNELS[kind]


# ------------------------------------------------------------------ fake tensors and dispatch
# Re-exported as they are (modules ``import torch`` loads): FakeTensor, FakeTensorMode,
# unset_fake_temporarily, DynamicOutputShapeException (torch._subclasses.fake_tensor);
# TorchDispatchMode (torch.utils._python_dispatch); pytree and its tree_* functions.
tree_flatten = pytree.tree_flatten
tree_map = pytree.tree_map
tree_map_only = pytree.tree_map_only


def disable_current_modes() -> ContextManager[Any]:
    """Pop every active dispatch mode for the block (``torch.utils._python_dispatch._disable_current_modes``)."""
    from torch.utils._python_dispatch import _disable_current_modes
    return _disable_current_modes()


def detect_fake_mode(values: Any) -> Any:
    """The FakeTensorMode the values (or the active tracing context) belong to, or None
    (``torch._guards.detect_fake_mode``)."""
    from torch._guards import detect_fake_mode as detect
    return detect(values)


def tracing_context(fake_mode: Any) -> ContextManager[Any]:
    """A tracing context for AOTAutograd run outside dynamo's compile (the partition worker), on
    ``fake_mode``'s values: AOTAutograd records its metadata there (``aot_metadata``)."""
    from torch._guards import TracingContext, tracing
    return tracing(TracingContext(fake_mode))


def carry_dynamo_sources(graph: torch.fx.Graph, copy: torch.fx.Graph) -> None:
    """Give ``copy``'s placeholders the ``_dynamo_source`` attribute of ``graph``'s (in order).

    Dynamo sets it on each placeholder node (not in ``meta``), so ``Graph.graph_copy`` drops it, and
    AOTAutograd asserts on it for every placeholder when the GraphModule still carries dynamo's
    ``_param_name_to_source`` (``aot_module_simplified``: "node ... must have _dynamo_source
    attribute")."""
    for a, b in zip(graph.find_nodes(op="placeholder"), copy.find_nodes(op="placeholder")):
        if hasattr(a, "_dynamo_source"):
            b._dynamo_source = a._dynamo_source


def forget_dynamo_sources(gm: torch.fx.GraphModule) -> None:
    """A dynamo graph loaded elsewhere has lost its placeholders' ``_dynamo_source`` metadata, which
    AOTAutograd then asserts on while it reads ``_param_name_to_source`` (for static inputs: CUDA
    graphs, guards): without the map it takes every input as a plain one."""
    if hasattr(gm, "_param_name_to_source"):
        del gm._param_name_to_source


def is_fake(x: Any) -> bool:
    """Whether ``x`` is a FakeTensor (``torch._subclasses.FakeTensor``)."""
    return isinstance(x, FakeTensor)


#: ``torch.Tensor._make_wrapper_subclass(cls, shape, dtype=, device=, requires_grad=)``: a tensor
#: subclass instance with metadata and no storage (what ``__torch_dispatch__`` wrappers are built on).
make_wrapper_subclass = torch.Tensor._make_wrapper_subclass
#: ``torch._C.DisableTorchFunctionSubclass``: a context in which a Tensor subclass's
#: ``__torch_function__`` is not called (its methods run as plain Tensor's).
DisableTorchFunctionSubclass = torch._C.DisableTorchFunctionSubclass
#: The dispatcher's C API (``torch._C``): DispatchKey, DispatchKeySet, grad mode.
DispatchKey = torch._C.DispatchKey
DispatchKeySet = torch._C.DispatchKeySet
#: ``torch._C._after_autograd_keyset``: the keys below the autograd layer (for redispatch).
AFTER_AUTOGRAD_KEYSET = torch._C._after_autograd_keyset
is_grad_enabled = torch._C.is_grad_enabled
#: ``torch._C._set_grad_enabled(bool)``: grad mode set without a context manager's cost.
set_grad_enabled = torch._C._set_grad_enabled
#: ``torch._C._any_requires_grad(tensors)``: whether any tensor of a list requires grad.
any_requires_grad = torch._C._any_requires_grad
#: ``torch._C._dispatch_tls_local_include_set()`` / ``_exclude_set()``: this thread's dispatch key TLS.
dispatch_tls_include_set = torch._C._dispatch_tls_local_include_set
dispatch_tls_exclude_set = torch._C._dispatch_tls_local_exclude_set
#: ``torch._C._ForceDispatchKeyGuard(include, exclude)``: sets the dispatch key TLS until exited.
ForceDispatchKeyGuard = torch._C._ForceDispatchKeyGuard
#: ``torch._C._len_torch_dispatch_stack()``: how many TorchDispatchModes are active.
dispatch_mode_depth = torch._C._len_torch_dispatch_stack
#: ``torch._C._current_autograd_node()``: the autograd node whose backward runs now, or None.
current_autograd_node = torch._C._current_autograd_node
#: ``torch._C._is_torch_function_mode_enabled()``: whether a TorchFunctionMode is active.
torch_function_mode_enabled = torch._C._is_torch_function_mode_enabled
#: ``torch._C._autograd._profiler_enabled()``: whether the autograd profiler records now.
profiler_enabled = torch._C._autograd._profiler_enabled


def function_class_of(node: Any) -> Optional[type]:
    """The ``autograd.Function`` class whose backward an autograd node runs
    (``BackwardCFunction._forward_cls``), None for any other node."""
    return getattr(node, "_forward_cls", None)


#: The autograd engine's ``run_backward(roots, grads, keep_graph, create_graph, inputs,
#: allow_unreachable, accumulate_grad)`` (``torch.autograd.Variable._execution_engine``).
run_backward = torch.autograd.Variable._execution_engine.run_backward


# ----------------------------------------------------------------------- custom-op internals
def custom_op_impl(opdef: Any) -> Callable[..., Any]:
    """The Python function a ``torch.library.custom_op`` was defined with (``CustomOpDef._init_fn``)."""
    return opdef._init_fn


def custom_op_impl_of(func: Any) -> Optional[Callable[..., Any]]:
    """For an OpOverload, the Python function of the ``torch.library.custom_op`` that defined it, or
    None for any other op (``torch._library.custom_ops.OPDEFS[schema name]._init_fn``)."""
    from torch._library.custom_ops import OPDEFS
    opdef = OPDEFS.get(func._schema.name) if hasattr(func, "_schema") else None
    return opdef._init_fn if opdef is not None else None


def redispatcher(op: Any) -> Callable[..., Any]:
    """``op(keyset, *args)`` that calls an OpOverload's kernels from ``keyset`` down
    (``OpOverload._handle.redispatch_boxed``)."""
    return op._handle.redispatch_boxed


def reparametrize_module(module: torch.nn.Module, values: Dict[str, Any], *, tie_weights: bool,
                         strict: bool) -> ContextManager[Any]:
    """Swap a module's parameters and buffers for ``values`` within the block
    (``torch.nn.utils.stateless._reparametrize_module``, what ``torch.func.functional_call`` uses)."""
    from torch.nn.utils.stateless import _reparametrize_module
    return _reparametrize_module(module, values, tie_weights=tie_weights, strict=strict)


def set_custom_op_kernels(opdef: Any, kernel: Callable[..., Any], autograd_kernel: Callable[..., Any]) -> None:
    """Register plain kernels for a ``torch.library.custom_op`` in its own library, replacing its
    Python wrappers: ``kernel`` as CompositeExplicitAutograd, ``autograd_kernel(keyset, *args)`` as
    Autograd (``CustomOpDef._lib.impl(CustomOpDef._name, ...)``)."""
    # allow_override: custom_op registered its wrappers first; torch before 2.13 refuses to replace
    # them unless asked (the GPU machines lent here carry 2.11).
    opdef._lib.impl(opdef._name, kernel, "CompositeExplicitAutograd", allow_override=True)
    opdef._lib.impl(opdef._name, autograd_kernel, "Autograd", with_keyset=True, allow_override=True)


# ------------------------------------------------------------------------- distributed tools
def process_group_timeout(group: Any) -> Any:
    """The timeout (a timedelta) a process group's CPU backend was created with
    (``group._get_backend(cpu).options._timeout``). Raises if the layout moved."""
    return group._get_backend(torch.device("cpu")).options._timeout


def schedule_actions(class_name: str, ranks: int, n_microbatches: int, stages_per_rank: int) -> List[List[Any]]:
    """Every rank's compute actions, as (kind, stage, microbatch) with kind F, B, I or W, in the
    order torch's multi-stage schedule class runs them (its ``pipeline_order``, built on stand-in
    stages by ``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops``). Idle slots
    are dropped and an OVERLAP_F_B action becomes its sub-actions."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    orders = get_schedule_ops(getattr(schedules, class_name), ranks, n_microbatches, stages_per_rank)
    return [[(a.computation_type.value, a.stage_index, a.microbatch_index)
             for action in rank_ops if action is not None for a in action.sub_actions or (action,)
             if getattr(a.computation_type, "value", None) in ("F", "B", "I", "W")] for rank_ops in orders]


_stage_classes: List[type] = []


def pipeline_stage_class() -> type:
    """The class fxtrain's pipeline stages derive from: ``torch.distributed.pipelining.PipelineStage``
    (static mode: ``input_args`` and ``output_args`` given), taking tensors of any dtype between
    stages. A received input requires grad only if it is a floating-point tensor (and the stage has
    a backward), and none gets a gradient sent back for it.

    2.12 and later: torch's class, which does so itself. 2.11: a subclass that does. 2.11's
    ``PipelineStage`` makes every receive buffer require grad (``_prepare_forward_infra``, and
    ``set_local_fwd_input`` for the V schedules' stage pairs on one rank), which fails for an integer
    tensor a stage hands on (labels, positions: "only Tensors of floating point dtype can require
    gradients"), and it sends a gradient back for every received input (``_create_grad_send_info``
    / ``_create_grad_recv_info``), where such an input has none. The subclass marks the buffers as
    2.12 does, and leaves such inputs out of the gradient exchange on both sides: no send
    (``grad_send_info`` None), no receive (``grad_recv_info`` None; ``_retrieve_recv_grads`` and
    ``set_local_bwd_input`` pass it through as None, and the stage's backward skips an output that
    does not require grad whatever its gradient). And before its first step 2.11's schedule has
    each stage exchange a dummy tensor with both neighbour stages (``_get_init_p2p_neighbors_ops``),
    also with a neighbour on the same rank (the V schedules' middle pair), which gloo cannot send
    to (its pair to itself is never connected); 2.12's warm-up does not, nor does the subclass."""
    from torch.distributed.pipelining import PipelineStage
    if torch_at_least(2, 12):
        return PipelineStage
    if not _stage_classes:
        _stage_classes.append(_pipeline_stage_211(PipelineStage))
    return _stage_classes[0]


def _pipeline_stage_211(base: type) -> type:
    from torch.distributed.pipelining.stage import _RecvInfo

    def differentiable(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.is_floating_point()

    class PipelineStage211(base):  # type: ignore[misc, valid-type]
        def _prepare_forward_infra(self, num_microbatches: int, args: Any, kwargs: Any = None) -> Any:
            has_backward = self.has_backward
            self.has_backward = False        # torch's loop would mark every buffer
            try:
                out = super()._prepare_forward_infra(num_microbatches, args, kwargs)
            finally:
                self.has_backward = has_backward
            if has_backward:
                for infos in self.args_recv_info.values():
                    for info in infos:
                        if isinstance(info, _RecvInfo) and differentiable(info.buffer):
                            info.buffer.requires_grad_(True)
            return out

        def set_local_fwd_input(self, prev_stage_outputs: Any, mb_index: int) -> None:
            outputs = prev_stage_outputs if isinstance(prev_stage_outputs, (tuple, list)) else (prev_stage_outputs,)
            if all(differentiable(t) for t in outputs):
                return super().set_local_fwd_input(prev_stage_outputs, mb_index)
            for info, tensor in zip(self.args_recv_info[mb_index], outputs):
                info.buffer = tensor.detach().requires_grad_(differentiable(tensor))

        def _create_grad_send_info(self, args_recv_info: tuple) -> List[Optional[int]]:
            return [a.source if isinstance(a, _RecvInfo) and differentiable(a.buffer) else None
                    for a in args_recv_info]

        def _create_grad_recv_info(self, act_send_info: dict) -> tuple:
            infos = super()._create_grad_recv_info(act_send_info)
            return tuple(info if differentiable(info.buffer) else None for info in infos)

        def _retrieve_recv_grads(self, bwd_chunk_id: int) -> Any:
            return tuple(None if info is None else info.buffer for info in self.grad_recv_info[bwd_chunk_id])

        def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
            for info, tensor in zip(self.grad_recv_info[mb_index], next_stage_bwd_outputs):
                if info is not None:
                    info.buffer = tensor

        def _get_init_p2p_neighbors_ops(self) -> List[Any]:
            mine = self.group_rank
            return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != mine]

    return PipelineStage211


def default_store() -> Any:
    """The key-value store of the default process group
    (``torch.distributed.distributed_c10d._get_default_store()``; raises when none is initialised)."""
    from torch.distributed import distributed_c10d
    return distributed_c10d._get_default_store()


# ------------------------------------------------------------------------- graph serialisation
_IMPORTS = b"fxtrain-imports\0"


def custom_ops(obj: Any) -> Dict[str, str]:
    """The Python custom ops (``torch.library.custom_op``) the GraphModules in ``obj`` call, each with
    the module that defined it, from ``torch._library.custom_ops.OPDEFS`` (each op's
    ``_init_fn.__module__``). A graph pickles such an op by name, and a process that has not
    imported its module has no op of that name: HF's MoE layers call
    ``transformers::grouped_mm_fallback``, defined in ``transformers.integrations.moe``, and the
    partition worker answered "'_OpNamespace' 'transformers' object has no attribute
    'grouped_mm_fallback'"."""
    from torch._library.custom_ops import OPDEFS
    found: Dict[str, str] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, torch.fx.GraphModule):
            for module in item.modules():
                if not isinstance(module, torch.fx.GraphModule):
                    continue
                for node in module.graph.nodes:
                    name = op_qualified_name(node.target) if node.op == "call_function" else None
                    if name is None:
                        continue
                    opdef = OPDEFS.get(name)
                    defined = getattr(getattr(opdef, "_init_fn", None), "__module__", None)
                    if isinstance(defined, str):
                        found.setdefault(name, defined)
    return found


def custom_op_modules(obj: Any) -> List[str]:
    """The modules another process imports before it loads ``obj``'s graphs (:func:`custom_ops`),
    in the order their ops are first met. ``__main__`` is not among them (:func:`only_here`)."""
    return list(dict.fromkeys(m for m in custom_ops(obj).values() if m != "__main__"))


class NotPortable(Error, ValueError):
    """Graphs another process could not load (:func:`only_here`)."""


def only_here(obj: Any) -> str:
    """Why another process could not load ``obj``'s graphs ('' where it can): custom ops defined in
    ``__main__``, the user's script or notebook. Another process's ``__main__`` is its own, and
    running the user's script there to define them would run its training too."""
    local = sorted(name for name, module in custom_ops(obj).items() if module == "__main__")
    if not local:
        return ""
    return (f"custom op{'s' if len(local) > 1 else ''} {', '.join(local)} defined in __main__, which a "
            f"worker process cannot import (defined in a module the script imports, it can)")


def pickle_graphs(obj: Any, for_another_process: bool = False) -> bytes:
    """Pickle an object holding GraphModules with fake-tensor metadata, every op allowed
    (``torch.fx._graph_pickler.GraphPickler.dumps(obj, Options(ops_filter=None))``).
    ``for_another_process``: prefixed with the modules of the custom ops it calls
    (:func:`custom_op_modules`), which :func:`unpickle_graphs` imports before loading, and this
    process's ``sys.path`` to find them: ``python scripts/train.py`` puts ``scripts/`` on the path of
    that process only, so ops defined in ``scripts/my_ops.py`` did not import in the worker (whose
    path, once started, is also older than a path the script extends later). NotPortable where
    another process could not load it (:func:`only_here`).

    2.12 and later: that call alone. 2.11: inside :func:`_slices_as_pytree_nodes`, as 2.12's
    ``dumps`` itself runs. The pickler maps each node's arguments with pytree to replace the nodes
    in them; 2.11's pytree does not look into a slice, so a node inside one (``x[:, :n]`` with a
    symbolic ``n``) reached pickle raw ("Unexpected raw Node during pickling")."""
    from torch.fx._graph_pickler import GraphPickler, Options
    head = b""
    if for_another_process:
        why = only_here(obj)
        if why:
            raise NotPortable(why)
        modules = custom_op_modules(obj)
        path = [p for p in sys.path if isinstance(p, str)] if modules else []
        head = _IMPORTS + json.dumps({"modules": modules, "path": path}).encode() + b"\0"
    if torch_at_least(2, 12):
        return head + GraphPickler.dumps(obj, Options(ops_filter=None))
    with _slices_as_pytree_nodes():
        return head + GraphPickler.dumps(obj, Options(ops_filter=None))


def unpickle_graphs(payload: bytes, fake_mode: Any) -> Any:
    """Inverse of :func:`pickle_graphs`; fake values are rebuilt in ``fake_mode``. 2.11: inside
    :func:`_slices_as_pytree_nodes`, as 2.12's ``loads`` runs (it maps the nodes back the same way)."""
    from torch.fx._graph_pickler import GraphPickler
    if payload.startswith(_IMPORTS):
        head, payload = payload[len(_IMPORTS):].split(b"\0", 1)
        imports = json.loads(head)
        sys.path.extend(p for p in imports["path"] if p not in sys.path)   # after its own: they shadow nothing
        for name in imports["modules"]:
            try:
                importlib.import_module(name)
            except Exception as e:   # the load would fail on the op it lacks, saying less
                raise NotPortable(f"could not import {name}, which defines custom ops these graphs call "
                                  f"({type(e).__name__}: {e})") from e
    if torch_at_least(2, 12):
        return GraphPickler.loads(payload, fake_mode)
    with _slices_as_pytree_nodes():
        return GraphPickler.loads(payload, fake_mode)


_slice_lock = threading.Lock()
_slice_users = [0]


@contextlib.contextmanager
def _slices_as_pytree_nodes() -> Iterator[None]:
    """``slice`` registered as a pytree node (its start, stop and step the children) within the
    block, unless it already is: 2.12's ``torch.fx._graph_pickler.patch_pytree_map_over_slice``
    (``pytree._private_register_pytree_node`` / ``_deregister_pytree_node``), counted so that
    blocks on two threads (runtime/tiered.py pickles on a worker) do not undo each other's."""
    with _slice_lock:
        if _slice_users[0] == 0 and slice in pytree.SUPPORTED_NODES:
            owned = False
        else:
            owned = True
            if _slice_users[0] == 0:
                pytree._private_register_pytree_node(slice, lambda x: ([x.start, x.stop, x.step], None),
                                                     lambda values, _: slice(*values))
            _slice_users[0] += 1
    try:
        yield
    finally:
        if owned:
            with _slice_lock:
                _slice_users[0] -= 1
                if _slice_users[0] == 0:
                    pytree._deregister_pytree_node(slice)
