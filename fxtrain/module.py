"""TrainModule: the one-line wrapper that runs a module's training step from captured graphs."""
from __future__ import annotations

import contextlib
import itertools
import logging
import warnings
from typing import Any, Dict, Hashable, Iterator, Mapping, Optional, Set, Tuple

import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from .cache.call import MISS
from .cache.session import ModuleCache
from .capture.backend import Backend, current_mode
from .capture.entry import make_entry
from .capture.state import in_fake_run
from .capture.info import CaptureInfo
from .capture.inputs import call_schema
from .capture.settings import dynamo_settings
from .options import Options, resolve
from .pythonop import routing
from .runtime.absent_grads import release_materialization

logger = logging.getLogger("fxtrain")
_instances = itertools.count()


class CaptureError(RuntimeError):
    """Capture failed for a reason fxtrain does not support (raised when ``fallback="raise"``)."""


class FallbackWarning(UserWarning):
    """Capture failed and the module now runs eagerly (``fallback="eager"``)."""


def root_cause(exc: BaseException) -> str:
    """The innermost exception of a chain, as 'Type: first line', which is what a user can act on."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if inner is None:
            break
        exc = inner
    message = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {message[0] if message else ''}".strip()


def _graph_break_total() -> int:
    return sum(counters["graph_break"].values())


class TrainModule(nn.Module):
    """Wrap ``module`` so its forward and backward run from captured graphs.

    The wrapped module's parameters and buffers are used in place (nothing is copied), so
    optimizers, ``state_dict()``, ``to()``, ``train()``/``eval()`` and hooks act on the same
    tensors as without the wrapper. Parameter and state-dict names are the wrapped module's own.
    """

    def __init__(self, module: nn.Module, options: Optional[Options] = None) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"fxtrain.TrainModule wraps a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, TrainModule):
            raise TypeError("module is already a fxtrain.TrainModule; wrap the original module once")
        super().__init__()
        self.module = module
        self._options = resolve(options)
        self._info = CaptureInfo(executor=self._options.executor)
        self._backend = Backend(self._info, self._options, lambda: self.training,
                               f"{type(module).__name__}-{next(_instances)}")
        # One entry (so one dynamo cache) per mode: train and eval are captured separately even
        # for models whose code never reads `self.training`.
        self._compiled = {mode: make_entry(self._backend, self._options.dynamic, self._options.fullgraph)
                          for mode in (True, False)}
        self._symbolic: Dict[bool, Any] = {}
        self._cache = ModuleCache(self._options, self._info, self._backend.owner)
        self._seen: Set[Hashable] = set()
        self._device: Optional[torch.device] = None
        self._device_known = False
        self._eager = False

    # ----------------------------------------------------------------------------------- running
    @property
    def options(self) -> Options:
        return self._options

    def capture_info(self) -> CaptureInfo:
        return self._info

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._eager or in_fake_run():
            return self.module(*args, **kwargs)
        key = (call_schema(args, kwargs, self._module_device()), current_mode(self.training),
               torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        may_capture = key not in self._seen
        if self._cache.active:
            out = self._cache.call(key, self.module, args, kwargs)
            if out is MISS and may_capture:
                out = self._cache.load(key, self.module, args, kwargs, key[1])
            if out is not MISS:
                self._seen.add(key)
                if torch.is_grad_enabled():
                    release_materialization(out)
                return out
        snapshot = self._snapshot_buffers() if may_capture and self._options.fallback == "eager" else None
        graphs_before, breaks_before = self._info.graphs, _graph_break_total()
        try:
            with torch._dynamo.config.patch(dynamo_settings(self._options)), self._routing():
                out = self._entry_for(key)(self.module, args, kwargs)
        except Exception as exc:
            if not (may_capture or self._info.graphs != graphs_before
                    or isinstance(exc, torch._dynamo.exc.TorchDynamoException)):
                raise
            return self._after_capture_failure(exc, snapshot, args, kwargs)
        if self._info.graphs != graphs_before:
            new_breaks = _graph_break_total() - breaks_before
            if self._cache.active:
                if self._info.graphs == graphs_before + 1 and not new_breaks:
                    self._cache.stored_after_capture(key, self._info.records[-1], out, key[1],
                                                     type(self.module).__qualname__)
                else:
                    self._info.cache_log.append(f"not stored ({key[1]}): the call made "
                                                f"{self._info.graphs - graphs_before} graphs (graph breaks)")
            self._info.graph_breaks += new_breaks
            if new_breaks:
                self._info.break_reasons.extend(
                    r for r in counters["graph_break"] if r not in self._info.break_reasons)
                logger.warning("fxtrain: %d graph break(s) while capturing %s: %s", new_breaks,
                               type(self.module).__name__, "; ".join(self._info.break_reasons))
        self._seen.add(key)
        if torch.is_grad_enabled():
            release_materialization(out)
        return out

    def _entry_for(self, key: Hashable) -> Any:
        """Dynamo's entry for this call. A cached graph served the first sizes, so dynamo never saw
        them and would capture the next sizes statically too: capture symbolic sizes directly."""
        if self._options.dynamic is None and key in self._cache.resized:
            if self.training not in self._symbolic:
                self._symbolic[self.training] = make_entry(self._backend, True, self._options.fullgraph)
            return self._symbolic[self.training]
        return self._compiled[self.training]

    def _routing(self) -> Any:
        if not self._options.custom_autograd:
            return contextlib.nullcontext()
        return routing(self._record_python_op)

    def _record_python_op(self, name: str) -> None:
        if name not in self._info.python_ops:
            self._info.python_ops.append(name)

    def _after_capture_failure(self, exc: Exception, snapshot: Optional[Dict[str, torch.Tensor]],
                               args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """Decide between a user error (eager fails too: raise eager's error) and a capture failure."""
        if snapshot is not None:
            self._restore_buffers(snapshot)
        try:
            out = self.module(*args, **kwargs)
        except Exception as eager_exc:
            raise eager_exc from None
        reason = root_cause(exc)
        if self._options.fallback == "raise":
            raise CaptureError(f"fxtrain could not capture {type(self.module).__name__}: {reason}") from exc
        self._eager = True
        self._info.fallback_reason = reason
        message = (f"fxtrain could not capture {type(self.module).__name__} and runs it eagerly from now "
                   f"on: {reason}")
        logger.warning(message)
        warnings.warn(message, FallbackWarning, stacklevel=3)
        return out

    def _snapshot_buffers(self) -> Dict[str, torch.Tensor]:
        return {name: b.detach().clone() for name, b in self.module.named_buffers()}

    def _restore_buffers(self, snapshot: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, b in self.module.named_buffers():
                if name in snapshot:
                    b.copy_(snapshot[name])

    def _module_device(self) -> Optional[torch.device]:
        if not self._device_known:
            devices = {t.device for t in self.module.parameters()} | {t.device for t in self.module.buffers()}
            self._device = devices.pop() if len(devices) == 1 else None
            self._device_known = True
        return self._device

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> "TrainModule":
        self._device_known = False
        return super()._apply(fn, *args, **kwargs)

    # ------------------------------------------------------ the wrapped module's names and state
    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        self._device_known = False
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "module" not in modules:
                raise
            return getattr(modules["module"], name)

    def extra_repr(self) -> str:
        return f"executor={self._options.executor!r}"
