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

import itertools
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .registry import SPECS, TENSOR

_lock = threading.Lock()
_handles = itertools.count(1)
POOL: Dict[int, Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}
# The handle is host-side bookkeeping read with int(): keeping it on the host avoids a device sync.
_HOST = torch.device("cpu")


class _Copy(torch.autograd.Function):
    """A recorded copy. Inside a custom op the dispatcher skips autograd, so a plain ``clone()``
    would not be differentiable; a Function's apply records its node regardless."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


def _forget(handle: int) -> None:
    POOL.pop(handle, None)


def _shares_storage(t: torch.Tensor, inputs: Sequence[torch.Tensor]) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return any(ptr == i.untyped_storage().data_ptr() for i in inputs if i.device == t.device)


@torch.library.custom_op("fxtrain::python_op", mutates_args=())
def python_op(key: int, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    spec = SPECS[key]
    if spec.record:
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(d) for t, d in zip(tensors, spec.differentiable)]
            # A Function that modifies and returns its input (ctx.mark_dirty) gets non-leaf copies:
            # autograd forbids in-place updates of leaves, and the op itself must stay functional.
            work = [_Copy.apply(i) if spec.copy_inputs and d else i for i, d in zip(inputs, spec.differentiable)]
            result = spec.fn_cls.apply(*spec.arguments(work))
    else:
        inputs = [t.clone() if spec.copy_inputs else t for t in tensors]
        with torch.no_grad():
            result = spec.fn_cls.apply(*spec.arguments(inputs))
    results = (result,) if spec.single else tuple(result)
    outs = [results[i] for i, (kind, _) in enumerate(spec.outputs) if kind == TENSOR]
    # A custom op may not return its inputs or views of them: copy only those.
    returned = [o.detach().clone() if _shares_storage(o, tensors) else o.detach() for o in outs]
    handle_id = 0
    if spec.record and any(o.requires_grad for o in outs):
        with _lock:
            handle_id = next(_handles)
        POOL[handle_id] = (inputs, outs)
    handle = torch.tensor(handle_id, dtype=torch.int64, device=_HOST)
    if handle_id:
        weakref.finalize(handle, _forget, handle_id)
    return returned + [handle]


@python_op.register_fake
def _python_op_fake(key: int, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    spec = SPECS[key]
    outs = spec.shape_fn(tensors)
    return [torch.empty_like(o) for o in outs] + [torch.empty((), dtype=torch.int64, device=_HOST)]


@torch.library.custom_op("fxtrain::python_op_backward", mutates_args=())
def python_op_backward(key: int, handle: torch.Tensor, grads: List[Optional[torch.Tensor]],
                       sizes: List[int]) -> List[torch.Tensor]:
    spec = SPECS[key]
    entry = POOL.pop(int(handle), None)
    if entry is None:
        raise RuntimeError(f"fxtrain: the forward state of {spec.name} is gone: was backward called twice "
                           f"on a graph that was not retained?")
    inputs, outs = entry
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    wanted = [i for i, d in zip(inputs, spec.differentiable) if d]
    result: List[Optional[torch.Tensor]] = [None] * len(wanted)
    if pairs and wanted:
        with torch.enable_grad():
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
