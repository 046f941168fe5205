"""The opaque op pair a captured ``Function.apply`` becomes: ``fxtrain::python_op`` (forward graph)
and ``fxtrain::python_op_backward`` (backward graph).

At run time the forward op calls the user's real ``apply`` on detached copies of its inputs with
autograd recording, so torch itself builds the Function's node and ctx exactly as in eager
(``needs_input_grad``, ``save_for_backward``, ``mark_non_differentiable``, ``set_materialize_grads``,
``setup_context``, ``once_differentiable`` all behave as usual). The backward op replays the user's
real ``backward`` through that node with ``torch.autograd.grad``. Between the two, the node and its
inputs wait in a pool under an integer handle that the graph carries as a 0-d int64 tensor; the pool
entry goes when the backward ran or when the handle tensor is freed (no backward ever came).
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .registry import CONSTANT, SPECS

_lock = threading.Lock()
_handles = itertools.count(1)
POOL: Dict[int, Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}
_C = torch._C
_AUTOGRAD_KEYS = (_C.DispatchKey.AutogradFunctionality, _C.DispatchKey.AutogradOther,
                  _C.DispatchKey.AutogradNestedTensor, _C.DispatchKey.ADInplaceOrView)


def _handle_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    # The handle follows the data (reading it back with int() costs a sync on an accelerator).
    return tensors[0].device


@contextlib.contextmanager
def _autograd_dispatch() -> Iterator[None]:
    """Run user code with autograd dispatch on, as in eager.

    A custom op's implementation runs below the autograd layer of the dispatcher, where no op
    records a gradient even with grad enabled; the user's backward may rely on autograd (recompute
    then ``torch.autograd.grad``), and we record the forward ourselves.
    """
    exclude = _C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    with _C._ForceDispatchKeyGuard(_C._dispatch_tls_local_include_set(), exclude):
        yield


def _forget(handle: int) -> None:
    POOL.pop(handle, None)


def _shares_storage(t: torch.Tensor, inputs: Sequence[torch.Tensor]) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return any(ptr == i.untyped_storage().data_ptr() for i in inputs if i.device == t.device)


@torch.library.custom_op("fxtrain::python_op", mutates_args=())
def python_op(key: int, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    spec = SPECS[key]
    if spec.record:
        with torch.enable_grad(), _autograd_dispatch():
            inputs = [t.detach().requires_grad_(d) for t, d in zip(tensors, spec.differentiable)]
            result = spec.fn_cls.apply(*spec.arguments(inputs))
    else:
        inputs = list(tensors)
        with torch.no_grad():
            result = spec.fn_cls.apply(*spec.arguments(inputs))
    results = (result,) if spec.single else tuple(result)
    outs = [results[i] for i, (kind, _) in enumerate(spec.outputs) if kind != CONSTANT]
    if any(o is i for o in outs for i in inputs):  # apply hands back an input only when marked dirty
        raise RuntimeError(f"fxtrain: {spec.name} modifies an input in place (ctx.mark_dirty), which a PythonOp "
                           f"cannot reproduce; make its forward traceable by torch (it then is traced with "
                           f"in-place semantics) or use Options(custom_autograd=False)")
    if spec.seen is not None and [(o.shape, o.dtype) for o in outs] != [(s, d) for s, d, _ in spec.seen]:
        # Shaped by its run on the capturing batch and guarded on its input sizes: a different output
        # shape for the same input sizes depends on data, which the graph cannot follow.
        raise RuntimeError(f"fxtrain: {spec.name} returned {[tuple(o.shape) for o in outs]}, but at capture it "
                           f"returned {[tuple(s) for s, _, _ in spec.seen]} for inputs of the same sizes; give "
                           f"it an infer_shape static method or make its output shape depend on sizes only")
    # A custom op may not return its inputs or views of them: copy only those.
    returned = [o.detach().clone() if _shares_storage(o, tensors) else o.detach() for o in outs]
    handle_id = 0
    if spec.record and any(o.requires_grad for o in outs):
        with _lock:
            handle_id = next(_handles)
        POOL[handle_id] = (inputs, outs)
    handle = torch.tensor(handle_id, dtype=torch.int64, device=_handle_device(tensors))
    if handle_id:
        weakref.finalize(handle, _forget, handle_id)
    return returned + [handle]


@python_op.register_fake
def _python_op_fake(key: int, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    spec = SPECS[key]
    outs = spec.shape_fn(tensors)
    return [torch.empty_like(o) for o in outs] + [torch.empty((), dtype=torch.int64, device=_handle_device(tensors))]


@torch.library.custom_op("fxtrain::python_op_backward", mutates_args=())
def python_op_backward(key: int, handle: torch.Tensor, grads: List[Optional[torch.Tensor]],
                       sizes: List[int]) -> List[torch.Tensor]:
    spec = SPECS[key]
    # backward(retain_graph=True) may run this node again: keep the forward state for it.
    keep = torch._C._autograd._get_current_graph_task_keep_graph()
    entry = POOL.get(int(handle)) if keep else POOL.pop(int(handle), None)
    if entry is None:
        raise RuntimeError(f"fxtrain: the forward state of {spec.name} is gone: was backward called twice "
                           f"on a graph that was not retained?")
    inputs, outs = entry
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    wanted = [i for i, d in zip(inputs, spec.differentiable) if d]
    result: List[Optional[torch.Tensor]] = [None] * len(wanted)
    if pairs and wanted:
        with torch.enable_grad(), _autograd_dispatch():
            result = list(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                              allow_unused=True))
    given = [g for g in grads if g is not None]
    out = []
    for g, i in zip(result, wanted):
        if g is None:  # an op cannot return None: no gradient from the user's backward is zeros
            g = torch.zeros_like(i)
        elif _shares_storage(g, given):  # nor return (a view of) one of its inputs
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
    ctx.save_for_backward(output[-1])


def _backward(ctx: Any, grads: List[Optional[torch.Tensor]]) -> Tuple[None, List[Optional[torch.Tensor]]]:
    spec = SPECS[ctx.key]
    (handle,) = ctx.saved_tensors
    computed = torch.ops.fxtrain.python_op_backward(ctx.key, handle, list(grads[:-1]), ctx.sizes)
    it = iter(computed)
    return None, [next(it) if d else None for d in spec.differentiable]


python_op.register_autograd(_backward, setup_context=_setup_context)


# Never dead code: a Function may be called for its side effects alone, as in eager.
torch.fx.node.has_side_effect(torch.ops.fxtrain.python_op.default)
torch.fx.node.has_side_effect(torch.ops.fxtrain.python_op_backward.default)
