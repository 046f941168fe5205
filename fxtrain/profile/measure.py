"""Real-run measurement of live tensor bytes: the oracle the profiler's estimates are checked against.

It counts the same on every device: the CPU has no caching allocator whose statistics could be
read, and a GPU's (``torch.cuda.max_memory_allocated``) adds its rounding and caching, which the
profiler does not cost. So the peak is counted the way the allocator sees tensors: every storage an
op returns is registered (weak reference, freed when the storage dies), as are the tensors alive
when the step starts (parameters, buffers, optimizer state, the batch). A Python custom op (a PythonOp) runs its implementation with the counter still
active, so the allocations of the user's own forward and backward inside it are seen too; torch's
``MemTracker`` stops at the op boundary and misses them.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional

import torch

from ..torch_private import TorchDispatchMode, custom_op_impl_of, tree_flatten
from ..cost.step import loss_of, make_optimizer


def _storages(t: torch.Tensor) -> Iterable[torch.UntypedStorage]:
    if t.layout != torch.strided or t.device.type == "meta":
        return ()
    try:
        return (t.untyped_storage(),)
    except (RuntimeError, NotImplementedError):  # tensor subclasses without one storage
        return ()


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages and their peak while active."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: Dict[int, int] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Without this dynamo declines to run compiled code under the mode: a TrainModule would then
        # run its module eagerly and we would measure eager PyTorch, not the captured graphs.
        return True

    def track(self, values: Any) -> None:
        for t in tree_flatten(values)[0]:
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    key = id(st)
                    if key in self._live:
                        continue
                    nbytes = st.nbytes()
                    self._live[key] = nbytes
                    self.current += nbytes
                    weakref.finalize(st, self._free, key)
        self.peak = max(self.peak, self.current)

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        impl = custom_op_impl_of(func)
        if impl is not None:
            with self:  # see the user's code inside the op
                out = impl(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        self.track(out)
        return out


@dataclass
class Measured:
    peak_bytes: int
    start_bytes: int      # live at the start of the measured step (params, buffers, state, batch)
    loss: float


def measure_step(model: torch.nn.Module, *args: Any, optimizer: Any = None,
                 params_model: Optional[torch.nn.Module] = None, warmup: int = 1, keep_outputs: bool = True,
                 **kwargs: Any) -> Measured:
    """Peak live tensor bytes of one real training step in steady state (after ``warmup`` steps).

    The step is the one the profiler costs (see ``step.py``): forward, backward with the outputs
    held (``keep_outputs``, or only the loss), outputs released, optimizer step,
    ``zero_grad(set_to_none=True)``.
    ``params_model`` is the module owning the parameters when ``model`` wraps it (a TrainModule).
    """
    owner = params_model if params_model is not None else model
    opt = make_optimizer(optimizer, owner)

    def step(counter: Optional[LiveBytes]) -> float:
        out = model(*args, **kwargs)
        loss = loss_of(out)
        if not keep_outputs:
            out = None
        loss.backward()
        value = float(loss.detach())
        del out, loss
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            owner.zero_grad(set_to_none=True)
        return value

    for _ in range(warmup):
        step(None)
    counter = LiveBytes()
    counter.track(list(owner.parameters()) + list(owner.buffers()) + [args, kwargs])
    if opt is not None:
        counter.track([list(s.values()) for s in opt.state.values()])
    start = counter.current
    with counter:
        value = step(counter)
    return Measured(peak_bytes=counter.peak, start_bytes=start, loss=value)
