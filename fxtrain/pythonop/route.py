"""Routing ``Function.apply`` to the PythonOp pair while fxtrain captures.

Dynamo turns every ``torch.autograd.Function`` subclass into an ``AutogradFunctionVariable`` and
handles ``.apply`` in its ``call_apply``, where it would inline the user's forward (breaking the graph
on numpy, ``.item()`` and the like) and rebuild a backward of its own. While a TrainModule captures
with ``custom_autograd=True`` we answer ``call_apply`` ourselves, for every Function class, including
ones defined later or inside functions: the call becomes one ``fxtrain::python_op`` node whose key
points at a CallSpec (registry.py). Outside fxtrain's captures dynamo behaves exactly as before.

The spec needs what ``apply`` returns (structure, dtypes, sizes) without the user's forward running
for the capture's sake, in this order: the Function's ``infer_shape``; dynamo's trace of its forward
(speculate.py), which runs nothing; the capturing call's real run, which is that step's run
(pending.py). A call none of these can serve (an object the graph cannot carry, a forward that
raised) is not a PythonOp: dynamo breaks the graph there and Python calls ``apply`` itself, so the
model sees eager's result or error; the TrainModule's capture_info names it and says why. Where the
capture ran the Function to find that out, that Python call takes the run (python_call.py).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import operator
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from . import op as _op  # noqa: F401  (registers the torch.library ops)
from . import pending, python_call
from .. import torch_private as tp
from ..capture_state import capturing
from .example import real_values
from .op import run_at_capture
from .pending import Run
from .registry import (CONSTANT, DETACHED, DICT, LIST, NEW, SCALAR, SCALAR_DTYPES, TENSOR, TUPLE, CallSpec, Node,
                       OutputMeta, qualified_name, register)
from .speculate import NotTraced, bind, trace_forward
from .structure import Describer, Unrepresentable, build, rebuild_call
from ..errors import Error

logger = logging.getLogger("fxtrain")

_state = threading.local()
_traces = itertools.count(1)
AutogradFunctionVariable = tp.autograd_function_variable()
_original_call_apply = AutogradFunctionVariable.call_apply


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
def routing(on_python_op: Callable[..., Optional[bool]], owner: Any = None) -> Iterator[None]:
    """Route Function.apply to PythonOps for dynamo traces started inside this block.

    ``on_python_op(name)`` for each Function kept as a PythonOp, ``on_python_op(name, why)`` for
    one handed to a graph break, run by Python between two graphs; ``owner`` (the TrainModule) owns
    the real runs the captures make (pending.py)."""
    previous = getattr(_state, "sink", None)
    _state.sink = on_python_op
    try:
        with pending.session(on_python_op if owner is None else owner):
            yield
    finally:
        _state.sink = previous


class HandOff(Error):
    """The call is not a PythonOp: dynamo breaks the graph there and Python runs ``apply`` itself,
    so the model sees exactly eager's result, or eager's error (the message says why)."""


def _is_exact(value: Any) -> bool:
    if value is None or type(value) in (bool, int, float, complex, str):
        return True
    return type(value) is tuple and all(_is_exact(v) for v in value)


class _Slots:
    """The op's tensor list as dynamo variables: tensor arguments, and Python numbers the trace only
    knows symbolically (a size under dynamic shapes, a float that is a graph input), which the graph
    turns into 0-d tensors and the op back into numbers of the call."""

    def __init__(self) -> None:
        self.vts: List[Any] = []
        self.convert: List[Optional[torch.dtype]] = []   # per slot: the dtype a SymInt/SymFloat becomes
        self.hints: List[Any] = []                       # per slot: a number's capturing value, or None
        self.index: Dict[int, int] = {}                  # id(variable) -> slot, for tensors

    def tensor(self, vt: Any) -> int:
        if id(vt) in self.index:       # the same tensor twice: one input, as apply would see it
            return self.index[id(vt)]
        self.index[id(vt)] = len(self.vts)
        self.vts.append(vt)
        self.convert.append(None)
        self.hints.append(None)
        return len(self.vts) - 1

    def number(self, vt: Any, kind: type) -> int:
        self.vts.append(vt)
        # An unspecialized float or int is a 0-d tensor in the graph already.
        self.convert.append(None if vt.is_tensor() else SCALAR_DTYPES[kind])
        self.hints.append(tp.scalar_hint(vt))
        return len(self.vts) - 1


def _argument_node(tx: Any, vt: Any, slots: _Slots, containers: List[Any], top: bool) -> Node:
    """An argument of apply as a node: tensors and symbolic numbers by slot, exact scalars by
    value, objects from outside the traced code by reference (guarded on their identity), and
    lists, tuples and dicts the traced code built, rebuilt per call from their own nodes."""
    kind = tp.symbolic_scalar_type(vt)
    if kind is not None:
        i = slots.number(vt, kind)
        return (SCALAR, (i, kind, slots.hints[i]))
    if vt.is_tensor():
        made = _made_subclass(tx, vt, slots)
        return made if made is not None else (TENSOR, slots.tensor(vt))
    if vt.is_python_constant():
        try:
            value = vt.as_python_constant()
        except Exception:
            value = None
        else:
            if _is_exact(value):
                return (CONSTANT, value)
    source = getattr(vt, "source", None)
    if source is not None:
        # The user's very object (not dynamo's reconstruction of it), read from its source; replacing
        # ``model.cfg`` after capture recaptures instead of silently running with the old object.
        value = tp.resolve_source_value(tx, source)
        tp.install_id_match_guard(source)
        return (CONSTANT, value)
    items = tp.sequence_items(vt)
    if items is not None:
        container = LIST if vt.python_type() is list else TUPLE
        node = (container, [_argument_node(tx, c, slots, containers, top=False) for c in items])
        if container == LIST and top:
            containers.append(vt)
        return node
    entries = tp.dict_items(vt)
    if entries is not None:
        node = (DICT, [(k, _argument_node(tx, c, slots, containers, top=False)) for k, c in entries])
        if top:
            containers.append(vt)
        return node
    raise HandOff(f"an argument ({vt.python_type().__name__}) is an object made inside the traced code, "
                  f"which the graph cannot pass to it")


def _made_subclass(tx: Any, vt: Any, slots: _Slots) -> Optional[Node]:
    """A tensor subclass the traced code made by calling its class (dynamo records the call as a
    node of the graph): the op takes the call's arguments instead, and every call of the op makes
    the subclass again from them, as eager's code makes it every step, before ``apply``.

    The subclass cannot be an input of the op: a wrapper subclass's ``__torch_dispatch__`` sees
    every op called on it (the PythonOp's own, the detach and copies of the forward's inputs,
    AOTAutograd's tracing), where it may implement none (raising ``NotImplementedError`` for
    anything its own forward does not use, as PyTorch's upstream test of this case does), and eager
    never calls one on it. Made afresh, it is what eager's Function gets: its constructor run on
    this call's tensors, with its own autograd standing (a wrapper made with ``requires_grad=True``
    is a new leaf, which no gradient passes through to the tensors it wraps, as in eager).
    None: not such a call; the tensor is an argument like any other."""
    try:
        node = vt.as_proxy().node
    except Exception:
        return None
    if not _constructs_subclass(node):
        return None
    cls = node.target
    try:
        args = tuple(_graph_argument(tx, a, slots) for a in node.args)
        kwargs = tuple((k, _graph_argument(tx, a, slots)) for k, a in node.kwargs.items())
    except NotImplementedError:
        return None
    return (NEW, (cls, args, kwargs))


def _constructs_subclass(node: torch.fx.Node) -> bool:
    cls = node.target if node.op == "call_function" else None
    return (isinstance(cls, type) and issubclass(cls, torch.Tensor) and cls is not torch.Tensor
            and type(node.meta.get("example_value")) is cls)


def drop_unused_subclasses(gm: torch.fx.GraphModule) -> None:
    """Remove the subclass constructions (``_made_subclass``) that nothing but attribute reads
    nobody uses needs any more (dynamo's trace of the forward leaves such reads behind): the
    PythonOps make their subclass themselves, and eager's code made it once per step, not twice."""
    removed = False
    for node in reversed(list(gm.graph.nodes)):
        if node.users or node.op != "call_function":
            continue
        if node.target is getattr and isinstance(node.args[0], torch.fx.Node) and _constructs_subclass(node.args[0]):
            gm.graph.erase_node(node)
            removed = True
        elif _constructs_subclass(node):
            gm.graph.erase_node(node)
            removed = True
    if removed:
        gm.recompile()


def _graph_argument(tx: Any, a: Any, slots: _Slots) -> Node:
    """An argument of a graph node (``_made_subclass``) as an argument node: a tensor or a symbolic
    number by slot (through a new node over it, dynamo's variable for it), tuples and lists of them
    item by item, anything else the constant the graph holds. Raises NotImplementedError for a
    value that is neither (another subclass, a value of a node that is not a tensor or a number)."""
    if isinstance(a, torch.fx.Node):
        value = a.meta.get("example_value")
        if isinstance(value, torch.Tensor) and not _is_subclass(value):
            return (TENSOR, slots.tensor(tp.wrap_graph_node(tx, torch.ops.aten.alias.default, a)))
        if isinstance(value, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
            return _graph_number(tx, value, slots, a)
        if isinstance(value, tuple) and all(isinstance(v, (int, torch.SymInt)) for v in value):
            # a size (torch.Size, made again as a tuple): its numbers one by one
            return (TUPLE, [_graph_number(tx, v, slots, a, i) for i, v in enumerate(value)])
        raise NotImplementedError
    if isinstance(a, (tuple, list)) and _holds_node(a):
        return (LIST if type(a) is list else TUPLE, [_graph_argument(tx, c, slots) for c in a])
    return (CONSTANT, a)


def _graph_number(tx: Any, value: Any, slots: _Slots, a: torch.fx.Node, index: Optional[int] = None) -> Node:
    """A number among a node's arguments (``a``, or item ``index`` of ``a``): a constant where the
    graph holds one, else a slot with the call's value."""
    if index is not None and not isinstance(value, torch.SymInt):
        return (CONSTANT, value)
    if index is not None:
        vt = tp.wrap_graph_node(tx, operator.getitem, a, index)
    else:
        vt = tp.wrap_graph_node(tx, bool if isinstance(value, torch.SymBool) else operator.pos, a)
    kind = tp.symbolic_scalar_type(vt)
    if kind is None:
        if vt.is_python_constant():
            return (CONSTANT, vt.as_python_constant())
        raise NotImplementedError
    i = slots.number(vt, kind)
    return (SCALAR, (i, kind, slots.hints[i]))


def _holds_node(value: Any) -> bool:
    if isinstance(value, torch.fx.Node):
        return True
    return isinstance(value, (tuple, list)) and any(_holds_node(v) for v in value)


def _is_subclass(value: torch.Tensor) -> bool:
    return not tp.is_fake(value) and type(value) not in (torch.Tensor, torch.nn.Parameter)


def _example(vt: Any) -> torch.Tensor:
    return vt.as_proxy().node.meta["example_value"]


def _specialise(fakes: Sequence[torch.Tensor]) -> None:
    """Guard the capture on the argument sizes it saw: shapes learnt from one real run hold for
    those sizes only, so another batch size recaptures instead of meeting a wrong shape."""
    from torch.fx.experimental.symbolic_shapes import guard_int
    for f in fakes:
        for s in (*f.shape, *f.stride()):
            if isinstance(s, torch.SymInt):
                guard_int(s)


@contextlib.contextmanager
def _real_tensors_as_constants(mode: Any) -> Iterator[None]:
    """Let infer_shape read real tensors it reaches on its own (a module's parameters, a global
    table) as constants; dynamo's fake mode refuses them otherwise."""
    if mode is None:
        yield
        return
    previous = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True
    try:
        yield
    finally:
        mode.allow_non_fake_inputs = previous


class _Call:
    """What the capture of one call learns, whichever way the outputs were shaped."""

    def __init__(self, fn_cls: type, args: List[Node], kwargs: Dict[str, Node], slots: _Slots,
                 containers: List[Any], fakes: List[torch.Tensor], record: bool,
                 differentiable: List[bool]) -> None:
        self.fn_cls, self.args, self.kwargs = fn_cls, args, kwargs
        self.slots, self.containers, self.fakes = slots, containers, fakes
        self.record, self.differentiable = record, differentiable

    def spec(self, result: Node, meta: List[OutputMeta], dirty: List[Tuple[int, int]],
             shaped_by: str, writes: Optional[List[Tuple[int, Node]]] = None, infer: Any = None) -> CallSpec:
        grad_meta = [(f.dim(), f.dtype, f.device) for f, d in zip(self.fakes, self.differentiable) if d]
        return CallSpec(fn_cls=self.fn_cls, args=self.args, kwargs=self.kwargs, result=result,
                        differentiable=self.differentiable, record=self.record, grad_meta=grad_meta, meta=meta,
                        dirty=dirty, writes=writes or [], infer=infer, shaped_by=shaped_by,
                        convert=list(self.slots.convert))


def _by_infer_shape(tx: Any, call: _Call, infer: Any) -> CallSpec:
    mode = tx.output.fake_mode
    with mode, _real_tensors_as_constants(mode), capturing():
        args, kwargs, _ = rebuild_call(call.args, call.kwargs, call.fakes)
        result = infer(*args, **kwargs)
    described = Describer(call.fakes, call.record, real=False)
    node = described.result(result)
    if not any(k in (TENSOR, DETACHED) for k, _ in _leaves(node)) and not described.dirty:
        raise Unrepresentable("no tensor")
    return call.spec(node, described.meta, sorted(described.dirty.items()), "infer_shape", infer=infer)


def _leaves(node: Node) -> Iterator[Node]:
    kind, payload = node
    if kind in (TUPLE, LIST):
        for c in payload:
            yield from _leaves(c)
    else:
        yield node


def _by_trace(tx: Any, call: _Call, fn_cls_vt: Any, arg_vts: List[Any], kwarg_vts: Dict[str, Any]) -> CallSpec:
    def default(value: Any) -> Any:
        if not _is_exact(value):
            raise NotTraced("a default argument that is not a plain constant")
        return tp.build_variable(tx, value)
    try:
        positional = bind(call.fn_cls, arg_vts, kwarg_vts, default)
    except NotTraced:
        positional = None
    if positional is None:
        raise NotTraced("keyword arguments that only eager's apply binds")
    _state.speculating = getattr(_state, "speculating", 0) + 1
    try:
        traced = trace_forward(tx, call.fn_cls, fn_cls_vt, positional, call.slots.index, call.record,
                               call.differentiable)
    finally:
        _state.speculating -= 1
    return call.spec(traced.result, traced.meta, traced.dirty, "traced")


def _by_real_run(call: _Call) -> Tuple[CallSpec, bool]:
    """The spec, and whether the Function ran now (not found from an earlier trace)."""
    tensor_slots = [i for i, c in enumerate(call.slots.convert) if c is None and call.slots.hints[i] is None]
    nodes = [call.slots.vts[i].as_proxy().node for i in tensor_slots]
    done = real_values(nodes, lambda real: _run_for_real(call, real)) if nodes else _run_for_real(call, [])
    if done is None:
        raise HandOff("dynamo cannot trace its forward and the real values of its arguments are not known "
                      "while capturing (inside a checkpointed region or another higher-order op), so the "
                      "graph cannot learn its outputs without a run of its own")
    sig, values, run, found = done
    try:
        described, node, writes = _describe(call, run, objects=False)
    except Unrepresentable as e:
        # Python calls apply for this call, after the graph above it ran: that call takes this run
        # (python_call.py), through a spec of its own holding the objects the graph could not.
        kept = found if found is not None else pending.add(sig, values, run)
        described, node, writes = _describe(call, run, objects=True)
        _offer(call.spec(node, described.meta, sorted(described.dirty.items()), "real run", writes=writes), kept)
        raise HandOff(f"it returns {e}, which a graph cannot carry") from None
    if not _follow_inputs(described.meta, call.fakes):
        _specialise(call.fakes)
    spec = call.spec(node, described.meta, sorted(described.dirty.items()), "real run", writes=writes)
    spec.pending = found if found is not None else pending.add(sig, values, run)
    return spec, found is None


def _describe(call: _Call, run: Run, objects: bool) -> Tuple[Describer, Node, List[Tuple[int, Node]]]:
    """What the run returned, and wrote into the lists and dicts the traced code passed, as nodes."""
    described = Describer(run.call_inputs, call.record, real=True, objects=objects)
    node = described.result(run.result)
    writes = [(k, described.container(c)) for k, (c, items) in enumerate(zip(run.containers, run.before or []))
              if _changed(c, items)]
    return described, node, writes


def _offer(spec: CallSpec, kept: Any) -> None:
    """The call is handed to Python: its own call of apply takes ``kept``, through ``spec``."""
    spec.pending = kept
    python_call.offer(kept, register(spec))


def _run_for_real(call: _Call, real: List[torch.Tensor]) -> Tuple[Any, List[torch.Tensor], Run, Any]:
    """The capturing call's run (or the one an earlier trace of the frame made): signature, input
    values, run, and the kept run it came from (None when it ran now)."""
    values: List[torch.Tensor] = []
    it = iter(real)
    for i, convert in enumerate(call.slots.convert):
        hint = call.slots.hints[i]
        if hint is None:
            values.append(next(it))
        else:
            values.append(torch.scalar_tensor(hint, dtype=convert or call.fakes[i].dtype))
    sig = pending.signature(call.fn_cls, call.args, call.kwargs)
    found = pending.find(sig, values)
    if found is not None and found.error is not None:
        raise _raised(found.error)
    if found is not None and found.run is not None and (found.run.before is not None or not call.containers):
        return sig, values, found.run, found
    try:
        run = run_at_capture(call.fn_cls, call.args, call.kwargs, values, call.differentiable, call.record)
    except Exception as e:
        _offer(call.spec((CONSTANT, None), [], [], "raised"), pending.add(sig, values, None, error=e))
        raise _raised(e) from None
    return sig, values, run, None


def _follow_inputs(meta: List[OutputMeta], fakes: Sequence[torch.Tensor]) -> bool:
    """Express the sizes a real run showed in the inputs' sizes where that is unambiguous: a size
    equal to exactly one symbolic input size (and to no constant one) follows it; one equal to a
    constant input size only, or any size when no input size is symbolic, stays constant. Then one
    graph serves other sizes too, and the op checks every call's outputs against the rule. False,
    leaving the sizes constant, when some size is explained by no input size or by several (a
    product of sizes, a length that depends on data, a batch of 4 next to a width of 4): the caller
    then guards the capture on the input sizes."""
    dims = [(i, d, s) for i, f in enumerate(fakes) for d, s in enumerate(f.shape)]
    symbolic = any(isinstance(s, torch.SymInt) for _, _, s in dims)
    plans = []
    for m in meta:
        if not m.sizes:
            plans.append(m.sizes)
            continue
        plan: List[Any] = []
        for v in m.sizes:
            follows: Dict[Any, Tuple[int, int]] = {}
            constant = False
            for i, d, s in dims:
                if isinstance(s, torch.SymInt):
                    if tp.size_hint(s) == v:
                        follows.setdefault(tp.size_expr(s), (i, d))
                elif s == v:
                    constant = True
            if len(follows) == 1 and not constant:
                plan.append(next(iter(follows.values())))
            elif not follows and (constant or not symbolic):
                plan.append(int(v))
            else:
                return False
        plans.append(plan)
    for m, plan in zip(meta, plans):
        m.sizes = plan
    return True


def _raised(error: BaseException) -> HandOff:
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return HandOff(f"its apply raised {type(error).__name__} ({first}) on the capturing call; Python calls it, "
                   f"so that the model's code gets the error as in eager")


def _changed(container: Any, items: Any) -> bool:
    if type(container) is list:
        return len(container) != len(items) or any(a is not b for a, b in zip(container, items))
    return list(container) != list(items) or any(container[k] is not items[k] for k in items)


def _capture(tx: Any, fn_cls_vt: Any, args: List[Any], kwargs: Dict[str, Any]) -> Tuple[CallSpec, _Slots, List[Any]]:
    fn_cls = fn_cls_vt.fn_cls
    slots, containers = _Slots(), []
    arg_nodes = [_argument_node(tx, vt, slots, containers, top=True) for vt in args]
    kw_nodes = {k: _argument_node(tx, vt, slots, containers, top=True) for k, vt in kwargs.items()}
    with tx.output.fake_mode:
        fakes = [_example(vt) if convert is None else torch.empty((), dtype=convert)
                 for vt, convert in zip(slots.vts, slots.convert)]
    numbers = {i for i, h in enumerate(slots.hints) if h is not None}
    record = torch.is_grad_enabled() and any(f.requires_grad for i, f in enumerate(fakes) if i not in numbers)
    differentiable = [bool(record and i not in numbers and f.requires_grad and (f.is_floating_point() or f.is_complex()))
                      for i, f in enumerate(fakes)]
    call = _Call(fn_cls, arg_nodes, kw_nodes, slots, containers, fakes, record, differentiable)
    name = qualified_name(fn_cls)
    infer = getattr(fn_cls, "infer_shape", None)
    if infer is not None and not containers:
        try:
            return _by_infer_shape(tx, call, infer), slots, containers
        except tp.dynamo_restart_errors():
            raise
        except Exception as e:
            logger.info("fxtrain: %s.infer_shape failed (%s: %s); shaping it otherwise", name, type(e).__name__, e)
    try:
        return _by_trace(tx, call, fn_cls_vt, args, kwargs), slots, containers
    except NotTraced as why:
        logger.info("fxtrain: dynamo cannot trace the forward of %s (%s): it is shaped by its real run on the "
                    "capturing call, for these sizes only", name, why)
        side_effects = why.side_effects
    spec, ran = _by_real_run(call)
    if ran and side_effects:
        # The run changed Python state the trace may have read already (dynamo's variables for a
        # list the forward appended to, made while it traced the forward, hold the old contents,
        # and guards on them): convert the frame again, now that the state is the step's. The
        # restarted trace finds this run and does not run the Function again.
        raise tp.dynamo_restart(f"fxtrain: {name} changed Python state while capturing")
    return spec, slots, containers


def make_call(key: int, spec: CallSpec, convert: List[Optional[torch.dtype]]) -> Callable[..., Any]:
    """The function dynamo traces in place of ``apply``: the op, then what eager's apply leaves
    behind (an input updated in place, a list the Function appended to), then the result the
    model's code receives, built from the op's outputs. (Python runs it itself where its own call
    of apply takes a capture's run, python_call.py.)"""
    result, dirty, writes, n = spec.result, spec.dirty, spec.writes, len(convert)

    def fxtrain_python_op(*values: Any) -> Any:
        tensors = []
        for v, dtype in zip(values[:n], convert):
            tensors.append(v if dtype is None else torch.scalar_tensor(v, dtype=dtype))
        containers = values[n:]
        outs = torch.ops.fxtrain.python_op(key, tensors)
        for i, j in dirty:
            tensors[i].copy_(outs[j])
        for k, node in writes:
            new = build(node, outs, tensors)
            target = containers[k]
            target.clear()
            if type(new) is dict:
                target.update(new)
            else:
                target.extend(new)
        return build(result, outs, tensors)
    return fxtrain_python_op


python_call.use_call_maker(make_call)


def _call_apply(self: AutogradFunctionVariable, tx: Any, args: list, kwargs: dict) -> Any:
    sink: Optional[Callable[..., None]] = getattr(_state, "sink", None)
    if sink is None:
        options = _fxtrain_options(tx)
        if options is not None and not options.custom_autograd:
            return _inline(self, tx, args, kwargs)
        return _original_call_apply(self, tx, args, kwargs)
    if getattr(_state, "speculating", 0):
        # A Function that a forward traced for its shapes calls: under no_grad, where dynamo's own
        # handling just traces its forward, which is all that trace needs.
        return _original_call_apply(self, tx, args, kwargs)
    name = qualified_name(self.fn_cls)
    trace = getattr(tx.output, "fxtrain_trace", None)
    if trace is None:
        trace = tx.output.fxtrain_trace = next(_traces)
    pending.set_trace(trace)
    try:
        spec, slots, containers = _capture(tx, self, list(args), dict(kwargs))
    except HandOff as why:
        if sink(name, str(why)) is not False:
                logger.warning("fxtrain: %s runs in Python between two graphs (a graph break), not as a PythonOp: "
                           "%s", name, why)
        tp.dynamo_graph_break("fxtrain: custom Function run by Python", name,
                              f"fxtrain runs {name} in Python: {why}")
        raise AssertionError("unreachable")  # dynamo_graph_break raises
    key = register(spec)
    if spec.pending is not None:
        # Should the graph never run this call (dynamo gives the frame up, the capture fails and the
        # step reruns eagerly), Python's own call of apply takes the run instead.
        python_call.offer(spec.pending, key)
    if sink(name) is not False:
        logger.info("fxtrain: %s is a PythonOp, its outputs shaped by %s", name, spec.shaped_by)
    call = make_call(key, spec, slots.convert)
    with tp.dynamo_scalar_outputs(tx):
        return tp.build_variable(tx, call).call_function(tx, [*slots.vts, *containers], {})


def install() -> None:
    """Install the routing hook once (it does nothing outside ``routing()`` blocks)."""
    AutogradFunctionVariable.call_apply = _call_apply
