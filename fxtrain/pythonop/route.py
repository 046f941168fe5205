"""Routing ``Function.apply`` to the PythonOp pair while fxtrain captures.

Dynamo turns every ``torch.autograd.Function`` subclass into an ``AutogradFunctionVariable`` and
handles ``.apply`` in its ``call_apply``, where it would inline the user's forward (breaking the graph
on numpy, ``.item()`` and the like) and rebuild a backward of its own. While a TrainModule captures
with ``custom_autograd=True`` we answer ``call_apply`` ourselves, for every Function class, including
ones defined later or inside functions: the call becomes one ``fxtrain::python_op`` node whose key
points at a CallSpec (registry.py). Outside fxtrain's captures dynamo behaves exactly as before.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from . import op as _op  # noqa: F401  (registers the torch.library ops)
from .. import torch_private as tp
from ..capture.state import capturing
from .example import real_values
from .registry import CONSTANT, DETACHED, TENSOR, CallSpec, qualified_name, register
from ..errors import Error

logger = logging.getLogger("fxtrain")

_state = threading.local()
AutogradFunctionVariable = tp.autograd_function_variable()
_original_call_apply = AutogradFunctionVariable.call_apply


class _Unsupported(Error):
    """This call cannot be a PythonOp; dynamo's own handling takes it (and says why if it fails)."""


class InlineError(Error, RuntimeError):
    """``Options.custom_autograd=False`` and dynamo cannot trace this Function whole.

    Dynamo would otherwise break the graph around the Function and run it eagerly: correct, but
    the user asked for the Function inside the graph, so say which one could not be and why.
    """


def _fxtrain_options(tx: Any) -> Any:
    """The Options of the TrainModule whose capture this is, or None for anyone else's torch.compile.

    Read from the backend dynamo compiles for (unwrapping torch.compile's wrappers), so it needs
    nothing from the caller and never mistakes a user's own torch.compile for an fxtrain capture.
    """
    from ..options import Options
    fn = getattr(tx.output, "compiler_fn", None)
    for _ in range(8):
        if fn is None:
            return None
        options = getattr(fn, "options", None)
        if isinstance(options, Options):
            return options
        fn = (getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "__wrapped__", None)
              or getattr(fn, "compiler_fn", None))
    return None


def _inline(self: AutogradFunctionVariable, tx: Any, args: list, kwargs: dict) -> Any:
    """Dynamo's own handling (forward traced, the user's backward traced as the backward), or an
    error naming the Function when dynamo could only run it outside the graph."""
    Unsupported = tp.dynamo_unsupported()
    try:
        return _original_call_apply(self, tx, args, kwargs)
    except Unsupported as why:
        reason = str(why).strip().splitlines()[0] if str(why).strip() else type(why).__name__
        raise InlineError(
            f"fxtrain: Options.custom_autograd=False, but {qualified_name(self.fn_cls)} cannot be traced "
            f"into the graph (its forward or backward leaves torch: {reason}); keep custom_autograd=True "
            f"to run it as a PythonOp, or make it traceable") from None


@contextlib.contextmanager
def routing(on_python_op: Callable[[str], None]) -> Iterator[None]:
    """Route Function.apply to PythonOps for dynamo traces started inside this block."""
    previous = getattr(_state, "sink", None)
    _state.sink = on_python_op
    try:
        yield
    finally:
        _state.sink = previous


def _is_exact(value: Any) -> bool:
    if value is None or type(value) in (bool, int, float, complex, str):
        return True
    return type(value) is tuple and all(_is_exact(v) for v in value)


def _argument(tx: Any, vt: Any) -> Any:
    """The Python value of a non-tensor argument: exact scalars by value, anything else by reference.

    A reference must be the user's very object (not dynamo's reconstruction of it), so it is read
    from its source and the capture is guarded on its identity: replacing ``model.cfg`` after
    capture recaptures instead of silently running with the old object.
    """
    if vt.is_python_constant():
        try:
            value = vt.as_python_constant()
        except Exception:
            value = None
        else:
            if _is_exact(value):
                return value
    source = getattr(vt, "source", None)
    if source is None:
        raise _Unsupported(f"a {type(vt).__name__} argument created inside the traced code has no "
                           f"object to pass by reference")
    value = tx.output.resolve_source_value(source)
    tp.install_id_match_guard(source)
    return value


def _example(vt: Any) -> torch.Tensor:
    return vt.as_proxy().node.meta["example_value"]


def _shape_fn(fn_cls: type, template: List[Any], out_kinds: List[Any], single: bool,
              seen: Optional[List[Tuple[torch.Size, torch.dtype, torch.device]]]):
    """Fake outputs for given fake inputs: ``infer_shape`` if the Function has one, else its fake run,
    else the outputs its real run on the capturing call produced (sizes fixed by a guard)."""
    infer = getattr(fn_cls, "infer_shape", None)

    def run(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        if seen is not None:
            return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in seen]
        args = [tensors[v] if kind == TENSOR else v for kind, v in template]
        with capturing(), _real_tensors_as_constants(tp.detect_fake_mode(tensors)):
            if infer is not None:
                result = infer(*args)
            else:
                with torch.no_grad():
                    result = fn_cls.apply(*args)
        results = (result,) if single or isinstance(result, torch.Tensor) else tuple(result)
        return [results[i] for i, (kind, _) in enumerate(out_kinds) if kind in (TENSOR, DETACHED)]

    return run


def _trial(fn_cls: type, template: List[Any], values: Sequence[torch.Tensor],
           differentiable: Sequence[bool]) -> Tuple[List[torch.Tensor], Any]:
    """One call of the Function (or its infer_shape) to learn its output structure."""
    infer = getattr(fn_cls, "infer_shape", None)
    with torch.enable_grad(), capturing():
        # Non-leaf copies, as eager's inputs usually are: an in-place Function (ctx.mark_dirty)
        # may not modify a leaf that requires grad.
        inputs = [f.detach().requires_grad_(d) * 1 if d else f.detach() for f, d in zip(values, differentiable)]
        call_args = [inputs[v] if kind == TENSOR else v for kind, v in template]
        result = infer(*call_args) if infer is not None else fn_cls.apply(*call_args)
    return inputs, result


@contextlib.contextmanager
def _real_tensors_as_constants(mode: Any) -> Iterator[None]:
    """Let a fake run read real tensors the Function reaches on its own (a module's parameters,
    a nested TrainModule, a global table) as constants; dynamo's fake mode refuses them otherwise."""
    if mode is None:
        yield
        return
    previous = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True
    try:
        yield
    finally:
        mode.allow_non_fake_inputs = previous


def _specialise(fakes: Sequence[torch.Tensor]) -> None:
    """Guard the capture on the argument sizes it saw: shapes learnt from one real run hold for
    those sizes only, so another batch size recaptures instead of meeting a wrong shape."""
    from torch.fx.experimental.symbolic_shapes import guard_int
    for f in fakes:
        for s in (*f.shape, *f.stride()):
            if isinstance(s, torch.SymInt):
                guard_int(s)


def _build_spec(tx: Any, fn_cls: type, args: List[Any]) -> tuple:
    template, tensor_vts = [], []
    for vt in args:
        if vt.is_tensor():
            template.append((TENSOR, len(tensor_vts)))
            tensor_vts.append(vt)
        else:
            template.append((CONSTANT, _argument(tx, vt)))
    if not tensor_vts:
        raise _Unsupported("no tensor argument")
    fakes = [_example(vt) for vt in tensor_vts]
    record = torch.is_grad_enabled() and any(f.requires_grad for f in fakes)
    differentiable = [bool(record and f.requires_grad and (f.is_floating_point() or f.is_complex())) for f in fakes]
    # Output structure from a fake run, infer_shape, or else one real run on the capturing batch.
    infer = getattr(fn_cls, "infer_shape", None)
    seen = None
    try:
        with tx.output.fake_mode, _real_tensors_as_constants(tx.output.fake_mode):
            inputs, result = _trial(fn_cls, template, fakes, differentiable)
    except Exception as e:
        if infer is not None:
            raise _Unsupported(f"its infer_shape failed ({type(e).__name__}: {e})") from e
        real = real_values([vt.as_proxy().node for vt in tensor_vts])
        if real is None:
            raise _Unsupported(f"its forward cannot run on fake tensors ({type(e).__name__}: {e}), it has "
                               f"no infer_shape static method, and its arguments' real values are not "
                               f"known at capture") from e
        logger.info("fxtrain: %s cannot run on fake tensors (%s: %s): shaped by a real run on the "
                    "capturing batch, for these sizes only", qualified_name(fn_cls), type(e).__name__, e)
        _specialise(fakes)
        try:
            inputs, result = _trial(fn_cls, template, real, differentiable)
        except Exception as real_error:
            raise _Unsupported(f"its forward failed on the capturing batch ({type(real_error).__name__}: "
                               f"{real_error})") from real_error
        seen = [(r.shape, r.dtype, r.device) for r in ((result,) if not isinstance(result, tuple) else result)
                if isinstance(r, torch.Tensor)]
    single = not isinstance(result, tuple)
    for r in ((result,) if single else result):
        # apply returns the very input object only for inputs marked dirty (ctx.mark_dirty).
        if isinstance(r, torch.Tensor) and any(r is i for i in inputs):
            # Eager updates the caller's tensor in place; an opaque functional op cannot, so leave
            # the Function to dynamo, which keeps in-place semantics.
            raise _Unsupported("it modifies an input in place (ctx.mark_dirty)")
    results = (result,) if single else result
    outputs, n = [], 0
    for r in results:
        if isinstance(r, torch.Tensor):
            # ctx.mark_non_differentiable (or an integer output): detached in the graph, as in eager.
            detach = record and infer is None and not r.requires_grad
            outputs.append((DETACHED if detach else TENSOR, n)); n += 1
        elif r is None or isinstance(r, (bool, int, float, str)):
            outputs.append((CONSTANT, r))
        else:
            raise _Unsupported(f"output of type {type(r).__name__}")
    if n == 0:
        raise _Unsupported("no tensor output")
    grad_meta = [(f.dim(), f.dtype, f.device) for f, d in zip(fakes, differentiable) if d]
    spec = CallSpec(fn_cls=fn_cls, template=template, outputs=outputs, single=single,
                    differentiable=differentiable, record=record,
                    shape_fn=_shape_fn(fn_cls, template, outputs, single, seen), grad_meta=grad_meta,
                    seen=seen)
    return spec, tensor_vts


def _make_call(key: int, outputs: List[Any], single: bool) -> Callable[..., Any]:
    def fxtrain_python_op(*tensors: torch.Tensor) -> Any:
        outs = torch.ops.fxtrain.python_op(key, list(tensors))
        values = tuple(outs[v] if kind == TENSOR else outs[v].detach() if kind == DETACHED else v
                       for kind, v in outputs)
        return values[0] if single else values
    return fxtrain_python_op


def _call_apply(self: AutogradFunctionVariable, tx: Any, args: list, kwargs: dict) -> Any:
    sink: Optional[Callable[[str], None]] = getattr(_state, "sink", None)
    if sink is None:
        options = _fxtrain_options(tx)
        if options is not None and not options.custom_autograd:
            return _inline(self, tx, args, kwargs)
    if sink is None or kwargs:
        return _original_call_apply(self, tx, args, kwargs)
    try:
        spec, tensor_vts = _build_spec(tx, self.fn_cls, list(args))
    except _Unsupported as why:
        logger.warning("fxtrain: %s is traced by dynamo, not kept as a PythonOp: %s",
                       qualified_name(self.fn_cls), why)
        return _original_call_apply(self, tx, args, kwargs)
    key = register(spec)
    sink(spec.name)
    call = _make_call(key, spec.outputs, spec.single)
    return tp.build_variable(tx, call).call_function(tx, tensor_vts, {})


def install() -> None:
    """Install the routing hook once (it does nothing outside ``routing()`` blocks)."""
    AutogradFunctionVariable.call_apply = _call_apply
