"""A Function's real run on the capturing call, kept to be the first step's run of that call.

A forward dynamo cannot trace (numpy, ``.item()``, side effects) is shaped by running it for real on
the capturing call's values. That run is not a rehearsal: it is the step's run, done early. The op
takes it instead of calling ``apply`` again when the graph first runs the call, so the user's
forward runs exactly once per step, on real tensors, as in eager, and its side effects happen once.

- ``signature`` and ``find``: dynamo may convert a frame more than once (it restarts its analysis
  at a graph break, for instance); a restarted trace reaches the same call with the same values and
  takes the run it already made rather than running the Function again.
- ``claim``: the graph's first run of the call takes the run if the op's inputs are the values the
  run was made from (``matches``); otherwise the op runs the Function itself. Either way the run is
  let go of then, so it never stands in for a later call.
- ``evaluating``: computing a later Function's real arguments (example.py) may evaluate an earlier
  PythonOp of the same graph; that evaluation is this call's run of it too, and is kept the same way.
- ``python_call.offer``: while a run waits, Python's own call of ``apply`` with the same arguments takes
  the run (or raises the error it kept) where the graph does not run the call: a call handed to
  Python, a frame dynamo gave up, the eager rerun of a failed capture.
- ``forget``: runs a capture made but no graph took (the capture failed) are dropped when the
  TrainModule's call ends, so they hold no memory for long. (Not when it next enters a capture:
  dynamo's frame converter, where fxtrain enters its capture settings, is also called for frames it
  meets while the new graph runs, before the graph reaches the op that takes its run.)
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch

from ..torch_private import is_fake
from . import python_call


class Run:
    """One call of ``apply`` made by the op: what the backward and the op's outputs need."""

    __slots__ = ("inputs", "call_inputs", "result", "containers", "before", "rng")

    def __init__(self, inputs: List[torch.Tensor], call_inputs: List[torch.Tensor], result: Any,
                 containers: Sequence[Any], before: Optional[List[Any]] = None) -> None:
        self.inputs = inputs              # leaves the user's backward differentiates with respect to
        self.call_inputs = call_inputs    # what apply received (an input marked dirty: its copy)
        self.result = result
        self.containers = containers      # lists and dicts built for the call, after it
        self.before = before              # a capture's run: those containers' items before the call
        self.rng: Optional[Tuple[Any, Any]] = None   # a capture's run that drew random numbers: RNG states around it


def rng_states(devices: Sequence[torch.device]) -> List[torch.Tensor]:
    """The CPU generator's state, and each CUDA device's."""
    states = [torch.get_rng_state()]
    states.extend(torch.cuda.get_rng_state(d) for d in devices if d.type == "cuda")
    return states


def set_rng_states(devices: Sequence[torch.device], states: List[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    for d, state in zip([d for d in devices if d.type == "cuda"], states[1:]):
        torch.cuda.set_rng_state(state, d)


def same_states(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if type(a) not in _PLAIN or type(b) not in _PLAIN:
        # A tensor subclass may implement no comparison (its __torch_dispatch__ raising for
        # anything it does not expect, as eager never compares it): only itself is the same.
        return a is b
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if torch.equal(a, b):
        return True
    return (a.is_floating_point() or a.is_complex()) and bool(((a == b) | (a.isnan() & b.isnan())).all())


class PendingRun:
    def __init__(self, signature: Tuple[Any, ...], values: List[torch.Tensor], run: Run, trace: int) -> None:
        self.signature = signature
        self.values: Optional[List[torch.Tensor]] = values
        self.run: Optional[Run] = run
        self.traces = {trace}             # the traces (dynamo output graphs) that use it
        self.error: Optional[BaseException] = None   # what the run raised (no graph takes it then)
        self.key: Optional[int] = None    # the spec a Python call of apply takes it through (python_call.py)
        self.offered: Any = None          # python_call.py's record while a Python call may take it

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        values = self.values
        return values is not None and len(values) == len(tensors) and all(
            _same(v, t) for v, t in zip(values, tensors))

    def drop(self) -> None:
        self.values = None
        self.run = None
        self.error = None
        if self.offered is not None:
            python_call.withdraw(self)


class _State(threading.local):
    def __init__(self) -> None:
        self.owner: Any = None
        self.trace = 0
        self.evaluating = 0
        # While a TrainModule call runs its graphs: the Function calls they made, (spec key, op
        # inputs, run) or (spec key, op inputs, None, error), for ``offer_step``.
        self.log: Optional[List[Tuple[Any, ...]]] = None


_state = state = _State()   # ``state.evaluating`` is read by the op on every call
_by_owner: "weakref.WeakKeyDictionary[Any, List[PendingRun]]" = weakref.WeakKeyDictionary()


def _node_key(node: Any) -> Any:
    """A hashable, comparable form of an argument node: objects passed by reference by identity."""
    kind, payload = node
    if kind in ("list", "tuple"):
        return (kind, tuple(_node_key(c) for c in payload))
    if kind == "dict":
        return (kind, tuple((k, _node_key(c)) for k, c in payload))
    if kind == "new":
        cls, args, kwargs = payload
        return (kind, id(cls), tuple(_node_key(c) for c in args), tuple((k, _node_key(c)) for k, c in kwargs))
    if kind == "constant" and not (payload is None or type(payload) in (bool, int, float, complex, str, tuple)):
        return (kind, id(payload))
    return (kind, payload)


def signature(fn_cls: type, args: Sequence[Any], kwargs: Any) -> Tuple[Any, ...]:
    """What, besides tensor values, makes two calls the same call: the class and the argument trees."""
    return (fn_cls, tuple(_node_key(n) for n in args), tuple((k, _node_key(n)) for k, n in kwargs.items()))


@contextlib.contextmanager
def session(owner: Any) -> Iterator[None]:
    """Captures by ``owner`` (a TrainModule): the runs they make are its."""
    previous = _state.owner
    _state.owner = owner
    try:
        yield
    finally:
        _state.owner = previous


def forget(owner: Any) -> None:
    """``owner``'s call ended: runs no graph took are dropped (with their tensors)."""
    for run in _by_owner.pop(owner, []):
        run.drop()
    python_call.forget_raised()


def set_trace(trace: int) -> None:
    """The dynamo trace (output graph) now asking for real runs."""
    _state.trace = trace


def find(sig: Tuple[Any, ...], values: Sequence[torch.Tensor]) -> Optional[PendingRun]:
    """A run of the same call on the same values made by an earlier trace (not this one)."""
    owner = _state.owner
    if owner is None:
        return None
    for pending in _by_owner.get(owner, []):
        if (pending.run is not None or pending.error is not None) and pending.signature == sig \
                and _state.trace not in pending.traces and pending.matches(values):
            pending.traces.add(_state.trace)
            return pending
    return None


def add(sig: Tuple[Any, ...], values: List[torch.Tensor], run: Optional[Run],
        error: Optional[BaseException] = None) -> PendingRun:
    """Keep a capture's run (or what it raised: a restarted trace then hands the call to Python
    again without running it a second time)."""
    pending = PendingRun(sig, values, run, _state.trace)
    pending.error = error
    if _state.owner is not None:
        _by_owner.setdefault(_state.owner, []).append(pending)
    return pending


@contextlib.contextmanager
def evaluation() -> Iterator[None]:
    """Real values being computed at capture (example.py): PythonOps met keep their runs."""
    _state.evaluating += 1
    try:
        yield
    finally:
        _state.evaluating -= 1


def evaluating() -> bool:
    return _state.evaluating > 0


def claim(spec: Any, tensors: Sequence[torch.Tensor]) -> Optional[Run]:
    """The kept run for this call of ``spec``'s op, if it is one (see the module docstring)."""
    pending = spec.pending
    if _state.evaluating:
        return pending.run if pending.matches(tensors) else None
    if tensors and is_fake(tensors[0]):   # a fake step (the profiler): not the call the run was made for
        return None
    spec.pending = None
    run = pending.run
    if run is None or not pending.matches(tensors) or not _rng_at_its_place(run, tensors):
        pending.drop()
        return None
    pending.drop()
    return run


def _rng_at_its_place(run: Run, tensors: Sequence[torch.Tensor]) -> bool:
    """A run that drew random numbers drew them from the generators' state at capture, which the
    capture then put back. It is this call's run only if the graph reached the op with the same
    state (no random op above it that the evaluation of its arguments skipped); the generators then
    move on past its draws, as in eager. Otherwise the op runs the Function anew, for eager's values."""
    if run.rng is None:
        return True
    devices = sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str)
    before, after = run.rng
    if not same_states(rng_states(devices), before):
        return False
    set_rng_states(devices, after)
    return True


def look_up(spec: Any, tensors: Sequence[torch.Tensor]) -> None:
    """While evaluating: a run an earlier trace made of this call, if any, becomes ``spec``'s."""
    spec.pending = find(signature(spec.fn_cls, spec.args, spec.kwargs), tensors)


def keep(spec: Any, key: int, tensors: Sequence[torch.Tensor], run: Run) -> None:
    """An evaluation ran ``spec``'s op for real: the graph's first run of it takes this run (or a
    Python call of the same call, should the graph never run it)."""
    spec.pending = add(signature(spec.fn_cls, spec.args, spec.kwargs), [t.detach() for t in tensors], run)
    python_call.offer(spec.pending, key)


def open_step_log() -> Optional[List[Tuple[Any, ...]]]:
    """A TrainModule call starts running graphs: log its Function calls (returns the enclosing
    call's log, for ``close_step_log``: a TrainModule may run inside a Function's forward)."""
    previous = _state.log
    _state.log = []
    return previous


def close_step_log(previous: Optional[List[Tuple[Any, ...]]]) -> List[Tuple[Any, ...]]:
    log = _state.log
    _state.log = previous
    return log or []


def offer_step(owner: Any, log: List[Tuple[Any, ...]], error: BaseException) -> bool:
    """``owner``'s call failed with ``error`` after its graphs made the Function calls in ``log``: offer
    each call's outcome to Python's own calls of ``apply``, as a capture's runs are offered
    (python_call.py), so that the eager rerun of the step takes the runs rather than run each
    forward a second time. True when ``error`` is what a Function's forward raised inside a graph
    (a graph has no branch for an exception, so the model's own ``try`` could not see it there):
    that call's Python call then raises the very error again, where eager's call raises it."""
    kept = _by_owner.setdefault(owner, [])
    for entry in log:
        key, tensors, run = entry[0], entry[1], entry[2]
        pending = PendingRun(("step",), [t.detach() for t in tensors], run, 0)
        if len(entry) == 4:
            pending.error = entry[3]
        kept.append(pending)
        python_call.offer(pending, key)
        if pending.error is error:
            return True
    return False
