"""Python's own call of ``apply`` on the capturing step takes the run the capture already made of it.

The capture runs a Function for real when dynamo cannot trace its forward (pending.py), and only
then may learn that the graph cannot hold the call: it returned a ``str`` or another object, or it
raised. Dynamo then breaks the graph there and the frame's code calls ``Fn.apply`` in Python, after
the graph above it ran; or dynamo gives the whole frame up (a graph break inside a ``try`` block) and
the frame runs as plain Python; or the capture fails later on and TrainModule reruns the step
eagerly. In each, Python calls ``apply`` again with the same arguments on the same values: run again,
the forward's side effects would happen twice on that step, and a stateful forward would return
another result than eager's one call does.

So for the rest of the TrainModule's call that made it (``pending.forget`` ends it), a kept outcome is
*offered*: while any is, the Function class resolves ``apply`` to ``_apply``, which takes an
offered outcome of this thread when the call is that call (same class, same argument structure
and constants, same tensor values, as the graph's op checks with ``PendingRun.matches``):

- an exception: raised again, the very object, so the model's ``except`` gets what eager's call
  raised and the forward is not run a second time;
- a result: handed over through the call's op (``route.make_call``, run here as plain Python under
  the caller's autograd), which takes the kept run exactly as the graph would: the model gets the
  same objects (tensors connected to its own inputs, whose backward runs the user's backward through
  the kept node; Python values, a ``str`` included, as the run returned them), and the lists the
  traced code passed get what the forward put in them.

Anything else (another thread, other values, a class that defines its own ``apply``) goes to
torch's ``Function.apply`` unchanged. The graph's op calls ``apply`` too, but it takes its own kept
run before (pending.claim); should it call it with the values of another call's kept run (two calls
of the Function on equal values), that run is of an identical call, so each call still runs once. The class attribute exists only while an outcome is offered:
dynamo never reads it (it routes ``.apply`` by name to ``call_apply``, route.py), and every other
call in that window pays one dictionary lookup.
"""
from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import torch_private as tp
from ..errors import Error
from .registry import CONSTANT, DICT, LIST, SCALAR, SPECS, TENSOR, TUPLE, Node
from .structure import scalar_type

# torch's own ``Function.apply`` as the class stores it: a ``classmethod`` up to 2.13, a C
# ``classmethod_descriptor`` from 2.14. Both are descriptors; ``__get__(None, cls)`` binds either to a
# class the same way, so nothing here depends on how torch implements it
# (tests/test_pythonop.py calls it on every release the suite runs on).
_FUNCTION_APPLY = torch.autograd.Function.__dict__["apply"]
_lock = threading.Lock()
_patched: Dict[type, int] = {}   # class -> outcomes offered for it, in all threads
_local = threading.local()       # .offers: class -> this thread's offered PendingRuns
_UNSET = object()


class _NoMatch(Error):
    """This call is not the kept run's call (control flow inside this module, never raised out)."""


def _patchable(fn_cls: type) -> bool:
    """A class that does not bring an ``apply`` of its own (we would have to call it in our place)."""
    own = fn_cls.__dict__.get("apply")
    if own is not None:
        return own is _APPLY
    return inspect.getattr_static(fn_cls, "apply", None) in (_FUNCTION_APPLY, _APPLY)


def offer(run: Any, key: int) -> None:
    """Let a Python call of the class take ``run`` (a PendingRun), through spec ``key``'s op."""
    run.key = key
    if run.offered is not None:
        return
    fn_cls = SPECS[key].fn_cls
    if not _patchable(fn_cls):
        return
    offers = getattr(_local, "offers", None)
    if offers is None:
        offers = _local.offers = {}
    runs = offers.setdefault(fn_cls, [])
    runs.append(run)
    run.offered = (fn_cls, runs)
    with _lock:
        n = _patched.get(fn_cls, 0)
        if n == 0:
            fn_cls.apply = _APPLY
        _patched[fn_cls] = n + 1


def withdraw(run: Any) -> None:
    """``run`` was taken or dropped (by any thread): it is no longer offered."""
    offered, run.offered = run.offered, None
    if offered is None:
        return
    fn_cls, runs = offered
    for i, r in enumerate(runs):
        if r is run:
            del runs[i]
            break
    with _lock:
        n = _patched[fn_cls] - 1
        if n:
            _patched[fn_cls] = n
        else:
            del _patched[fn_cls]
            del fn_cls.apply


def _same_constant(value: Any, expected: Any) -> bool:
    if type(value) is not type(expected):
        return False
    if type(expected) is tuple:
        return len(value) == len(expected) and all(_same_constant(v, e) for v, e in zip(value, expected))
    if type(expected) in (float, complex) and value != value:
        return expected != expected
    return value == expected


def _bind(node: Node, value: Any, slots: List[Any], containers: List[Any], top: bool) -> None:
    """Walk an argument of this call next to the capture's node for it: the op's slots get this
    call's tensors and numbers; anything else must be what the capture saw."""
    kind, payload = node
    if kind == TENSOR:
        if not isinstance(value, torch.Tensor) or (slots[payload] is not _UNSET and slots[payload] is not value):
            raise _NoMatch
        slots[payload] = value
    elif kind == SCALAR:
        index, pytype, _ = payload
        if isinstance(value, torch.Tensor) or scalar_type(value) is not pytype:
            raise _NoMatch
        slots[index] = value
    elif kind == CONSTANT:
        exact = payload is None or type(payload) in (bool, int, float, complex, str, tuple)
        if not (_same_constant(value, payload) if exact else value is payload):
            raise _NoMatch
    elif kind in (LIST, TUPLE):
        if type(value) is not (list if kind == LIST else tuple) or len(value) != len(payload):
            raise _NoMatch
        for child, v in zip(payload, value):
            _bind(child, v, slots, containers, top=False)
        if kind == LIST and top:
            containers.append(value)
    elif kind == DICT:
        if type(value) is not dict or list(value) != [k for k, _ in payload]:
            raise _NoMatch
        for k, child in payload:
            _bind(child, value[k], slots, containers, top=False)
        if top:
            containers.append(value)
    else:
        raise _NoMatch


def _this_call(run: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[Tuple[List[Any], List[Any]]]:
    """The arguments ``route.make_call``'s function takes for this call, if it is ``run``'s call."""
    values = run.values
    spec = SPECS.get(run.key)
    if values is None or spec is None or len(args) != len(spec.args) or set(kwargs) != set(spec.kwargs):
        return None
    slots: List[Any] = [_UNSET] * len(spec.convert)
    containers: List[Any] = []
    try:
        for node, value in zip(spec.args, args):
            _bind(node, value, slots, containers, top=True)
        for name, node in spec.kwargs.items():
            _bind(node, kwargs[name], slots, containers, top=True)
    except _NoMatch:
        return None
    call, tensors = [], []
    for i, (value, dtype) in enumerate(zip(slots, spec.convert)):
        if value is _UNSET:
            return None
        if not isinstance(value, torch.Tensor):   # a number: the op gets it as a 0-d tensor
            as_tensor = torch.scalar_tensor(value, dtype=dtype or values[i].dtype)
            tensors.append(as_tensor)
            call.append(value if dtype is not None else as_tensor)
        else:
            tensors.append(value)
            call.append(value)
    return (call, containers) if run.matches(tensors) else None


_NOT_KEPT = object()
# route.make_call, registered by route.py (which imports this module): the op a kept result is handed
# over through. Passed up rather than imported, so that the package's files import in one direction.
_call_maker: Optional[Callable[..., Callable[..., Any]]] = None


def use_call_maker(make_call: Callable[..., Callable[..., Any]]) -> None:
    global _call_maker
    _call_maker = make_call


@torch.compiler.disable
def _take(runs: List[Any], args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """The kept outcome of this call, or ``_NOT_KEPT``. Dynamo is off here: this is fxtrain's code,
    not the model's (the op's kernels run as plain Python)."""
    make_call = _call_maker
    assert make_call is not None, "route.py registers its call maker on import"
    for run in runs:
        this = _this_call(run, args, kwargs)
        if this is None:
            continue
        error = run.error
        if error is not None:
            run.drop()
            _local.raised = error
            raise error
        spec = SPECS[run.key]
        if spec.pending is None:   # a run a graph made on this step (pending.offer_step): the op takes it
            spec.pending = run
        call, containers = this
        return make_call(run.key, spec, spec.convert)(*call, *containers)
    return _NOT_KEPT


def raised_as_eager(error: BaseException) -> bool:
    """Whether ``error`` is a kept exception a Python call of apply raised again on this thread's
    capturing step: eager's own call raised it there, so a step that ends with it is eager's."""
    return getattr(_local, "raised", None) is error


def forget_raised() -> None:
    _local.raised = None


def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``Fn.apply`` while an outcome of ``Fn`` is offered (see the module docstring)."""
    offers = getattr(_local, "offers", None)
    runs = offers.get(cls) if offers else None
    if runs:
        out = _take(runs, args, kwargs)
        if out is not _NOT_KEPT:
            return out
    return _FUNCTION_APPLY.__get__(None, cls)(*args, **kwargs)


# Dynamo's frame converter leaves this frame alone (it is not the model's code) but still converts
# the user's forward that it calls, as it would without it.
_APPLY = classmethod(tp.dynamo_skip_frames(apply))
