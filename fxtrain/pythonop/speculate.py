"""A Function's outputs (structure, dtypes, symbolic sizes) from dynamo's trace of its forward.

The graph needs the outputs' metadata before anything runs. Running ``forward`` on fake tensors
would run the user's code: whatever it does besides computing (append to a list, bump a counter,
log, cache) would then happen on fake tensors, once per trace. Dynamo's trace does not run it: it
interprets the bytecode, records effects instead of doing them, and refuses effects on anything
outside the traced call. Tracing ``forward`` in a throwaway subgraph (``torch_private.speculate``)
therefore gives the outputs with sizes in the capture's symbols (one graph for every batch size),
and proves on the way that the forward touches nothing but its own ctx and results. A forward it
refuses (side effects, numpy, code it cannot trace) is shaped by its real run instead (route.py).

The forward sees a stand-in ctx (``_ShapeCtx``): dynamo's own ctx variable refuses
``set_materialize_grads`` and anything else but three methods, and the marks are all we read.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import Error
from .. import torch_private as tp
from .registry import CONSTANT, DETACHED, INPUT, SCALAR, SCALAR_DTYPES, TENSOR, TUPLE, Node, OutputMeta


class NotTraced(Error):
    """Dynamo's trace of the forward cannot give the outputs (the reason is the message);
    ``side_effects``: it refused because the forward changes state outside the call."""

    def __init__(self, message: str, side_effects: bool = False) -> None:
        super().__init__(message)
        self.side_effects = side_effects


class _ShapeCtx:
    """What forward and setup_context may call on ctx while dynamo traces them for shapes."""

    def __init__(self, needs_input_grad: Tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: Tuple[Any, ...] = ()
        self.dirty: Tuple[Any, ...] = ()
        self.non_differentiable: Tuple[Any, ...] = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors

    def mark_dirty(self, *tensors: Any) -> None:
        self.dirty = tensors

    def mark_non_differentiable(self, *tensors: Any) -> None:
        self.non_differentiable = tensors

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


def _shape_run(new_style: bool, needs_input_grad: Tuple[bool, ...]) -> Any:
    """The function dynamo traces: forward (and setup_context) as apply calls them, under no_grad,
    returning the result and, per returned element, which input it is and whether it was marked
    dirty or non-differentiable (identity is only known inside the trace).

    The Function class comes in as an argument, dynamo's variable for it, which knows where the
    class comes from: what ``forward`` reaches through its closure (a list it appends to) then has
    a source too, and dynamo refuses to change it. Reached through a closure of this function, it
    would be dynamo's copy of the list, which it lets the trace change without a word."""

    def fxtrain_shape_run(fn_cls: Any, *args: Any) -> Any:
        forward = fn_cls.forward
        setup = fn_cls.setup_context
        ctx = _ShapeCtx(needs_input_grad)
        with torch.no_grad():
            if new_style:
                out = forward(*args)
                setup(ctx, args, out)
            else:
                out = forward(ctx, *args)
        outs = out if type(out) is tuple else (out,)
        alias = []
        dirty = []
        nondiff = []
        for o in outs:
            which = -1
            for i in range(len(args)):
                if o is args[i]:
                    which = i
            alias.append(which)
            marked = False
            for d in ctx.dirty:
                if o is d:
                    marked = True
            dirty.append(marked)
            marked = False
            for n in ctx.non_differentiable:
                if o is n:
                    marked = True
            nondiff.append(marked)
        return out, tuple(alias), tuple(dirty), tuple(nondiff)

    return fxtrain_shape_run


@dataclass
class Traced:
    result: Node
    meta: List[OutputMeta]
    dirty: List[Tuple[int, int]] = field(default_factory=list)


def bind(fn_cls: type, args: List[Any], kwargs: Dict[str, Any], default: Any) -> Optional[List[Any]]:
    """apply's positional arguments after binding keyword ones as eager's apply does for a new-style
    Function (``inspect.signature(forward).bind``, defaults applied); None where eager's binding is
    not a plain positional list (old-style forward with keywords, keyword-only parameters: eager
    then decides, and the real run says what it does). ``default(value)`` makes a default's variable."""
    if not kwargs:
        return list(args)
    if not tp.setup_context_defined(fn_cls):
        return None
    try:
        sig = inspect.signature(fn_cls.forward)
        if any(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in sig.parameters.values()):
            return None
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    out = []
    for name, p in sig.parameters.items():
        if name in bound.arguments:
            out.append(bound.arguments[name])
        else:
            out.append(default(p.default))
    return out


def trace_forward(tx: Any, fn_cls: type, fn_cls_vt: Any, arg_vts: Sequence[Any], tensor_index: Dict[int, int],
                  record: bool, differentiable: Sequence[bool]) -> Traced:
    """Outputs of ``fn_cls.apply(*arg_vts)`` from dynamo's trace of its forward (``fn_cls_vt``:
    dynamo's variable for the class, with its source).

    ``tensor_index``: id of a tensor argument's variable -> its index in the op's tensor list."""
    if getattr(fn_cls_vt, "source", None) is None:
        raise NotTraced("a Function class dynamo cannot name (what its forward reaches could not be watched)")
    needs = tuple(bool(vt.is_tensor() and differentiable[tensor_index[id(vt)]]) if id(vt) in tensor_index
                  else False for vt in arg_vts)
    fn_vt = tp.build_variable(tx, _shape_run(tp.setup_context_defined(fn_cls), needs))
    try:
        out = tp.speculate(tx, fn_vt, [fn_cls_vt, *arg_vts])
    except tp.dynamo_restart_errors():
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise NotTraced(f"{type(e).__name__}: {first}", tp.refused_for_side_effects(e)) from None
    parts = tp.sequence_items(out)
    if parts is None or len(parts) != 4:
        raise NotTraced("unexpected trace output")
    value_vt = parts[0]
    alias, dirty, nondiff = (p.as_python_constant() for p in parts[1:])
    top = tp.sequence_items(value_vt) if value_vt.python_type() is tuple else None
    leaves = top if top is not None else [value_vt]
    meta: List[OutputMeta] = []
    dirty_out: Dict[int, int] = {}
    nodes: List[Node] = []
    for vt, which, is_dirty, is_nondiff in zip(leaves, alias, dirty, nondiff):
        if vt.is_tensor() and tp.symbolic_scalar_type(vt) is None:
            fake = vt.as_proxy().node.meta.get("example_value")
            if not isinstance(fake, torch.Tensor):
                raise NotTraced("a tensor output without metadata")
            if tp.free_unbacked_symbols(fake):
                raise NotTraced("an output whose size depends on data")
            if which >= 0 and is_dirty:
                i = tensor_index.get(id(arg_vts[which]))
                if i is None:
                    raise NotTraced("a dirty output that is not a tensor argument")
                if i not in dirty_out:
                    dirty_out[i] = len(meta)
                    meta.append(OutputMeta(fake.dtype, fake.device, fake=fake))
                nodes.append((INPUT, i))
                continue
            j = len(meta)
            meta.append(OutputMeta(fake.dtype, fake.device, fake=fake))
            differentiable_out = record and not is_nondiff and (fake.is_floating_point() or fake.is_complex())
            nodes.append((TENSOR if differentiable_out else DETACHED, j))
            continue
        kind = tp.symbolic_scalar_type(vt)
        if kind is not None:
            # A number the trace only knows symbolically: the real call's value, every call.
            j = len(meta)
            meta.append(OutputMeta(SCALAR_DTYPES[kind], torch.device("cpu"), sizes=[]))
            nodes.append((SCALAR, (j, kind)))
            continue
        if vt.is_python_constant():
            value = vt.as_python_constant()
            if value is None or type(value) in (bool, int, float, complex, str):
                # A constant of the trace: dynamo guarded whatever it was computed from.
                nodes.append((CONSTANT, value))
                continue
        raise NotTraced(f"an output dynamo sees as {type(vt).__name__}")
    result = (TUPLE, nodes) if top is not None else nodes[0]
    return Traced(result, meta, sorted(dirty_out.items()))
