"""Model outputs computed on first use.

A rewrite such as label sparsity computes the logits only for labelled rows, yet the model still
returns the full logits (``BertForMaskedLM`` returns loss *and* logits; most training loops read only
the loss). Computing them anyway would undo the rewrite; dropping them would change the model's
outputs. So the graph returns the tensors the logits are made from, and the logits slot holds a
:class:`DeferredTensor`: shape, dtype, device and ``requires_grad`` are known at once, and the first
real use (any torch function, ``print``, ``.item()``, autograd) runs the original ops in full, with
autograd recording as in the forward, so values and gradients are eager's.
"""
from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..torch_private import (DisableTorchFunctionSubclass, FakeTensor, foreach_copy, make_wrapper_subclass,
                             tree_map_only)
from .shapes import ShapeSolver
from .direct import direct
from ..errors import Error

# Read from the wrapper itself: metadata a deferred tensor has without computing anything.
_METADATA = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
    torch.Tensor.is_complex, torch.Tensor.__len__, torch.Tensor.element_size,
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.layout.__get__,
    torch.Tensor.is_leaf.__get__,
}


class StaleDeferredOutput(Error, RuntimeError):
    """A deferred output read after a tensor it is computed from was changed in place, other than by
    a ``torch.optim`` optimizer's step (whose updates fxtrain sees coming and keeps values for)."""


KEEP_ANYWAY = 64 * 2 ** 20   # bytes of weights kept ahead of a step whatever the outputs weigh


class _Pending:
    """The inputs of one deferred computation, run once for all outputs that share it.

    The computation reads the parameters when it runs, so a read after ``optimizer.step()`` would
    see the next step's weights. Before any optimizer step (a global step pre-hook), every pending
    computation still alive copies the parameters it reads that the optimizer is about to update:
    a read after the step then gives its own forward's values, as eager's logits would. The hook
    costs nothing when the loop has dropped its outputs (nothing pending is alive). Other in-place
    changes (a hand-written update, ``load_state_dict``) are caught by the version counters.
    """

    def __init__(self, gm: Callable[..., Any], inputs: List[Any], grad: bool, out_bytes: int) -> None:
        self.gm, self.inputs, self.grad, self.out_bytes = gm, inputs, grad, out_bytes
        self.versions = [(i, x._version) for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
        self.values: Optional[Tuple[torch.Tensor, ...]] = None
        self.lock = threading.Lock()
        self.not_kept: Optional[int] = None    # bytes a copy would have cost, when it was not made
        _watch(self)

    def keep_before_update(self, params: Set[int]) -> None:
        """Copy the inputs among ``params`` (ids) that have not changed yet: they are about to.

        Only when the copy is no larger than the outputs it serves (eager would hold those outputs
        in full, so keeping never costs more memory than eager) or than ``KEEP_ANYWAY`` bytes.
        Padding elimination's outputs are recomputed from every weight: a large model whose weights
        outweigh its logits is not copied, and a read after the step raises with what to do.
        """
        with self.lock:
            if self.values is not None:
                return
            todo = [(k, i) for k, (i, version) in enumerate(self.versions)
                    if id(self.inputs[i]) in params and self.inputs[i]._version == version
                    and not _without_values(self.inputs[i])]
            distinct: Dict[int, torch.Tensor] = {}   # a tied weight is an input twice: one copy, weighed once
            for _, i in todo:
                distinct.setdefault(id(self.inputs[i]), self.inputs[i])
            size = sum(x.nbytes for x in distinct.values())
            if size > max(self.out_bytes, KEEP_ANYWAY):
                self.not_kept = size
                return
            copies = dict(zip(distinct, _kept_copies(list(distinct.values()), self)))
            for k, i in todo:
                kept = self.inputs[i] = copies[id(self.inputs[i])]
                self.versions[k] = (i, kept._version)

    def result(self, k: int) -> torch.Tensor:
        with self.lock:
            if self.values is None:
                changed = [i for i, v in self.versions if self.inputs[i]._version != v]
                if changed and self.not_kept is not None:
                    raise StaleDeferredOutput(
                        f"fxtrain computes this model output on first use (a sparsity pass skipped it in the "
                        f"forward), and optimizer.step() has changed the weights it is computed from. Keeping "
                        f"a copy of them ({self.not_kept / 2**20:.1f} MiB) would have cost more memory than "
                        f"the output itself ({self.out_bytes / 2**20:.1f} MiB), which eager would hold, and "
                        f"more than {KEEP_ANYWAY // 2**20} MiB, so fxtrain did not. Read the output before optimizer.step(), or turn off the pass "
                        f"named in capture_info().optimizations.")
                if changed:
                    shapes = ", ".join(str(tuple(self.inputs[i].shape)) for i in changed[:3])
                    raise StaleDeferredOutput(
                        f"fxtrain computes this model output on first use (a sparsity pass skipped it in the "
                        f"forward), but {len(changed)} tensor(s) it is computed from (shapes {shapes}) were "
                        f"modified in place since the forward by something other than a torch.optim optimizer "
                        f"(a hand-written update, load_state_dict, an in-place op on an input). fxtrain keeps "
                        f"the values it needs only ahead of an optimizer's step. Read the output before that "
                        f"change, or turn off the pass named in capture_info().optimizations.")
                with torch.set_grad_enabled(self.grad):
                    self.values = tuple(direct(self.gm)(*self.inputs))
                self.inputs, self.versions = [], []
        return self.values[k]


_pending: "weakref.WeakSet[_Pending]" = weakref.WeakSet()
_hook: List[Any] = []


def _watch(pending: _Pending) -> None:
    if not _hook:  # through the module attribute, so that a benchmark can swap the hook out
        _hook.append(register_optimizer_step_pre_hook(lambda opt, a, k: _before_optimizer_step(opt, a, k)))
    _pending.add(pending)


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _pending and not _spares:
        return   # a loop that drops its outputs before the step (HF Trainer): nothing to do
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not _pending:
        # The loop drops its outputs before the step: no copy of these weights is needed again. Only
        # these: another optimizer's weights may have a loop that holds its outputs (a benchmark
        # interleaving eager and fxtrain steps in one process, a GAN's two models), and clearing all
        # made that loop allocate fresh copies every step (202 ``empty_like`` a step for a 12-layer BERT).
        for key in params.intersection(_spares):
            del _spares[key]
        return
    for pending in list(_pending):
        pending.keep_before_update(params)


def _without_values(x: torch.Tensor) -> bool:
    """Fake or meta tensors (the profiler's step): nothing to keep, and a copy would be costed."""
    return x.is_meta or isinstance(x, FakeTensor)


def _stale_gradient(_grad: torch.Tensor) -> None:
    raise RuntimeError("fxtrain: backward through a model output first read after optimizer.step(): its weights "
                       "have been updated since its forward (eager PyTorch refuses this too: 'one of the "
                       "variables needed for gradient computation has been modified by an inplace operation')")


def _kept_copies(xs: List[torch.Tensor], owner: "_Pending") -> List[torch.Tensor]:
    """The values of ``xs`` now, for a later read. Differentiating through a copy cannot reach its
    ``x`` (it has changed since): it raises, as eager's backward through pre-update weights does.

    A copy goes into the buffer the last step used for its ``x`` when nothing pending holds it any
    more: a loop that holds its outputs across every step would otherwise allocate, and page-fault,
    a fresh copy of the weights each step (measured: 11 ms instead of 3 ms for the demo's 45 MB).
    All of them are copied by one foreach op, not a ``copy_`` each from Python: on a GPU that is a
    few multi-tensor kernels instead of a launch per parameter (a host-bound step's launches), and
    on the CPU machine the keep before each optimizer step of a 12-layer BERT (202 parameters,
    0.8 MiB, 1 thread) took 1.1-1.8 ms instead of 2.0-3.0 ms (three interleaved runs, medians of 25
    steps); a large model's keep is its memory copy (38 MiB: ~6 ms either way).
    """
    buffers: List[torch.Tensor] = []
    fresh: List[Tuple[torch.Tensor, torch.Tensor]] = []
    for x in xs:
        spare = _spares.get(id(x))
        if spare is not None:
            of, buffer, holder = spare
            # Only once its holder is gone: outputs it computed may still view the buffer.
            if of() is x and holder() is None and buffer.shape == x.shape and buffer.dtype == x.dtype:
                _spares[id(x)] = (of, buffer, weakref.ref(owner))
                buffers.append(buffer)
                continue
        kept = torch.empty_like(x)
        fresh.append((x, kept))
        buffers.append(kept)
    with torch.no_grad():
        foreach_copy(buffers, xs)
    for x, kept in fresh:
        if x.requires_grad:
            kept.requires_grad_(True)
            kept.register_hook(_stale_gradient)
        key = id(x)
        _spares[key] = (weakref.ref(x, lambda _, key=key: _spares.pop(key, None)), kept, weakref.ref(owner))
    return buffers


# id(parameter) -> (weak parameter, the buffer its last copy went to, weak pending holding it)
_spares: Dict[int, Tuple[Any, torch.Tensor, Any]] = {}


class DeferredTensor(torch.Tensor):
    """A tensor output fxtrain has not computed yet; any use computes it (once)."""

    _pending: _Pending
    _index: int

    @staticmethod
    def __new__(cls, pending: _Pending, index: int, shape: Sequence[int], dtype: torch.dtype,
                device: torch.device, requires_grad: bool) -> "DeferredTensor":
        t = make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)
        t._pending, t._index = pending, index
        return t

    def materialize(self) -> torch.Tensor:
        return self._pending.result(self._index)

    @property
    def is_materialized(self) -> bool:
        return self._pending.values is not None

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map_only(DeferredTensor, DeferredTensor.materialize, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Reached only by paths that skip __torch_function__ (C++ internals): same answer.
        args, kwargs = tree_map_only(DeferredTensor, DeferredTensor.materialize, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return repr(self.materialize())


@dataclass(frozen=True)
class OutSpec:
    """What a deferred output looks like before it is computed: sizes as ints or sympy expressions."""

    shape: Tuple[Any, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @staticmethod
    def of(value: Any) -> "OutSpec":
        if isinstance(value, OutSpec):
            return value
        shape = tuple(s.node.expr if isinstance(s, torch.SymInt) else int(s) for s in value.shape)
        return OutSpec(shape, value.dtype, value.device, bool(value.requires_grad))


@dataclass
class DeferredPlan:
    """How a graph's outputs map back to the outputs dynamo expects.

    The graph returns the directly computed outputs in order, then the ``extra`` tensors the deferred
    computation reads. ``inputs`` says, per input of ``gm``: ("arg", index into the call's
    arguments) or ("extra", index into the extra outputs). ``deferred`` lists, per deferred output:
    its position among the original outputs, its index among ``gm``'s outputs, and its fake value
    (an :class:`OutSpec` once made portable).
    """

    gm: Callable[..., Any]
    n_direct: int
    inputs: List[Tuple[str, int]]
    deferred: List[Tuple[int, int, Any]]
    placeholders: Optional[List[torch.fx.Node]]
    n_outputs: int = 0
    solver: Optional[ShapeSolver] = None

    def shape_solver(self) -> ShapeSolver:
        return self.solver if self.solver is not None else ShapeSolver(self.placeholders or [])

    def portable(self) -> "DeferredPlan":
        """The same plan without graph nodes or fake tensors, so that it can be pickled (the cache)."""
        return dataclasses.replace(self, placeholders=None, solver=self.shape_solver(),
                                   deferred=[(p, i, OutSpec.of(v)) for p, i, v in self.deferred])


def with_deferred(compiled: Callable[..., Any], plan: DeferredPlan) -> Callable[..., Any]:
    solver = plan.shape_solver()
    deferred = [(position, index, OutSpec.of(value)) for position, index, value in plan.deferred]

    def run(*args: Any) -> Any:
        outs = compiled(*args)
        direct, extra = list(outs[:plan.n_direct]), outs[plan.n_direct:]
        grad = torch.is_grad_enabled()
        shapes = [solver.solve(spec.shape, args) for _, _, spec in deferred]
        out_bytes = sum(math.prod(shape) * spec.dtype.itemsize for shape, (_, _, spec) in zip(shapes, deferred))
        pending = _Pending(plan.gm, [args[i] if kind == "arg" else extra[i] for kind, i in plan.inputs], grad,
                           out_bytes)
        for (position, index, spec), shape in zip(deferred, shapes):
            direct.insert(position, DeferredTensor(pending, index, shape, spec.dtype, spec.device,
                                                   grad and spec.requires_grad))
        return type(outs)(direct) if isinstance(outs, tuple) else direct

    return run
