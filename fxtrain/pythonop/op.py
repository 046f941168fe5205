"""The opaque op pair a captured ``Function.apply`` becomes: ``fxtrain::python_op`` (forward graph)
and ``fxtrain::python_op_backward`` (backward graph).

At run time the forward op calls the user's real ``apply`` on detached copies of its inputs with
autograd recording, so torch itself builds the Function's node and ctx exactly as in eager
(``needs_input_grad``, ``save_for_backward``, ``mark_non_differentiable``, ``set_materialize_grads``,
``setup_context``, ``once_differentiable`` all behave as usual). The backward op runs the user's
real ``backward`` through that node: it calls the node itself, as the engine would, for a plain call
(``_direct_backward``; a nested engine run costs more than the rest of the pair), and runs the engine
otherwise. Between the two, the node and its
inputs wait in a pool under an integer handle that the graph carries as a 0-d int64 tensor; the pool
entry goes when the backward ran or when the handle tensor is freed (no backward ever came).

The handle always lives on the CPU, whatever device the data is on: reading it back is never a
device-to-host synchronisation.

A call whose capture ran the Function for real (one dynamo could not trace) takes that run the
first time the graph runs it (pending.py), so the step's forward runs once. Calls that are more than
positional tensors and constants in, tensors out (structure.py: keyword arguments, containers,
Python numbers returned, inputs updated in place) rebuild their arguments and collect their
outputs from the spec's trees; the plain ones keep the flat per-call path. Inside a TrainModule
call each call's run (or what it raised) goes to the call's log (pending.offer_step): a forward
that raises inside a graph is then raised again where the model's own code calls it, in the eager
rerun of that step, which takes the other calls' runs instead of running them again.

Cost. Both ops run once per Function call per step, so their dispatch is kept lean: the ops are
declared with ``torch.library.custom_op`` (torch then knows them as custom ops: fake kernels, the
profiler's ``OPDEFS`` lookup), but their CompositeExplicitAutograd and Autograd kernels are replaced
by plain functions, without custom_op's Python wrappers (``backend_impl``/``wrapped_fn``/
``autograd_impl``, about 20 us per call). The Autograd kernel of ``python_op`` goes straight to the
kernel below when no gradient is wanted (the aten replay, where AOTAutograd's node owns the
gradient); when one is wanted it applies the user's Function itself on plain tensors (the graph run
under eager autograd: ``_apply_eagerly``, which that graph calls without the dispatcher:
``calling_directly``) and ``_Formula``, the op's autograd formula
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
from ..capture_state import capturing, real_step
from ..torch_private import (AFTER_AUTOGRAD_KEYSET, DispatchKey, DispatchKeySet, ForceDispatchKeyGuard,
                             any_requires_grad, current_graph_task_keeps_graph, dispatch_mode_depth,
                             dispatch_tls_exclude_set, dispatch_tls_include_set, is_grad_enabled,
                             set_grad_enabled)
from . import pending as _pending
from .pending import Run
from .registry import CONSTANT, SPECS, CallSpec
from .structure import Mismatch, collect, rebuild_call

_lock = threading.Lock()
_handles = itertools.count(1)
# handle -> (inputs, outputs, weakref to the handle tensor whose death drops the entry, the Function's
# node when the backward op may call it directly)
POOL: Dict[int, Tuple[List[torch.Tensor], List[torch.Tensor], Any, Any]] = {}
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


def _repeated(o: torch.Tensor, outs: Sequence[torch.Tensor], k: int) -> bool:
    for earlier in outs[:k]:
        if earlier is o:
            return True
    return False


def _shares_storage(t: torch.Tensor, inputs: Sequence[torch.Tensor]) -> bool:
    ptr = t.untyped_storage().data_ptr()
    if not ptr:   # fake tensors (the profiler's fake step) all report 0: compare the storages themselves
        key = t.untyped_storage()._cdata
        return any(key == i.untyped_storage()._cdata for i in inputs if i.device == t.device)
    return any(ptr == i.untyped_storage().data_ptr() for i in inputs if i.device == t.device)


def _new_handle(handle_id: int) -> torch.Tensor:
    """The handle tensor, on the CPU whatever the data's or the default device."""
    if dispatch_mode_depth():
        # Under a dispatch mode (the profiler's fake run): fake mode keeps the value of a tensor made
        # by torch.tensor from a Python number as a constant, so int() can read it back.
        return torch.tensor(handle_id, dtype=torch.int64, device=_CPU)
    return torch.scalar_tensor(handle_id, dtype=torch.int64, device=_CPU)  # a third of torch.tensor's cost


# The handle of a call under eager autograd (``_apply_eagerly``): no pool entry, so nothing ever reads
# it; one tensor serves every such call, as making one costs 3 us on the 2-core CPU, a tenth or more
# of that mode's extra cost per call of a tiny Function (bench/pythonop_overhead.py, "autograd").
# The op's own kernels, whose outputs tracers and compilers see, keep a fresh one per call (an op may
# not return one tensor twice).
_NO_HANDLE = torch.scalar_tensor(0, dtype=torch.int64, device=_CPU)


def _outputs(spec: Any, result: Any, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The Function's tensor outputs (a plain spec: tensors and constants), refused where a PythonOp
    cannot reproduce them."""
    if spec.single:
        outs = [result] if spec.outputs[0][0] != CONSTANT else []
    else:
        outs = [result[i] for i, (kind, _) in enumerate(spec.outputs) if kind != CONSTANT]
    for o in outs:  # apply hands back an input only when marked dirty
        for i in inputs:
            if o is i:
                raise RuntimeError(f"fxtrain: {spec.name} modified an input in place (ctx.mark_dirty), which it did "
                                   f"not do on the capturing call; a Function must mark the same inputs dirty "
                                   f"on every call")
    if spec.checks:
        _check_sizes(spec, outs, inputs)
    return outs


def expected_sizes(sizes: List[Any], tensors: Sequence[torch.Tensor]) -> List[Any]:
    return [tensors[s[0]].shape[s[1]] if type(s) is tuple else s for s in sizes]


def _check_sizes(spec: Any, outs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
    """Outputs shaped by the capturing call's real run: each size is a constant or follows an input's
    size, as that run showed; another relation (a length that depends on data) is one the graph
    cannot follow, so it is an error rather than a wrong shape downstream."""
    for j, sizes, dtype in spec.checks:
        o = outs[j]
        expected = expected_sizes(sizes, inputs)
        if list(o.shape) != expected or o.dtype != dtype:
            raise RuntimeError(f"fxtrain: {spec.name} returned a {o.dtype} tensor of shape {tuple(o.shape)} where "
                               f"the graph expects {dtype} {tuple(expected)}, as its run on the capturing call "
                               f"showed; give it an infer_shape static method or make its output shape depend on "
                               f"its inputs' sizes only")


def collect_outputs(spec: CallSpec, run: Run) -> List[torch.Tensor]:
    """The op's outputs of a call (any spec), in the order the capture numbered them."""
    if spec.plain:
        return _outputs(spec, run.result, run.inputs)
    outs: List[Any] = [None] * spec.n_out
    for i, j in spec.dirty:
        outs[j] = run.call_inputs[i]
    try:
        collect(spec.result, run.result, outs, run.call_inputs)
        for k, node in spec.writes:
            collect(node, run.containers[k], outs, run.call_inputs)
    except Mismatch as e:
        raise RuntimeError(f"fxtrain: {spec.name} returned {e}; the graph holds what the capturing call "
                           f"returned, so a Function must return the same structure on every call") from None
    if spec.checks:
        _check_sizes(spec, outs, run.inputs)
    return outs


def _call_inputs(spec: CallSpec, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
    """What apply receives: an input the Function updates in place (ctx.mark_dirty) is a copy of its
    own, as eager's is the caller's tensor: the op's inputs belong to the graph (a functional op
    must not change them), and the graph writes the new value back where eager would see it."""
    if not spec.dirty_inputs:
        return inputs
    return [t.clone() if k in spec.dirty_inputs else t for k, t in enumerate(inputs)]


def _apply(spec: CallSpec, call_inputs: List[torch.Tensor]) -> Tuple[Any, Sequence[Any]]:
    if spec.plain:
        return spec.fn_cls.apply(*spec.arguments(call_inputs)), ()
    args, kwargs, containers = rebuild_call(spec.args, spec.kwargs, call_inputs)
    return spec.fn_cls.apply(*args, **kwargs), containers


def _run(spec: CallSpec, tensors: List[torch.Tensor]) -> Run:
    """One real call of the Function on the op's inputs, with autograd recording when the capture
    did (torch then builds the Function's node and ctx exactly as in eager)."""
    if spec.record:
        state = _enter_user_autograd()
        try:
            inputs = [t.detach().requires_grad_(d) for t, d in zip(tensors, spec.differentiable)]
            call_inputs = _call_inputs(spec, inputs)
            result, containers = _apply(spec, call_inputs)
        finally:
            _exit_user_autograd(state)
    else:
        inputs = list(tensors)
        with torch.no_grad():
            call_inputs = _call_inputs(spec, inputs)
            result, containers = _apply(spec, call_inputs)
    return Run(inputs, call_inputs, result, containers)


def run_at_capture(fn_cls: type, args: List[Any], kwargs: Dict[str, Any], values: List[torch.Tensor],
                   differentiable: List[bool], record: bool) -> Run:
    """The capturing call's real run of a Function dynamo cannot trace: the step's own run, made
    early for its outputs' structure and shapes (pending.py hands it to the graph's first run).

    It runs as at step time, not as a capture: ``fxtrain.is_capturing()`` and
    ``torch.compiler.is_compiling()`` are false, no fake mode or tracer is active, and a TrainModule
    the Function calls runs eagerly (it cannot capture while this one does). Every input is a copy of
    the capturing values, as the Function may update any of them in place (ctx.mark_dirty), which
    is only known afterwards; differentiable ones are non-leaves, as eager's usually are (an in-place
    update of a leaf that requires grad is an error). The run keeps, per list or dict built for
    the call, its items before the call (``Run.before``), and the random generators' states around
    it if it drew from them (``Run.rng``)."""
    devices = sorted({v.device for v in values if v.device.type == "cuda"}, key=str)
    rng_before = _pending.rng_states(devices)
    with tp.unset_fake_temporarily(), tp.disable_current_modes(), tp.outside_compile(), real_step():
        state = _enter_user_autograd() if record else None
        try:
            with torch.no_grad():
                leaves = [v.detach().clone() for v in values]
            if record:
                inputs = [leaf.requires_grad_(d) for leaf, d in zip(leaves, differentiable)]
                call_inputs = [i * 1 if d else i for i, d in zip(inputs, differentiable)]
            else:
                inputs = call_inputs = leaves
            pos, kw, containers = rebuild_call(args, kwargs, call_inputs)
            before = [list(c) if type(c) is list else dict(c) for c in containers]
            if record:
                result = fn_cls.apply(*pos, **kw)
            else:
                with torch.no_grad():
                    result = fn_cls.apply(*pos, **kw)
        finally:
            if state is not None:
                _exit_user_autograd(state)
    run = Run(inputs, call_inputs, result, containers, before)
    rng_after = _pending.rng_states(devices)
    if not _pending.same_states(rng_before, rng_after):
        # The graph has not run yet: put the generators back for it, and let the op move them past
        # these draws when it takes this run (pending.claim).
        _pending.set_rng_states(devices, rng_before)
        run.rng = (rng_before, rng_after)
    return run


@torch.library.custom_op("fxtrain::python_op", mutates_args=())
def python_op(key: int, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    spec = SPECS[key]
    log = _pending.state.log
    if spec.plain and spec.pending is None and not _pending.state.evaluating:
        # The per-step path (positional tensors and constants in, tensors out): no tree.
        try:
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
        except Exception as e:
            if log is not None:
                log.append((key, tensors, None, e))
            raise
        if log is not None:
            log.append((key, tensors, Run(inputs, inputs, result, ())))
        outs = _outputs(spec, result, inputs)
    else:
        run = None
        if spec.pending is None and _pending.state.evaluating:
            _pending.look_up(spec, tensors)
        if spec.pending is not None:
            run = _pending.claim(spec, tensors)
        if run is None:
            try:
                run = _run(spec, tensors)
            except Exception as e:
                if log is not None and not _pending.state.evaluating:
                    log.append((key, tensors, None, e))
                raise
            if _pending.state.evaluating:
                _pending.keep(spec, key, tensors, run)
        if log is not None and not _pending.state.evaluating:
            log.append((key, tensors, run))
        inputs = run.inputs
        outs = collect_outputs(spec, run)
    # A custom op may not return its inputs or views of them, nor one tensor twice: copy only those.
    shares = _shares_storage
    returned = [o.detach().clone() if shares(o, tensors) or _repeated(o, outs, k) else o.detach()
                for k, o in enumerate(outs)]
    for j, _, _ in spec.checks:
        # Shaped by a real run, the graph's fake output is contiguous: a code generator that reads
        # its layout from there (inductor) must get that layout.
        returned[j] = returned[j].contiguous()
    if spec.record and any(o.requires_grad for o in outs):
        with _lock:
            handle_id = next(_handles)
        handle = _new_handle(handle_id)
        # The entry holds the weak reference, so its callback dies with the entry once the backward ran.
        POOL[handle_id] = (inputs, outs, weakref.ref(handle, _forget(handle_id)),
                           _own_node(spec, outs) if spec.direct else None)
    else:
        handle = _new_handle(0)
    returned.append(handle)
    return returned


def fake_outputs(spec: CallSpec, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """The op's outputs' metadata, without running the Function: ``infer_shape`` (the user's own
    shape function), or what the capture learnt from dynamo's trace or the real run."""
    if spec.infer is not None:
        args, kwargs, _ = rebuild_call(spec.args, spec.kwargs, tensors)
        with capturing():
            result = spec.infer(*args, **kwargs)
        outs: List[Any] = [None] * spec.n_out
        for i, j in spec.dirty:
            outs[j] = tensors[i]
        try:
            collect(spec.result, result, outs, tensors)
        except Mismatch as e:
            raise RuntimeError(f"fxtrain: {spec.name}.infer_shape returned {e}") from None
        return [torch.empty_like(o) for o in outs]
    out = []
    for m in spec.meta:
        if m.fake is not None:
            out.append(torch.empty_strided(m.fake.shape, m.fake.stride(), dtype=m.dtype, device=m.device))
        else:
            out.append(torch.empty(expected_sizes(m.sizes, tensors), dtype=m.dtype, device=m.device))
    return out


@python_op.register_fake
def _python_op_fake(key: int, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    return fake_outputs(SPECS[key], tensors) + [torch.empty((), dtype=torch.int64, device=_CPU)]


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
    inputs, outs, _, node = entry
    if node is not None and all(g is not None for g in grads) and not torch.is_anomaly_enabled() \
            and not tp.profiler_enabled():
        wanted = [i for i, d in zip(inputs, spec.differentiable) if d]
        return _finish_grads(key, _direct_backward(spec, node, grads, inputs), wanted, grads)
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
    return _finish_grads(key, result, wanted, grads)


class _AbsentLog(threading.local):
    entries: Optional[set] = None


_absent = _AbsentLog()


def log_absent_gradients(entries: Optional[set]) -> Optional[set]:
    """Collect into ``entries``, until the next call, ``(key, k)`` for every gradient output k of
    a ``python_op_backward`` call for which the user's backward gave no gradient (None); returns
    the set collected into before, to be restored.

    The op must return a tensor there, so it returns zeros; but eager leaves such an input without
    a gradient (``.grad`` stays None, which AdamW tells from zeros: it skips the parameter instead
    of decaying it). Whoever runs a graph holding the op (the op's own autograd formula, a backward
    graph: ``runtime/absent_grads.py``) reads the log afterwards and turns the gradients that
    only such zeros reached back into None. Off (None) unless someone collects: no cost then."""
    previous = _absent.entries
    _absent.entries = entries
    return previous


def _finish_grads(key: int, result: Sequence[Optional[torch.Tensor]], wanted: Sequence[torch.Tensor],
                  grads: Sequence[Optional[torch.Tensor]]) -> List[torch.Tensor]:
    out = []
    for k, (g, i) in enumerate(zip(result, wanted)):
        if g is None:  # an op cannot return None: zeros, logged for whoever runs the graph
            g = torch.zeros_like(i)
            if _absent.entries is not None:
                _absent.entries.add((key, k))
        elif _shares_storage(g, [x for x in grads if x is not None]):  # nor return (a view of) one of its inputs
            g = g.clone()
        out.append(g)
    return out


def _own_node(spec: CallSpec, outs: Sequence[torch.Tensor]) -> Any:
    """The Function's autograd node, when every output comes straight from it, each at its own
    position (a tensor returned twice is one output of the node, at the later position, as eager's
    engine sees it): the backward op can then call the user's backward through the node without a
    re-entrant autograd engine run (most of a PythonOp's per-call cost), as the engine would."""
    node = None
    for o, position in zip(outs, spec.output_positions):
        fn = o.grad_fn
        if fn is None or (node is not None and fn is not node) or o.output_nr != position:
            return None
        node = fn
    return node if tp.function_class_of(node) is spec.fn_cls else None


def _direct_backward(spec: CallSpec, node: Any, grads: Sequence[torch.Tensor],
                     inputs: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    """The user's backward called through its node, as the engine calls it: grad mode off (the
    engine's, without create_graph), autograd dispatch on, a constant output's gradient None, the
    saved tensors released afterwards unless the graph is retained. What the engine then checks and
    adjusts (the number of gradients, None for constant arguments, shapes, dtypes, devices) is checked
    here; anything but the plain case goes through the engine after all (``_through_engine``), with
    the gradients already computed, so eager's errors and conversions apply and the backward still
    runs once."""
    state = _enter_user_autograd()
    set_grad_enabled(False)
    try:
        returned = node.apply(*[None if j is None else grads[j] for j in spec.grad_slots])
    finally:
        _exit_user_autograd(state)
    tp.release_saved_tensors(node)
    result = _plain_gradients(spec, returned, inputs)
    return result if result is not None else _through_engine(spec, returned, inputs)


def _plain_gradients(spec: CallSpec, returned: Any, inputs: Sequence[torch.Tensor]) -> Optional[List[Any]]:
    """The gradients of the differentiable inputs when ``returned`` is what the engine takes as is."""
    if type(returned) is not tuple:
        returned = (returned,)
    slots = spec.arg_slots
    if len(returned) < len(slots) or any(g is not None for g in returned[len(slots):]):
        return None
    summed: List[Any] = [None] * len(inputs)
    for g, i in zip(returned, slots):
        if g is None:
            continue
        if i is None or type(g) is not torch.Tensor:
            return None
        if not spec.differentiable[i]:
            continue
        t = inputs[i]
        if g.shape != t.shape or g.dtype != t.dtype or g.device != t.device or g.layout != torch.strided:
            return None
        summed[i] = g if summed[i] is None else summed[i] + g
    return [g for g, d in zip(summed, spec.differentiable) if d]


class _Returned(torch.autograd.Function):
    """Stands in for a Function whose backward already ran: its node hands the engine what that
    backward returned. Subclassed per Function under the Function's own name, so that the engine's
    errors name it as eager's do (``ScaleBackward returned an invalid gradient ...``)."""

    @staticmethod
    def forward(ctx: Any, *args: Any) -> torch.Tensor:  # type: ignore[override]
        return torch.zeros(())

    @staticmethod
    def backward(ctx: Any, _: Any) -> Any:  # type: ignore[override]
        return ctx.returned


_stand_ins: Dict[type, type] = {}


def _through_engine(spec: CallSpec, returned: Any, inputs: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    stand_in = _stand_ins.get(spec.fn_cls)
    if stand_in is None:
        stand_in = _stand_ins[spec.fn_cls] = type(spec.fn_cls.__name__, (_Returned,),
                                                  {"__qualname__": spec.fn_cls.__qualname__})
    state = _enter_user_autograd()
    try:
        leaves = [t.detach().requires_grad_(d) for t, d in zip(inputs, spec.differentiable)]
        out = stand_in.apply(*spec.arguments(leaves))
        out.grad_fn.returned = returned
        wanted = tuple(t for t, d in zip(leaves, spec.differentiable) if d)
        return list(_run_backward((out,), (torch.zeros(()),), False, False, wanted, True, False))
    finally:
        _exit_user_autograd(state)


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
    """The formula's backward: the backward op, with None (not the op's zeros) where the user's
    backward gave an input no gradient, as eager's engine sees it. (While a tracer records this,
    the op runs on fake tensors and logs nothing: the traced graph keeps the op's outputs, and
    whoever runs it reads the log: ``runtime/absent_grads.py``.)"""
    key = ctx.key
    spec = SPECS[key]
    absent: set = set()
    previous = log_absent_gradients(absent)
    try:
        computed = _BACKWARD_OP(key, ctx.handle, list(grads[:-1]), ctx.sizes)
    finally:
        log_absent_gradients(previous)
    it = iter(enumerate(computed))
    out: List[Optional[torch.Tensor]] = []
    for d in spec.differentiable:
        if not d:
            out.append(None)
            continue
        k, g = next(it)
        out.append(None if (key, k) in absent else g)
    return None, out


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


def _apply_eagerly(keyset: Any, key: int, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """python_op under eager autograd on plain tensors: the user's Function itself, on the real inputs.

    Its node then is the graph's node, exactly as in eager (retain_graph, create_graph, hooks), with
    no pool entry, no detached copies and no re-entrant backward: the opaque formula exists for
    tracers (AOTAutograd, the profiler), which must see python_op and python_op_backward. The
    capturing call's run (pending.py) is taken by the opaque formula too: its node is not built on
    these tensors.
    """
    spec = SPECS[key]
    if spec.pending is not None:
        return list(_Formula.apply(keyset, key, *tensors))
    call_inputs = _call_inputs(spec, list(tensors)) if not spec.plain else tensors
    try:
        result, containers = _apply(spec, call_inputs)
    except Exception as e:
        log = _pending.state.log
        if log is not None:
            log.append((key, tensors, None, e))
        raise
    run = Run(list(tensors), call_inputs, result, containers)
    log = _pending.state.log
    if log is not None:
        log.append((key, tensors, run))
    outs = _outputs(spec, result, tensors) if spec.plain else collect_outputs(spec, run)
    outs.append(_NO_HANDLE)
    return outs


def _python_op_autograd(keyset: Any, key: int, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    traced = (keyset & _TRACED).raw_repr()   # fake or functional tensors, a dispatch mode: keep the op opaque
    if is_grad_enabled() and any_requires_grad(tensors):
        if traced:
            return list(_Formula.apply(keyset, key, *tensors))
        return _apply_eagerly(keyset, key, tensors)
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
_FORWARD_PACKET = torch.ops.fxtrain.python_op
_BACKWARD_OP = torch.ops.fxtrain.python_op_backward.default
_redispatch_forward = tp.redispatcher(_FORWARD_OP)
_redispatch_backward = tp.redispatcher(_BACKWARD_OP)
_forward_impl = tp.custom_op_impl(python_op)
_backward_impl = tp.custom_op_impl(python_op_backward)
# The formula as custom_op metadata too (what torch reads of a custom op); the kernel below runs it.
python_op.register_autograd(_backward, setup_context=_setup_context)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def call_directly(key: int, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """``python_op`` as a graph run as plain Python under eager autograd calls it (the runtime's
    autograd mode, ``calling_directly``): the kernel the dispatcher would pick, without the
    dispatcher, whose round trip into a Python kernel costs more than a tiny Function's whole eager
    call. Anything a tracer, a mode or a tensor subclass must see (and the capturing call's kept run,
    taken by the opaque formula) still goes through the op."""
    if dispatch_mode_depth() or tp.torch_function_mode_enabled() or SPECS[key].pending is not None:
        return _FORWARD_OP(key, tensors)
    for t in tensors:
        if type(t) not in _PLAIN_TYPES or t.is_meta:
            return _FORWARD_OP(key, tensors)
    if is_grad_enabled() and any_requires_grad(tensors):
        return _apply_eagerly(None, key, tensors)
    return _forward_impl(key, tensors)


def calling_directly(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``graph`` (a torch-level graph that runs under eager autograd) whose PythonOp calls
    go to ``call_directly``; ``graph`` itself, kept for the cache and dumps, keeps the op."""
    if not any(n.target in (_FORWARD_OP, _FORWARD_PACKET) for n in graph.graph.nodes):
        return graph
    copied = torch.fx.GraphModule(graph, tp.copy_graph(graph.graph))
    for n in copied.graph.nodes:
        if n.target in (_FORWARD_OP, _FORWARD_PACKET):
            n.target = call_directly
    copied.recompile()
    return copied


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
