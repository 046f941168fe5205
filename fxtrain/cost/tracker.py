"""The cost tracker: one dispatch mode, above FakeTensorMode, that watches every op of a fake step.

Why a dispatch mode and not a graph walk: the step runs through fxtrain's real machinery (dynamo
guards, AOTAutograd's run-time wrappers, absent-gradient backward variants, deferred outputs,
PythonOps, the autograd engine, the optimizer's own code), so what is allocated and freed, and in
which order, is what the real step does. Fake tensors have storages of their own (on the meta
device, no data), and the Python object of a storage lives exactly as long as the storage, so live
bytes are counted the way the allocator sees them, storage by storage, views and in-place results
counted once.

Values. A fake step has no data, yet a few things need values: the sizes of data-dependent ops
(``nonzero`` on a padding or label mask, which fxtrain's passes insert), ``.item()`` (optimizer step
counts, PythonOp handles). Real input tensors are therefore kept as *shadows* of their fake copies
and every op whose tensor arguments all have shadows (integer masks, labels, step counters) is also
run for real on the shadows, within a size limit. Where no shadow exists (shapes-only inputs) a
data-dependent size is taken from ``hints`` (the fraction seen in an earlier run, used when scaling
a batch) or else at its maximum, which over-estimates and never under-estimates.
"""
from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from ..runtime.host_counts import HOST_COUNT
from ..runtime.varlen_attention import VARLEN_ATTENTION, efficient_outputs
from ..torch_private import (DynamicOutputShapeException, FakeTensor, FakeTensorMode, TorchDispatchMode,
                             custom_op_impl_of, disable_current_modes, implement_rng_state_ops, tree_flatten)
from .marks import current_node
from .shadows import Shadows
from .flops import depends_on_values, op_flops
from ..errors import Error

logger = logging.getLogger("fxtrain")

PHASES = ("forward", "backward", "optimizer")
_DEVICE = torch.ops.prim.device.default
OUTSIDE = "(outside graphs)"
OPTIMIZER = "(optimizer)"
_MADE_BY_STEP = frozenset(PHASES) | {"setup"}   # not "parameters", "inputs", "optimizer state"


class ProfileError(Error, RuntimeError):
    """The step cannot be costed on fake tensors (and why, in terms the user can act on)."""


@dataclass
class Unknown:
    count: int = 0
    phases: Set[str] = field(default_factory=set)
    modules: Set[str] = field(default_factory=set)
    why: str = ""


@dataclass
class ModuleCost:
    """One module's share: its own parameters and the ops that ran inside it (not in its children).
    The tracker fills the FLOPs; the profile report adds parameters and saved bytes."""

    params: int = 0
    flops_forward: int = 0
    flops_backward: int = 0
    saved_bytes: int = 0


def _storage(t: torch.Tensor) -> Optional[torch.UntypedStorage]:
    if t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _tensors(values: Any) -> List[torch.Tensor]:
    """Tensors among op arguments (flat values, lists/tuples of them, dict values): a cheap
    tree_flatten for the shapes aten schemas allow, as this runs for every op."""
    out: List[torch.Tensor] = []
    stack = [values]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return out


_MUTATED: Dict[Any, Tuple[Tuple[int, str], ...]] = {}


def _mutated_arguments(func: Any) -> Tuple[Tuple[int, str], ...]:
    found = _MUTATED.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        found = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                      if a.alias_info is not None and a.alias_info.is_write) if schema is not None else ()
        _MUTATED[func] = found
    return found


def _python_ops() -> Tuple[Any, Any]:
    from ..pythonop import op  # noqa: F401  (registers the ops)
    return torch.ops.fxtrain.python_op.default, torch.ops.fxtrain.python_op_backward.default


class CostTracker(TorchDispatchMode):
    """Counts FLOPs per phase and module, live bytes and their peak, unknown ops, on a fake step."""

    def __init__(self, fake_mode: FakeTensorMode, hints: Optional[List[float]] = None,
                 shadow_limit: int = 1 << 24) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.shadow_limit = shadow_limit
        self.shadows = Shadows()
        self.hints = list(hints or [])
        self.fractions: List[float] = []        # data-dependent size / its maximum, in op order
        #                                         (for an op costed from values: FLOPs per row)
        self.assumed_max = 0                    # data-dependent sizes costed at their maximum
        self.phase = "setup"
        self.counting = False                   # only the measured step counts FLOPs and events
        self._live: Dict[int, Tuple[int, str, str, int]] = {}   # storage key -> (bytes, category, module, born)
        self.by_category: Dict[str, int] = defaultdict(int)
        self.current = 0
        self.peak = 0
        self.peak_phase = "start"
        self.peak_by_category: Dict[str, int] = {}
        # Allocation and free events are numbered so that what was alive at the peak can be told
        # afterwards for the few storages that matter (the outputs'), without copying the live set
        # at every new peak.
        self._events = 0
        self._peak_event = 0
        self._outputs: Dict[int, Tuple[int, int]] = {}          # live output storage -> (bytes, born)
        self._output_spans: List[Tuple[int, int, int]] = []     # released ones: (bytes, born, died)
        self.timeline: List[Tuple[str, int]] = []
        self.initial: Dict[str, int] = {}
        self.flops: Dict[str, int] = defaultdict(int)
        self.modules: Dict[str, ModuleCost] = defaultdict(ModuleCost)
        self.unknown: Dict[str, Unknown] = {}
        self.saved: Dict[int, int] = {}          # storage key -> bytes, saved for backward in the forward
        self._saved_modules: Dict[int, str] = {}
        self._python_op, self._python_op_backward = _python_ops()
        self._python_flops: Dict[int, Optional[int]] = {}   # handle -> backward FLOPs promised by `flops`
        self._in_python_op = 0
        self.ops = 0
        # Where ops are attributed: the marked graphs' current node unless the step runs eagerly.
        self.module_source: Optional[Callable[[], Optional[str]]] = None
        self.log: Optional[List[Tuple[str, str, int, int]]] = None   # (op, phase, live, new) when debugging

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Lets dynamo capture and run compiled code while we watch; its own tracing is not ours to see.
        return True

    # --------------------------------------------------------------------------------- memory
    def register(self, values: Any, category: str) -> None:
        """Count tensors alive before the step (parameters, buffers, inputs, optimizer state)."""
        for t in tree_flatten(values)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, category, "")
        self.peak = max(self.peak, self.current)

    def _track(self, t: torch.Tensor, category: str, module: str) -> bool:
        st = _storage(t)
        if st is None:
            return False
        key = id(st)
        if key in self._live:
            return False
        nbytes = st.nbytes()
        self._events += 1
        self._live[key] = (nbytes, category, module, self._events)
        self.current += nbytes
        self.by_category[category] += nbytes
        weakref.finalize(st, self._free, key)
        return True

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._events += 1
            output = self._outputs.pop(key, None)
            if output is not None:
                self._output_spans.append((output[0], output[1], self._events))
            self.current -= entry[0]
            self.by_category[entry[1]] -= entry[0]
            if self.counting:
                self.timeline.append((self.phase, self.current))

    def _after_alloc(self) -> None:
        if self.counting:
            self.timeline.append((self.phase, self.current))
        if self.current > self.peak:
            self.peak = self.current
            self._peak_event = self._events
            self.peak_phase = self.phase
            self.peak_by_category = {k: v for k, v in self.by_category.items() if v}

    def start_measuring(self) -> None:
        self.initial = {k: v for k, v in self.by_category.items() if v}
        self.counting = True
        self.peak = self.current
        self._peak_event = self._events
        self.peak_phase = "start"
        self.peak_by_category = {k: v for k, v in self.by_category.items() if v}
        self.timeline = [("start", self.current)]

    def watch_outputs(self, tensors: List[torch.Tensor], loss: torch.Tensor) -> None:
        """Remember the storages the model's outputs hold (``step.held_by_outputs``), not the tensors.

        Only storages the step made count: parameters and inputs an output aliases or a deferred
        output will read were alive before the step and stay alive after it, whatever the loop.
        """
        loss_storage = _storage(loss)
        skip = id(loss_storage) if loss_storage is not None else None
        for t in tensors:
            st = _storage(t)
            key = id(st) if st is not None else None
            entry = self._live.get(key) if key is not None and key != skip else None
            if entry is not None and entry[1] in _MADE_BY_STEP and key not in self._outputs:
                self._outputs[key] = (entry[0], entry[3])

    def output_bytes_at_peak(self) -> int:
        """Bytes of the outputs' storages alive at the peak (see ``watch_outputs``).

        With the outputs held through the backward this is what the loop holds at the peak; with
        them dropped, what of them is alive anyway (autograd saved it, or the peak is in the
        forward, before the loop could drop anything).
        """
        spans = self._output_spans + [(nbytes, born, self._events + 1) for nbytes, born in self._outputs.values()]
        return sum(nbytes for nbytes, born, died in spans if born <= self._peak_event < died)

    def watching_saved(self) -> Any:
        """A block within which the tracker remembers what the forward keeps for the backward."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack_saved, lambda t: t)

    def _pack_saved(self, t: torch.Tensor) -> torch.Tensor:
        st = _storage(t)
        if st is not None and self.counting:
            key = id(st)
            entry = self._live.get(key)
            if entry is not None and entry[1] == "forward" and key not in self.saved:
                self.saved[key] = entry[0]
                self._saved_modules[key] = entry[2]
        return t

    def saved_by_module(self) -> Dict[str, int]:
        out: Dict[str, int] = defaultdict(int)
        for key, nbytes in self.saved.items():
            out[self._saved_modules.get(key, "")] += nbytes
        return dict(out)

    # ---------------------------------------------------------------------------------- values
    def _shadow_of(self, x: Any) -> Any:
        if isinstance(x, FakeTensor):
            return self.shadows.get(x)
        return x  # a real tensor is its own value

    def _value_flops(self, func: Any, args: Any, kwargs: Any, out: Any) -> Optional[int]:
        """FLOPs of an op whose cost depends on data (attention per sequence): from the values where
        the step has them, else from the FLOPs per row the same op had in the run that gave the
        ``hints`` (a scaled batch keeps the sequence lengths' distribution, as it keeps densities).
        Recorded in ``fractions`` as FLOPs per row (NaN: unknown), in op order like the sizes."""
        rows = int(args[0].shape[0])
        flops = op_flops(func, args, kwargs, out, value_of=self._value_list)
        index = len(self.fractions)
        if flops is None and index < len(self.hints) and self.hints[index] == self.hints[index]:
            flops = int(round(self.hints[index] * rows))
        self.fractions.append(flops / rows if flops is not None and rows else float("nan"))
        return flops

    def _value_list(self, x: Any) -> Optional[list]:
        """A tensor argument's value as a Python list, where the step has one (a FLOP formula that
        depends on data reads it; the fake mode must not see the read)."""
        value = self._shadow_of(x) if isinstance(x, torch.Tensor) else None
        if value is None:
            return None
        with disable_current_modes():
            return value.tolist()

    def _compute_shadows(self, func: Any, args: Any, kwargs: Any, out: Any) -> bool:
        """Run the op on the values too, if all its tensors have one; False when not done."""
        tensors = _tensors((args, kwargs))
        for t in tensors:
            if self._shadow_of(t) is None:
                return False  # the common case (activations, parameters): no value to follow
        outs = _tensors(out)
        if not outs:
            return False
        flat, spec = tree_flatten((args, kwargs))
        if tensors:
            if sum(t.numel() for t in tensors) > self.shadow_limit:
                return False
        elif sum(o.numel() for o in outs) > self.shadow_limit:
            return False
        real_flat = []
        for x in flat:
            if isinstance(x, torch.Tensor):
                s = self._shadow_of(x)
                if s is None:
                    return False
                real_flat.append(s)
            else:
                real_flat.append(x)
        real_args, real_kwargs = spec.unflatten(real_flat)
        try:
            with disable_current_modes():
                real_out = func(*real_args, **real_kwargs)
        except Exception:  # a device we cannot run on, say: no value, sizes fall back to hints
            return False
        for f, r in zip(tree_flatten(out)[0], tree_flatten(real_out)[0]):
            if isinstance(f, FakeTensor) and isinstance(r, torch.Tensor):
                self.shadows.set(f, r)
        return True

    def _drop_mutated_shadows(self, func: Any, args: Any, kwargs: Any) -> None:
        for i, name in _mutated_arguments(func):
            value = args[i] if i < len(args) else kwargs.get(name)
            for t in _tensors(value):
                if isinstance(t, FakeTensor):
                    self.shadows.drop(t)

    def _real_sized(self, func: Any, args: Any, kwargs: Any) -> Any:
        """A data-dependent op on tensors with values: run it for real, its size is the real one."""
        flat, spec = tree_flatten((args, kwargs))
        real_flat = []
        for x in flat:
            value = self._shadow_of(x) if isinstance(x, torch.Tensor) else x
            if value is None:
                return None
            real_flat.append(value)
        real_args, real_kwargs = spec.unflatten(real_flat)
        with disable_current_modes():
            real = func(*real_args, **real_kwargs)
        out = self.fake_mode.from_tensor(real)
        self.shadows.set(out, real)
        self.fractions.append(real.shape[0] / max(1, _max_rows(func, args)))
        return out

    def _data_dependent(self, func: Any, args: Any, kwargs: Any) -> Any:
        """nonzero / masked_select on a tensor with no value: a hinted fraction or the maximum."""
        name = func.overloadpacket.__name__
        if name not in ("nonzero", "masked_select", "argwhere"):
            raise ProfileError(f"{func} has a data-dependent output size and its input has no value in a "
                               f"fake run; pass real tensors for the inputs it depends on")
        rows = self._rows(_max_rows(func, args))
        device = args[0].device
        if name == "masked_select":
            return torch.empty((rows,), dtype=args[0].dtype, device=device)
        return torch.empty((rows, args[0].dim()), dtype=torch.int64, device=device)

    def _host_count(self, valid: torch.Tensor) -> int:
        """The row count a selection of the passes is sized by (``runtime/host_counts.py``, where the
        batch guard reads it ahead): the real count where the mask has a value, else a hinted fraction
        or the maximum, as for ``nonzero``."""
        value = self._shadow_of(valid)
        if value is not None:
            with disable_current_modes():
                value = int(value.sum())
        return self._rows(int(valid.numel()), value)

    def _rows(self, total: int, known: Optional[int] = None) -> int:
        """The rows a data-dependent size has: ``known``, else this op's hinted fraction of ``total``,
        else ``total`` (counted in ``assumed_max``); recorded in ``fractions``."""
        rows = known
        if rows is None and len(self.fractions) < len(self.hints):
            rows = int(round(self.hints[len(self.fractions)] * total))
        elif rows is None:
            rows = total
            self.assumed_max += 1
        self.fractions.append(rows / total if total else 1.0)
        return rows

    # ------------------------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        if func is _DEVICE:   # half of all calls (autograd asks every tensor's device): nothing to cost
            return func(*args, **kwargs)
        if func is self._python_op:
            return self._run_python_op(func, args, kwargs)
        if func is self._python_op_backward:
            return self._run_python_op_backward(func, args, kwargs)
        if func is HOST_COUNT:
            return self._host_count(args[0])
        if depends_on_values(func):
            try:
                out = func(*args, **kwargs)
            except DynamicOutputShapeException:   # the CUDA efficient route's log-sum-exp, sized by values
                if func is not VARLEN_ATTENTION:
                    raise
                out = efficient_outputs(args[0], args[2], self._value_list(args[3]), int(args[3].numel()))
            self._account(func, args, kwargs, out, flops=self._value_flops(func, args, kwargs, out))
            return out
        if func is torch.ops.aten._local_scalar_dense.default:
            value = self._shadow_of(args[0])
            if value is None:
                with contextlib.suppress(Exception):
                    return func(*args, **kwargs)   # fake mode knows constants made by torch.tensor(...)
                raise ProfileError("the step reads a tensor's value (.item(), int(), a Python branch on data) "
                                   "that a fake run does not have; pass real tensors for such inputs")
            with disable_current_modes():
                return func(value)
        try:
            out = func(*args, **kwargs)
        except DynamicOutputShapeException:
            out = self._real_sized(func, args, kwargs)
            if out is None:
                out = self._data_dependent(func, args, kwargs)
        else:
            if not self._compute_shadows(func, args, kwargs, out):
                self._drop_mutated_shadows(func, args, kwargs)
        self._account(func, args, kwargs, out)
        return out

    def _module(self) -> str:
        if self.phase == "optimizer":
            return OPTIMIZER
        if self.module_source is not None:
            name = self.module_source()
            return OUTSIDE if name is None else name
        node = current_node()
        return node.module if node is not None else OUTSIDE

    def _account(self, func: Any, args: Any, kwargs: Any, out: Any, flops: Optional[int] = -1) -> None:
        module = self._module()
        category = self.phase if self.phase in PHASES else "setup"
        allocated = 0
        for t in _tensors(out):
            if self._track(t, category, module):
                allocated += self._live[id(_storage(t))][0]
        self._after_alloc()
        if self.log is not None:
            self.log.append((str(func), self.phase, self.current, allocated))
        if not self.counting or self._in_python_op:
            return
        cost = self.modules[module]
        if flops == -1:
            try:
                flops = op_flops(func, args, kwargs, out, value_of=self._value_list)
            except Exception as e:  # a formula that does not fit this call: say so rather than guess
                logger.debug("no FLOP count for %s: %s", func, e)
                flops = None
        if flops is None:
            self._unknown(str(func), module, "its cost depends on values this step does not have"
                          if depends_on_values(func) else "no FLOP formula")
            return
        if self.phase == "forward":
            cost.flops_forward += flops
        elif self.phase == "backward":
            cost.flops_backward += flops
        self.flops[self.phase] += flops

    def _unknown(self, name: str, module: str, why: str) -> None:
        entry = self.unknown.setdefault(name, Unknown(why=why))
        entry.count += 1
        entry.phases.add(self.phase)
        entry.modules.add(module)

    # ------------------------------------------------------------------------------- PythonOps
    def _run_python_op(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Run the PythonOp's real implementation on fake tensors (what it allocates and saves is then
        seen); if the user's code leaves torch, fall back to the op's fake (``infer_shape``) outputs."""
        from ..pythonop.registry import SPECS
        key, tensors = args[0], args[1]
        spec = SPECS[key]
        impl = custom_op_impl_of(func)
        self._in_python_op += 1
        try:
            with self:
                out = impl(*args, **kwargs)
            ran = True
        except ProfileError:
            raise
        except Exception as e:
            logger.info("fxtrain profile: %s does not run on fake tensors (%s); costed from its fake outputs",
                        spec.name, e)
            out = func(*args, **kwargs)
            ran = False
        finally:
            self._in_python_op -= 1
        forward, backward = _python_op_flops(spec, tensors)
        handle_value = self.shadows.get(out[-1]) if ran else None
        if handle_value is not None:
            self._python_flops[_value(handle_value)] = backward
        self._account(func, args, kwargs, out, flops=forward)
        if forward is None and self.counting:
            self.unknown[str(func)].why = "PythonOp without a flops() static method"
            self._rename_unknown(str(func), f"PythonOp {spec.name}")
        return out

    def _run_python_op_backward(self, func: Any, args: Any, kwargs: Any) -> Any:
        from ..pythonop.registry import SPECS
        key, handle = args[0], args[1]
        value = self.shadows.get(handle)
        self._in_python_op += 1
        try:
            if value is not None:
                with self:
                    out = custom_op_impl_of(func)(*args, **kwargs)
            else:
                out = func(*args, **kwargs)
        finally:
            self._in_python_op -= 1
        flops = self._python_flops.pop(_value(value), None) if value is not None else None
        self._account(func, args, kwargs, out, flops=flops)
        if flops is None and self.counting:
            self._rename_unknown(str(func), f"PythonOp {SPECS[key].name} (backward)")
        return out

    def _rename_unknown(self, old: str, new: str) -> None:
        entry = self.unknown.pop(old, None)
        if entry is None:
            return
        target = self.unknown.setdefault(new, Unknown(why="PythonOp without a flops() static method"))
        target.count += entry.count
        target.phases |= entry.phases
        target.modules |= entry.modules


def _value(real: torch.Tensor) -> int:
    """int() of a real tensor while fake mode is below us (it would fake the read)."""
    with disable_current_modes():
        return int(real)


def _max_rows(func: Any, args: Any) -> int:
    """The largest size a data-dependent output can have: every element selected."""
    if func.overloadpacket.__name__ == "masked_select":
        return math.prod(int(size) for size in torch.broadcast_shapes(args[0].shape, args[1].shape))
    return int(args[0].numel())


def _python_op_flops(spec: Any, tensors: Any) -> Tuple[Optional[int], Optional[int]]:
    """The Function's own ``flops(*args)`` static method: an int (forward) or (forward, backward)."""
    fn = getattr(spec.fn_cls, "flops", None)
    if fn is None:
        return None, None
    result = fn(*spec.arguments(list(tensors)))
    if isinstance(result, tuple):
        forward, backward = result
        return int(forward), None if backward is None else int(backward)
    return int(result), None


def _run_and_save_rng_state(mode: CostTracker, op: Any, *args: Any, **kwargs: Any) -> Tuple[torch.Tensor, Any]:
    """A checkpointed region's random op in the forward (torch_private.RNG_STATE_OPS): the op costs
    what it costs alone, counted with the tracker back on; a fake step has no generator state to
    keep, so the state is an empty stand-in that only the backward's replay reads."""
    with mode:
        out = op(*args, **kwargs)
    return torch.empty(0, dtype=torch.uint8), out


def _run_with_rng_state(mode: CostTracker, state: torch.Tensor, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The backward's replay of that op: its cost again (the recomputation), the state unread."""
    with mode:
        return op(*args, **kwargs)


implement_rng_state_ops(CostTracker, _run_and_save_rng_state, _run_with_rng_state)
