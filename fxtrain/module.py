"""TrainModule: the one-line wrapper that runs a module's training step from captured graphs."""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
import warnings
import weakref
from typing import Any, Dict, Hashable, Iterator, List, Mapping, Optional, Set, Tuple

import torch
from torch import nn

from .cache.call import MISS
from .cache.session import ModuleCache
from .capture.backend import Backend, Plugins, RecompileLimitReached, current_mode
from .capture.breaks import call_breaks, close_window, open_window
from .capture.entry import make_entry
from .capture_state import in_fake_run
from .capture.watch import WINDOW, ExpensiveSymbolicSizes, watched
from .runtime.info import CaptureInfo
from .capture.inputs import autocast_state, call_schema
from .capture.rollback import Rollback
from .capture.scalars import ScalarWatch
from .capture.settings import dynamo_settings
from .capture.sizes import SizesPolicy
from .options import Options, resolve
from .pythonop import close_step_log, forget_runs, offer_step, open_step_log, raised_as_eager, routing
from .torch_private import check_supported, dims_static, dynamo_config_patch, dynamo_recompile_limit_error
from .runtime.dense_route import SparseBatchError
from .errors import Error, FxtrainWarning
from .signature import forward_signature, present
from .state_dicts import wrapped_state_dict

logger = logging.getLogger("fxtrain")
_instances = itertools.count()
_cache_hint_logged = False   # TrainModule._hint_cache


class CaptureError(Error, RuntimeError):
    """Capture failed for a reason fxtrain does not support (raised when ``fallback="raise"``)."""


class FallbackWarning(FxtrainWarning):
    """Capture failed and the module now runs eagerly (``fallback="eager"``)."""


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it wraps (dynamo wraps a backend's error in its own)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = getattr(exc, "inner_exception", None) or exc.__cause__


def root_cause(exc: BaseException) -> str:
    """The innermost exception of a chain, as 'Type: first line', which is what a user can act on."""
    *_, exc = _chain(exc)
    message = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {message[0] if message else ''}".strip()


def _alive(ref: "weakref.ref[TrainModule]") -> "TrainModule":
    module = ref()
    if module is None:   # dynamo called a backend whose TrainModule is gone: nothing can run it
        raise RuntimeError("fxtrain: a graph was handed to the backend of a TrainModule that no longer exists")
    return module


class TrainModule(nn.Module):
    """Wrap ``module`` so its forward and backward run from captured graphs.

    The wrapped module's parameters and buffers are used in place (nothing is copied), so
    optimizers, ``state_dict()``, ``to()``, ``train()``/``eval()`` and hooks act on the same
    tensors as without the wrapper. Parameter and state-dict names are the wrapped module's own.
    ``forward`` presents the wrapped module's signature and docstring (fxtrain/signature.py), since
    HF ``Trainer`` and other tools choose what to pass a model by reading them.
    """

    def __init__(self, module: nn.Module, options: Optional[Options] = None, *,
                 plugins: Optional[Plugins] = None) -> None:
        """``plugins``: what a tool plugs into the capture pipeline (capture/backend.py: Plugins):
        the profiler's executor that runs marked copies, its example source that knows the values
        behind its fake inputs, its observer of budget states."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"fxtrain.TrainModule wraps a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, TrainModule):
            raise TypeError("module is already a fxtrain.TrainModule; wrap the original module once")
        check_supported()   # a torch older than the window raises, a newer one warns once
        super().__init__()
        self.module = module
        # The same object, read without nn.Module.__getattr__ on the hot path (~1 µs a read).
        self.__dict__["_wrapped"] = module
        self._options = resolve(options)
        executor = plugins.executor if plugins is not None else None
        self._info = CaptureInfo(executor=executor.name if executor is not None else self._options.executor)
        self._rollback = Rollback(module)
        # dynamo keeps every backend it was given for the life of the process (until
        # torch._dynamo.reset()), so the backend reaches this module only weakly: a TrainModule the
        # user drops is freed with its model and graphs.
        me = weakref.ref(self)
        self._backend = Backend(self._info, self._options, lambda: _alive(me).training,
                               f"{type(module).__name__}-{next(_instances)}",
                               on_graph=lambda: _alive(me)._rollback.on_graph(), plugins=plugins,
                               alive=lambda: me() is not None)
        # One entry (so one dynamo cache) per mode: train and eval are captured separately even
        # for models whose code never reads `self.training`.
        self._compiled = {mode: make_entry(self._backend, self._options.dynamic, self._options.fullgraph,
                                           self._compiling) for mode in (True, False)}
        self._symbolic: Dict[bool, Any] = {}     # the symbolic entries (capture/sizes.py)
        self._sizes = SizesPolicy(self._options.dynamic is None)
        self._capturing_calls = 0                  # calls that captured (Options.recompile_limit)
        self._cache = ModuleCache(self._options, self._info, self._backend.owner, self._backend.executor,
                                  self._backend.context, self._backend.alive)
        self._seen: Set[Hashable] = set()
        self._device: Optional[torch.device] = None
        self._device_known = False
        self._eager = False
        # Floats are graph constants until a float argument changes value (capture/scalars.py).
        self._floats = ScalarWatch((float,))
        self._specialize_float = True
        self._present()

    def _present(self) -> None:
        module = self.__dict__["_wrapped"]
        present(self, TrainModule, forward_signature(module), getattr(module.forward, "__doc__", None),
                type(module).__name__)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self._present()   # copies reduce to TrainModule itself (fxtrain/signature.py)

    # ----------------------------------------------------------------------------------- running
    @property
    def options(self) -> Options:
        return self._options

    def capture_info(self, wait: bool = True) -> CaptureInfo:
        """What capture did. Waits for captures still partitioning in the background
        (runtime/pending.py: a second or a few), so that what it reports is the whole step;
        ``wait=False`` reports what is known now (a capture still partitioning has no tier yet), for
        a progress line that must not hold the training loop up."""
        if wait:
            self._info.wait_for_partitions()
        return self._info

    def attach_optimizer(self, optimizer: Any) -> "TrainModule":
        """Name the optimizer the training loop steps, so that ``Options.memory_budget`` counts its
        state and its step's temporaries: an instance, a class, or a name ("adamw"), as
        ``Options.optimizer`` takes. Attach before the first call: a graph already captured keeps
        the plan it was made with (a warning says so)."""
        self._backend.optimizer = optimizer
        if self._options.memory_budget is not None and any(r.memory_plan is not None for r in self._info.records):
            warnings.warn("fxtrain: optimizer attached after a memory plan was made; graphs captured so far "
                          "keep plans that did not count it", stacklevel=2)
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._eager or in_fake_run():
            return self._wrapped(*args, **kwargs)
        shapes: List[Any] = []
        device = self._module_device()
        key = (call_schema(args, kwargs, device, shapes), current_mode(self.training),
               autocast_state(device, args, kwargs))
        may_capture = key not in self._seen
        self._rollback.begin(may_capture)
        enclosing = open_step_log()
        try:
            try:
                out = self._call(key, may_capture, args, kwargs, tuple(shapes))
            finally:
                log = close_step_log(enclosing)
        except SparseBatchError:
            raise  # Options(sparsity_guard="raise") asked for it; raised before anything ran
        except Exception as exc:
            # Whatever failed, on the first call or the thousandth: the fallback policy decides.
            return self._after_capture_failure(exc, args, kwargs, log)
        self._rollback.end()
        return out

    def _call(self, key: Hashable, may_capture: bool, args: Tuple[Any, ...], kwargs: Dict[str, Any],
              shapes: Tuple[Any, ...]) -> Any:
        module = self._wrapped
        switched = bool(self._floats) and self._switch_floats_if_changed(key, args, kwargs)
        if self._cache.store is not None:
            out = self._cache.call(key, module, args, kwargs)
            if out is MISS and may_capture:
                out = self._cache.load(key, module, args, kwargs, key[1])
            if out is not MISS:
                self._seen.add(key)
                self._sizes.served(key, shapes, args, kwargs)
                return out
        graphs_before = self._info.graphs
        self._backend.may_capture = self._capturing_calls < self._options.recompile_limit
        window = open_window()
        try:
            while True:
                try:
                    out = self._entry_for(key, args, kwargs, shapes)(module, args, kwargs)
                    break
                except ExpensiveSymbolicSizes:
                    logger.info("fxtrain: symbolic sizes of %s proved expensive to reason about (sympy); "
                                "capturing %s static instead", type(self.module).__name__,
                                self._sizes.keep_expensive_static())
        finally:
            filed = close_window(window)
            self._sizes.end_call()
        if self._info.graphs != graphs_before:   # (nn.Module.__setattr__ costs ~3 us: not on every call)
            self._capturing_calls += 1
        if self._info.graphs != graphs_before or filed:
            self._after_capture(key, may_capture, switched, graphs_before, filed, out, args, kwargs)
        if may_capture:
            self._seen.add(key)
        return out

    def _after_capture(self, key: Hashable, may_capture: bool, switched: bool, graphs_before: int,
                       filed: Dict[str, int], out: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Book-keeping of a call that captured: why, its graph breaks, the cache, what to watch."""
        made = self._info.graphs - graphs_before
        new = self._info.records[len(self._info.records) - made:] if made else []
        breaks = call_breaks(filed, [r.break_site for r in new if r.break_site is not None], made)
        why = ("first call" if graphs_before == 0 else "new input schema or mode") if may_capture else \
            self._sizes.switch or ("a float argument changed value: floats are captured as graph inputs from now on"
                                   if switched else "guard failed")
        self._info.note_call(made, why, may_capture, breaks)
        if self._cache.active and made:
            if made == 1 and not breaks:
                self._cache.stored_after_capture(key, self._info.records[-1], out, key[1],
                                                 type(self.module).__qualname__, self.module, args, kwargs)
            else:
                self._info.note_cache(f"not stored ({key[1]}): the call made {made} graphs "
                                      f"and {len(breaks)} graph break(s)")
        if breaks:
            self._sizes.graph_broke(key)
            logger.warning("fxtrain: %d graph break(s) while capturing %s: %s", len(breaks),
                           type(self.module).__name__, "; ".join(dict.fromkeys(breaks)))
        self._rollback.after_capture()
        forget_runs(self)   # Functions' capturing runs no graph took (pythonop/pending.py)
        if self._specialize_float:
            self._floats.record(key, args, kwargs)

    def _switch_floats_if_changed(self, key: Hashable, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
        """A float argument has another value than at the capture of this schema: capture floats as
        graph inputs from now on (True: this call switched). Free for modules without float arguments."""
        if not self._floats or not self._floats.changed(key, args, kwargs):
            return False
        self._specialize_float = False
        self._floats.clear()  # dynamo's own guards and automatic dynamic take it from here
        logger.info("fxtrain: a float argument of %s changed value; floats are captured as graph inputs "
                    "from now on instead of constants", type(self.module).__name__)
        return True

    def _entry_for(self, key: Hashable, args: Tuple[Any, ...], kwargs: Dict[str, Any], sizes: Tuple[Any, ...]) -> Any:
        """Dynamo's entry for this call: the static one, or from the first size change of its schema
        on, the symbolic one (``dynamic=None``; capture/sizes.py says which sizes it makes symbolic)."""
        if self._sizes.use_symbolic(key, sizes, args, kwargs, key in self._cache.resized):
            if self._sizes.later_partitions is None:
                # A symbolic capture's sympy budget is a share of the first capture's whole cost:
                # the partitions the worker makes of it count. The requests go out now, and the
                # capture goes on beside them (capture/sizes.py: sympy_budget).
                self._sizes.later_partitions = self._info.start_partitions()
            if self.training not in self._symbolic:
                self._symbolic[self.training] = make_entry(self._backend, True, self._options.fullgraph,
                                                           self._compiling)
            return self._symbolic[self.training]
        return self._compiled[self.training]

    @contextlib.contextmanager
    def _compiling(self, code_name: Optional[str] = None) -> Iterator[None]:
        """Entered by dynamo whenever it compiles a frame of this module (capture/entry.py): the
        settings fxtrain captures under, which cost nothing on calls that run captured graphs, the
        sizes to keep static, and a watchdog (capture/watch.py) that warns when a compile is slow
        and stops a symbolic one sunk in sympy (``_call`` then runs the call again)."""
        started = time.perf_counter()
        with dynamo_config_patch(dynamo_settings(self._options, self._specialize_float)), \
                (routing(self._info.note_python_op, self) if self._options.custom_autograd
                 else contextlib.nullcontext()), \
                dims_static(self._sizes.marks()), self._backend.untraceable.breaking(), \
                watched(self._describe_compile, self._options.capture_warning_seconds,
                        self._sizes.sympy_budget(code_name)) as watch:
            yield
        seconds = time.perf_counter() - started
        logger.debug("fxtrain: compiled %s in %.2f s (%.2f s in sympy, at most %.0f%% of %.0f s)", code_name,
                     seconds, watch.sympy_seconds, 100 * watch.peak_share, WINDOW)
        self._hint_cache(seconds)
        self._sizes.compiled(code_name, watch.cpu_seconds())

    def _hint_cache(self, seconds: float) -> None:
        """Once per process, at INFO: where the on-disk cache would save this capture time. Training
        loops such as HF Trainer start a new process per run and capture again each time (seconds per
        capture, several with dynamic padding), and nothing else points there."""
        global _cache_hint_logged
        if _cache_hint_logged or self._options.cache_dir is not None:
            return
        _cache_hint_logged = True
        logger.info("fxtrain: captured %s in %.1f s; Options(cache_dir=...) or FXTRAIN_CACHE_DIR=<dir> stores "
                    "captures on disk so that the next process (a new Trainer run) loads them instead "
                    "(docs/caching.md)", type(self.module).__name__, seconds)

    def _describe_compile(self, elapsed: float) -> str:
        what, symbolic = self._sizes.describe_compile(type(self.module).__name__)
        if symbolic:
            avoid = "Options(dynamic=False) (FXTRAIN_DYNAMIC=0) captures each size statically instead"
        elif self._options.cache_dir is None:
            avoid = "Options(cache_dir=...) (FXTRAIN_CACHE_DIR) lets later processes load it instead"
        else:
            avoid = "it is stored in the cache for later processes"
        return f"{what} has taken {elapsed:.0f} s so far ({'train' if self.training else 'eval'} mode); {avoid}"

    def _after_capture_failure(self, exc: Exception, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                               log: List[Any]) -> Any:
        """Decide between a user error (eager fails too: raise eager's error) and a capture failure."""
        # Whatever failed, the eager rerun below takes the runs of the Functions this call's graphs
        # already made, instead of running their forwards again.
        if offer_step(self, log, exc):
            # A Function's forward raised inside a graph, which has no branch for it: the step runs
            # eagerly, its Function calls taking what the graphs' calls of them did (the failing one
            # raising that error again), so the model's own try/except sees it as in eager and each
            # forward runs once. Not a capture failure: later steps run the graphs.
            self._rollback.restore()
            try:
                return self.module(*args, **kwargs)
            finally:
                forget_runs(self)
        if raised_as_eager(exc):
            # A Function's forward raised on the capturing call and the model let it through: its
            # Python call of apply raised that run's error again, where eager's raises it. A rerun
            # would only run the step's side effects a second time.
            forget_runs(self)
            raise exc
        self._rollback.restore()
        try:
            # A Function the failed capture ran for real, and no graph ran since, is not run again:
            # the rerun's own call of its apply takes that run (pythonop/python_call.py).
            out = self.module(*args, **kwargs)
        except Exception as eager_exc:
            raise eager_exc from None
        finally:
            forget_runs(self)
        reason = self._failure_reason(exc)
        if self._options.fallback == "raise":
            raise CaptureError(f"fxtrain could not capture {type(self.module).__name__}: {reason}") from exc
        self._eager = True
        self._info.note_fallback(reason)
        message = (f"fxtrain could not capture {type(self.module).__name__} and runs it eagerly from now "
                   f"on: {reason}")
        logger.warning(message)
        warnings.warn(message, FallbackWarning, stacklevel=3)
        return out

    def _failure_reason(self, exc: Exception) -> str:
        """The root cause, in words a user can act on where dynamo's are not."""
        if any(isinstance(e, (dynamo_recompile_limit_error(), RecompileLimitReached)) for e in _chain(exc)):
            last = next((r.reason for r in reversed(self._info.records) if r.reason), "")
            return (f"recompile limit reached: {self._options.recompile_limit} captures "
                    f"(Options.recompile_limit, FXTRAIN_RECOMPILE_LIMIT)" + (f"; the last was: {last}" if last else ""))
        return root_cause(exc)

    def _module_device(self) -> Optional[torch.device]:
        if not self._device_known:
            devices = {t.device for t in self.module.parameters()} | {t.device for t in self.module.buffers()}
            self._device = devices.pop() if len(devices) == 1 else None
            self._device_known = True
        return self._device

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> "TrainModule":
        self._device_known = False
        self._rollback.forget()
        return super()._apply(fn, *args, **kwargs)

    # ------------------------------------------------------ the wrapped module's names and state
    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        return wrapped_state_dict(self.module, args, kwargs)   # tied entries copied: fxtrain/state_dicts.py

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        self._device_known = False
        self._rollback.forget()
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_modules(self, memo: Optional[Set[nn.Module]] = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Module]]:
        """This module at ``prefix``, then the wrapped module's own names (the wrapped module itself at
        ``prefix`` too), so that module names agree with ``named_parameters``: peft finds its adapter
        layers by module name and keeps trainable the parameters of those names."""
        memo = set() if memo is None else memo
        if self not in memo or not remove_duplicate:
            if remove_duplicate:
                memo.add(self)
            yield prefix, self
        yield from self.module.named_modules(memo, prefix, remove_duplicate)

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
