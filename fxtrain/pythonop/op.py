"""The opaque op pair a captured ``Function.apply`` becomes: ``fxtrain::python_op`` (forward graph)
and ``fxtrain::python_op_backward`` (backward graph).

At run time the forward op calls the user's real ``apply`` on detached copies of its inputs with
autograd recording, so torch itself builds the Function's node and ctx exactly as in eager
(``needs_input_grad``, ``save_for_backward``, ``mark_non_differentiable``, ``set_materialize_grads``,
``setup_context``, ``once_differentiable`` all behave as usual). The backward op replays the user's
real ``backward`` through that node with the autograd engine. Between the two, the node and its
inputs wait in a pool under an integer handle that the graph carries as a 0-d int64 tensor; the pool
entry goes when the backward ran or when the handle tensor is freed (no backward ever came).

The handle always lives on the CPU, whatever device the data is on: reading it back is never a
device-to-host synchronisation.

Cost. Both ops run once per Function call per step, so their dispatch is kept lean: the ops are
declared with ``torch.library.custom_op`` (torch then knows them as custom ops: fake kernels, the
profiler's ``OPDEFS`` lookup), but their CompositeExplicitAutograd and Autograd kernels are replaced
by plain functions, without custom_op's Python wrappers (``backend_impl``/``wrapped_fn``/
``autograd_impl``, about 20 us per call). The Autograd kernel of ``python_op`` goes straight to the
kernel below when no gradient is wanted (the aten replay, where AOTAutograd's node owns the
gradient); when one is wanted it applies the user's Function itself on plain tensors (the graph run
under eager autograd: ``_apply_eagerly``) and ``_Formula``, the op's autograd formula
(``_setup_context``/``_backward``), on fake or functional tensors and under dispatch modes (tracers,
the profiler), which must see the op pair.
"""
from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import torch_private as tp
from ..torch_private import (AFTER_AUTOGRAD_KEYSET, DispatchKey, DispatchKeySet, ForceDispatchKeyGuard,
                             any_requires_grad, current_graph_task_keeps_graph, dispatch_mode_depth,
                             dispatch_tls_exclude_set, dispatch_tls_include_set, is_grad_enabled,
                             set_grad_enabled)
from .registry import CONSTANT, SPECS

_lock = threading.Lock()
_handles = itertools.count(1)
# handle -> (inputs, outputs, weakref to the handle tensor whose death drops the entry)
POOL: Dict[int, Tuple[List[torch.Tensor], List[torch.Tensor], Any]] = {}
_CPU = torch.device("cpu")
_AUTOGRAD_KEYS = (DispatchKey.AutogradFunctionality, DispatchKey.AutogradOther,
                  DispatchKey.AutogradNestedTensor, DispatchKey.ADInplaceOrView)
_AUTOGRAD_SET = DispatchKeySet(_AUTOGRAD_KEYS[0])
for _key in _AUTOGRAD_KEYS[1:]:
    _AUTOGRAD_SET = _AUTOGRAD_SET | DispatchKeySet(_key)
_AFTER_AUTOGRAD = AFTER_AUTOGRAD_KEYSET
# Dispatch keys of a call that a tracer or a tensor subclass sees (FakeTensor, FunctionalTensor,
# TorchDispatchMode: the Python key; C++ functionalization).
_TRACED = DispatchKeySet(DispatchKey.Python) | DispatchKeySet(DispatchKey.Functionalize)
_run_backward = tp.run_backward


def _enter_user_autograd() -> Tuple[bool, Any]:
    """Grad mode on and autograd dispatch on, as in eager, for the user's code; returns what
    ``_exit_user_autograd`` restores. (A plain function pair rather than a context manager: this
    runs twice per Function call.)

    A kernel may run below the autograd layer of the dispatcher (``_AutoDispatchBelowAutograd``,
    inference mode), where no op records a gradient even with grad enabled; the user's backward may
    rely on autograd (recompute then ``torch.autograd.grad``), and we record the forward ourselves.
    """
    previous = is_grad_enabled()
    set_grad_enabled(True)
    exclude = dispatch_tls_exclude_set()
    if not (exclude & _AUTOGRAD_SET).raw_repr():
        return previous, None
    guard = ForceDispatchKeyGuard(dispatch_tls_include_set(), exclude - _AUTOGRAD_SET)
    guard.__enter__()
    return previous, guard


def _exit_user_autograd(state: Tuple[bool, Any]) -> None:
    previous, guard = state
    if guard is not None:
        guard.__exit__(None, None, None)
    set_grad_enabled(previous)


def _forget(handle: int) -> Any:
    return lambda _ref: POOL.pop(handle, None)


def _shares_storage(t: torch.Tensor, inputs: Sequence[torch.Tensor]) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return any(ptr == i.untyped_storage().data_ptr() for i in inputs if i.device == t.device)


def _new_handle(handle_id: int) -> torch.Tensor:
    """The handle tensor, on the CPU whatever the data's or the default device."""
    if dispatch_mode_depth():
        # Under a dispatch mode (the profiler's fake run): fake mode keeps the value of a tensor made
        # by torch.tensor from a Python number as a constant, so int() can read it back.
        return torch.tensor(handle_id, dtype=torch.int64, device=_CPU)
    return torch.scalar_tensor(handle_id, dtype=torch.int64, device=_CPU)  # a third of torch.tensor's cost


def _outputs(spec: Any, result: Any, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The Function's tensor outputs, refused where a PythonOp cannot reproduce them."""
    if spec.single:
        outs = [result] if spec.outputs[0][0] != CONSTANT else []
    else:
        outs = [result[i] for i, (kind, _) in enumerate(spec.outputs) if kind != CONSTANT]
    for o in outs:  # apply hands back an input only when marked dirty
        for i in inputs:
            if o is i:
                raise RuntimeError(f"fxtrain: {spec.name} modifies an input in place (ctx.mark_dirty), which a "
                                   f"PythonOp cannot reproduce; make its forward traceable by torch (it then is "
                                   f"traced with in-place semantics) or use Options(custom_autograd=False)")
    if spec.seen is not None and [(o.shape, o.dtype) for o in outs] != [(s, d) for s, d, _ in spec.seen]:
        # Shaped by its run on the capturing batch and guarded on its input sizes: a different output
        # shape for the same input sizes depends on data, which the graph cannot follow.
        raise RuntimeError(f"fxtrain: {spec.name} returned {[tuple(o.shape) for o in outs]}, but at capture it "
                           f"returned {[tuple(s) for s, _, _ in spec.seen]} for inputs of the same sizes; give "
                           f"it an infer_shape static method or make its output shape depend on sizes only")
    return outs


@torch.library.custom_op("fxtrain::python_op", mutates_args=())
def python_op(key: int, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    spec = SPECS[key]
    if spec.record:
        state = _enter_user_autograd()
        try:
            inputs = [t.detach().requires_grad_(d) for t, d in zip(tensors, spec.differentiable)]
            result = spec.fn_cls.apply(*spec.arguments(inputs))
        finally:
            _exit_user_autograd(state)
    else:
        inputs = list(tensors)
        with torch.no_grad():
            result = spec.fn_cls.apply(*spec.arguments(inputs))
    outs = _outputs(spec, result, inputs)
    # A custom op may not return its inputs or views of them: copy only those.
    shares = _shares_storage
    returned = [o.detach().clone() if shares(o, tensors) else o.detach() for o in outs]
    if spec.record and any(o.requires_grad for o in outs):
        with _lock:
            handle_id = next(_handles)
        handle = _new_handle(handle_id)
        # The entry holds the weak reference, so its callback dies with the entry once the backward ran.
        POOL[handle_id] = (inputs, outs, weakref.ref(handle, _forget(handle_id)))
    else:
        handle = _new_handle(0)
    returned.append(handle)
    return returned


@python_op.register_fake
def _python_op_fake(key: int, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    spec = SPECS[key]
    outs = spec.shape_fn(tensors)
    return [torch.empty_like(o) for o in outs] + [torch.empty((), dtype=torch.int64, device=_CPU)]


@torch.library.custom_op("fxtrain::python_op_backward", mutates_args=())
def python_op_backward(key: int, handle: torch.Tensor, grads: List[Optional[torch.Tensor]],
                       sizes: List[int]) -> List[torch.Tensor]:
    spec = SPECS[key]
    # backward(retain_graph=True) may run this node again: keep the forward state for it.
    keep = current_graph_task_keeps_graph()
    handle_id = int(handle)  # a CPU tensor: no synchronisation
    entry = POOL.get(handle_id) if keep else POOL.pop(handle_id, None)
    if entry is None:
        raise RuntimeError(f"fxtrain: the forward state of {spec.name} is gone: was backward called twice "
                           f"on a graph that was not retained?")
    inputs, outs = entry[0], entry[1]
    roots, root_grads = [], []
    for o, g in zip(outs, grads):
        if g is not None and o.requires_grad:
            roots.append(o)
            root_grads.append(g)
    wanted = tuple(i for i, d in zip(inputs, spec.differentiable) if d)
    if roots and wanted:
        state = _enter_user_autograd()
        try:
            # torch.autograd.grad without its Python argument handling; the graph is kept as long as the
            # caller keeps its own, for a retained backward to run the user's backward again.
            result = _run_backward(tuple(roots), tuple(root_grads), keep, False, wanted, True, False)
        finally:
            _exit_user_autograd(state)
    else:
        result = (None,) * len(wanted)
    out = []
    for g, i in zip(result, wanted):
        if g is None:  # an op cannot return None: no gradient from the user's backward is zeros
            g = torch.zeros_like(i)
        elif _shares_storage(g, [x for x in grads if x is not None]):  # nor return (a view of) one of its inputs
            g = g.clone()
        out.append(g)
    return out


@python_op_backward.register_fake
def _python_op_backward_fake(key: int, handle: torch.Tensor, grads: List[Optional[torch.Tensor]],
                             sizes: List[int]) -> List[torch.Tensor]:
    spec = SPECS[key]
    out, offset = [], 0
    for rank, dtype, device in spec.grad_meta:
        out.append(torch.empty(sizes[offset:offset + rank], dtype=dtype, device=device))
        offset += rank
    return out


def _setup_context(ctx: Any, inputs: Tuple[Any, ...], output: List[torch.Tensor]) -> None:
    key, tensors = inputs
    spec = SPECS[key]
    ctx.key = key
    # Absent output gradients reach the pool as None; the user's own Function then materialises
    # them or not, as its ctx.set_materialize_grads says, exactly as in eager.
    ctx.set_materialize_grads(False)
    ctx.sizes = [s for t, d in zip(tensors, spec.differentiable) if d for s in t.shape]
    ctx.handle = output[-1]  # an output without history: held directly, no SavedVariable needed


def _backward(ctx: Any, grads: Sequence[Optional[torch.Tensor]]) -> Tuple[None, List[Optional[torch.Tensor]]]:
    spec = SPECS[ctx.key]
    computed = _BACKWARD_OP(ctx.key, ctx.handle, list(grads[:-1]), ctx.sizes)
    it = iter(computed)
    return None, [next(it) if d else None for d in spec.differentiable]


class _Formula(torch.autograd.Function):
    """python_op's autograd formula: the forward redispatches below autograd, the backward is
    ``python_op_backward``. What custom_op's ``register_autograd`` would build, without its wrappers."""

    @staticmethod
    def forward(ctx: Any, keyset: Any, key: int, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        output = _redispatch_forward(keyset & _AFTER_AUTOGRAD, key, list(tensors))
        _setup_context(ctx, (key, tensors), output)
        ctx.mark_non_differentiable(output[-1])
        return tuple(output)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
        _, input_grads = _backward(ctx, grads)
        return (None, None, *input_grads)


def _apply_eagerly(key: int, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """python_op under eager autograd on plain tensors: the user's Function itself, on the real inputs.

    Its node then is the graph's node, exactly as in eager (retain_graph, create_graph, hooks), with
    no pool entry, no detached copies and no re-entrant backward: the opaque formula exists for
    tracers (AOTAutograd, the profiler), which must see python_op and python_op_backward.
    """
    spec = SPECS[key]
    result = spec.fn_cls.apply(*spec.arguments(tensors))
    outs = _outputs(spec, result, tensors)
    outs.append(_new_handle(0))
    return outs


def _python_op_autograd(keyset: Any, key: int, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    traced = (keyset & _TRACED).raw_repr()   # fake or functional tensors, a dispatch mode: keep the op opaque
    if is_grad_enabled() and any_requires_grad(tensors):
        if traced:
            return list(_Formula.apply(keyset, key, *tensors))
        return _apply_eagerly(key, tensors)
    if traced or keyset.has(DispatchKey.Meta):   # the Meta kernel is the fake one
        return _redispatch_forward(keyset & _AFTER_AUTOGRAD, key, tensors)
    # Below autograd only fallthrough keys remain before the CompositeExplicitAutograd kernel: call it.
    return _forward_impl(key, tensors)


def _python_op_backward_autograd(keyset: Any, key: int, handle: torch.Tensor,
                                 grads: List[Optional[torch.Tensor]], sizes: List[int]) -> List[torch.Tensor]:
    if is_grad_enabled() and any_requires_grad(grads):
        raise RuntimeError(f"fxtrain: a higher-order gradient (create_graph=True) through the PythonOp "
                           f"{SPECS[key].name} is not supported")
    if (keyset & _TRACED).raw_repr() or keyset.has(DispatchKey.Meta):
        return _redispatch_backward(keyset & _AFTER_AUTOGRAD, key, handle, grads, sizes)
    return _backward_impl(key, handle, grads, sizes)


_FORWARD_OP = torch.ops.fxtrain.python_op.default
_BACKWARD_OP = torch.ops.fxtrain.python_op_backward.default
_redispatch_forward = tp.redispatcher(_FORWARD_OP)
_redispatch_backward = tp.redispatcher(_BACKWARD_OP)
_forward_impl = tp.custom_op_impl(python_op)
_backward_impl = tp.custom_op_impl(python_op_backward)
# The formula as custom_op metadata too (what torch reads of a custom op); the kernel below runs it.
python_op.register_autograd(_backward, setup_context=_setup_context)


def _register_lean_kernels() -> None:
    """Replace custom_op's Python wrappers with the plain kernels (same library, same dispatch keys)."""
    with warnings.catch_warnings():
        # "Overriding a previously registered kernel": custom_op's own, on purpose.
        warnings.simplefilter("ignore", UserWarning)
        tp.set_custom_op_kernels(python_op, _forward_impl, _python_op_autograd)
        tp.set_custom_op_kernels(python_op_backward, _backward_impl, _python_op_backward_autograd)


_register_lean_kernels()

# Never dead code: a Function may be called for its side effects alone, as in eager.
torch.fx.node.has_side_effect(torch.ops.fxtrain.python_op.default)
torch.fx.node.has_side_effect(torch.ops.fxtrain.python_op_backward.default)
