"""One model made fake once, its step run on fake tensors as many times as batches are asked for.

Capture is the slow part (dynamo and AOTAutograd over the whole model); a fake step is a few
thousand ops whatever the batch size. A session captures once, with symbolic sizes as fxtrain
always does, so further batch sizes (``max_batch``'s fit) reuse the graphs. Steps are the steady
state ``step.py`` defines: a first, unmeasured step captures, compiles the backward and creates the
optimizer state; the measured step starts with parameters, buffers, optimizer state and the batch
alive and no gradients. The loop convention (``keep_outputs``) is an argument of each measured
step, not of the session: when the loop releases the outputs changes nothing in the capture, so
both loops are costed with the same graphs.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from ..module import CaptureError
from ..torch_private import FakeTensorMode, reparametrize_module
from .capture import ShadowExamples, profiling_module
from .eager_modules import ModuleAttribution
from .inputs import fake_values, target_device, to_fake
from ..cost.step import OptimizerSpec, held_by_outputs, loss_of, optimizer_over, warm_optimizer_state
from ..cost.shadows import Shadows
from ..cost.tracker import CostTracker, ProfileError

logger = logging.getLogger("fxtrain")


@dataclass
class StepCost:
    """What one measured fake step produced (raw; report.py turns it into a ProfileReport)."""

    tracker: CostTracker
    seconds: float
    args: Any
    kwargs: Any
    fractions: List[float] = field(default_factory=list)
    keep_outputs: bool = True


class Session:
    def __init__(self, model: torch.nn.Module, optimizer: OptimizerSpec = None, optimizations: Union[bool, str] = True,
                 options: Any = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"fxtrain.profile costs a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.optimizations = optimizations
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.shadows = Shadows()
        self.device: Optional[torch.device] = None
        self.options = options
        # optimizations=False costs eager PyTorch itself: the module runs on fake tensors as written,
        # autograd saving what eager saves. (If it cannot run on fake tensors, e.g. a Function that
        # leaves torch, the captured graph without passes stands in; see _warm_up.)
        self.eager = not optimizations
        self.optimizer_spec = optimizer
        self.budget_states: List[Any] = []
        self.tm = None if self.eager else self._profiling_module(optimizations)
        self.modules: Optional[ModuleAttribution] = None
        self.fallback_reason: Optional[str] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.fakes: Dict[str, torch.Tensor] = {}
        self.fake_params: List[torch.nn.Parameter] = []
        self.warm = False
        self.optimizer_ready = False
        self.capture_seconds = 0.0

    def _profiling_module(self, optimizations: Union[bool, str]) -> Any:
        # What re-planning the module's training captures for a memory budget needs (capture/budget.py).
        self.budget_states = []
        tm = profiling_module(self.model, optimizations, self.options, ShadowExamples(self.shadows),
                              self.budget_states.append)
        # A memory budget (Options.memory_budget) counts the optimizer the profile costs.
        tm.attach_optimizer(self.optimizer_spec)
        return tm

    # ---------------------------------------------------------------------------- model state
    def _make_fakes(self, device: torch.device) -> None:
        by_id: Dict[int, torch.Tensor] = {}
        mapping: Dict[torch.Tensor, torch.nn.Parameter] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) not in by_id:
                fake = torch.nn.Parameter(to_fake(p, self.mode, device), requires_grad=p.requires_grad)
                by_id[id(p)] = fake
                mapping[p] = fake
                self.fake_params.append(fake)
            self.fakes[name] = by_id[id(p)]
        for name, b in self.model.named_buffers(remove_duplicate=False):
            if id(b) not in by_id:
                by_id[id(b)] = to_fake(b, self.mode, device)
                if b.device.type != "meta" and b.numel() <= (1 << 20):
                    self.shadows.set(by_id[id(b)], b)   # small buffers (position ids) keep their values
            self.fakes[name] = by_id[id(b)]
        self._param_map = mapping

    def use_optimizer(self, spec: OptimizerSpec) -> None:
        """Cost another optimizer with the same captured graphs: only its state is rebuilt."""
        if spec is self.optimizer_spec or (isinstance(spec, str) and spec == self.optimizer_spec):
            return
        self.optimizer_spec = spec
        self.optimizer = None
        self.optimizer_ready = False
        for state in self.budget_states:
            state.set_optimizer(spec)
        if self.tm is not None and self.tm.options.memory_budget is not None:
            # The captured plans counted the previous optimizer's state: plan (capture) again.
            self.tm = self._profiling_module(self.optimizations)
            self.warm = False

    @contextlib.contextmanager
    def _active(self, tracker: CostTracker) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.eager:
                self.modules = ModuleAttribution(self.model)
                stack.enter_context(self.modules)
                tracker.module_source = self.modules.current
            stack.enter_context(reparametrize_module(self.model, self.fakes, tie_weights=False, strict=False))
            stack.enter_context(self.mode)
            stack.enter_context(tracker)
            yield

    # ------------------------------------------------------------------------------------ step
    def _step(self, tracker: CostTracker, args: Any, kwargs: Any, keep_outputs: bool = True) -> None:
        # The outputs go to _rest_of_step in a list it empties, not as an argument: a caller's
        # evaluation stack may hold an argument until the call returns, and then dropping the
        # outputs inside would free nothing before the backward. CPython does so whenever a call is
        # not inlined: on 3.10, and on 3.11+ under any PEP 523 frame evaluator, such as dynamo's,
        # which torch leaves installed for the rest of the process once a fullgraph capture has
        # failed (a profile that fell back to eager, a TrainModule's fallback).
        outputs = [self._forward(tracker, args, kwargs)]
        self._rest_of_step(tracker, outputs, keep_outputs)

    def _forward(self, tracker: CostTracker, args: Any, kwargs: Any) -> Any:
        tracker.phase = "forward"
        with tracker.watching_saved():
            return (self.model if self.eager else self.tm)(*args, **kwargs)

    def _rest_of_step(self, tracker: CostTracker, outputs: List[Any], keep_outputs: bool = True) -> None:
        """Backward and optimizer step, with the outputs held through the backward or dropped first.

        ``outputs`` is a list holding the forward's result, which this takes out of it: the list is
        how the caller hands over its only reference (see _step)."""
        out = outputs.pop()
        loss = loss_of(out)
        tracker.watch_outputs(held_by_outputs(out, loss), loss)
        if not keep_outputs:
            out = None   # ``loss = model(...).loss``: nothing but the loss outlives the forward
        tracker.phase = "backward"
        loss.backward()
        del out, loss
        tracker.phase = "optimizer"
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            for p in self.fake_params:
                p.grad = None
        tracker.phase = "end"

    def run(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], hints: Optional[List[float]] = None,
            keep_outputs: bool = True) -> StepCost:
        device = target_device(self.model, (args, kwargs), default=self.device)
        if self.device is None:
            self.device = device
            self._make_fakes(device)
        elif device != self.device and device.type != "meta":
            raise ValueError(f"fxtrain.profile: inputs on {device}, the session is on {self.device}")
        fake_args, pairs_a = fake_values(args, self.mode, self.device)
        fake_kwargs, pairs_k = fake_values(kwargs, self.mode, self.device)
        for fake, real in pairs_a + pairs_k:
            self.shadows.set(fake, real)
        try:
            return self._measure(fake_args, fake_kwargs, args, kwargs, hints, keep_outputs)
        except ProfileError:
            raise
        except CaptureError as e:
            if self.eager:
                raise
            # fxtrain itself would warn and run this module eagerly (fallback="eager"): cost that.
            logger.warning("fxtrain profile: %s; costing eager PyTorch, which fxtrain would fall back to", e)
            self.fallback_reason = str(e)
            self._start_over(eager=True)
            return self._measure(fake_args, fake_kwargs, args, kwargs, hints, keep_outputs)
        except Exception as e:
            if not self.eager:
                raise
            logger.warning("fxtrain profile: the module does not run eagerly on fake tensors (%s: %s); "
                           "costing its captured graph without passes instead", type(e).__name__, e)
            self._start_over(eager=False)
            return self._measure(fake_args, fake_kwargs, args, kwargs, hints, keep_outputs)

    def _start_over(self, eager: bool) -> None:
        """Cost eagerly, or a capture without passes, from a cold start (the failed attempt's
        gradients dropped)."""
        self.eager = eager
        self.warm = False
        self.optimizer_ready = False
        self.tm = None if eager else self._profiling_module(False)
        for p in self.fake_params:
            p.grad = None

    def _warm_up(self, fake_args: Any, fake_kwargs: Any, hints: Optional[List[float]]) -> None:
        """Reach steady state: graphs captured, backward compiled, optimizer state allocated.

        Eagerly there is nothing to capture, so only the optimizer's state is made (one optimizer
        step on stand-in gradients), which is much cheaper than a whole step.
        """
        started = time.perf_counter()
        warm = CostTracker(self.mode, hints)
        warm.shadows = self.shadows
        trainable = [p for p in self.fake_params if p.requires_grad]
        with self._active(warm):
            if self.optimizer is None:
                self.optimizer = optimizer_over(self.optimizer_spec, trainable, self._param_map)
            if self.eager or self.warm:
                warm_optimizer_state(self.optimizer, trainable)
            else:
                # Capturing needs the whole step (AOTAutograd compiles the backward at the first
                # backward); graphs loaded from Options.cache_dir come with their backward.
                assert self.tm is not None
                hits = self.tm.capture_info().cache_hits
                out = self._forward(warm, fake_args, fake_kwargs)
                if self.tm.capture_info().cache_hits > hits:
                    del out
                    warm_optimizer_state(self.optimizer, trainable)
                else:
                    self._rest_of_step(warm, [out])
        if not self.warm:
            self.capture_seconds = time.perf_counter() - started
        self.warm = True
        self.optimizer_ready = True
        logger.info("fxtrain profile: warm-up (capture, first fake step) took %.2f s", self.capture_seconds)

    def _captures(self) -> int:
        info = self.tm.capture_info() if self.tm is not None else None
        return 0 if info is None else info.graphs + info.cache_hits

    def _measure(self, fake_args: Any, fake_kwargs: Any, args: Any, kwargs: Any,
                 hints: Optional[List[float]], keep_outputs: bool = True) -> StepCost:
        if not self.warm or not self.optimizer_ready:
            self._warm_up(fake_args, fake_kwargs, hints)
        # A step that captures (or loads) a graph is not the steady state: new sizes under static
        # capture, a size dynamo specialises (0 or 1), a new input schema. Tracing allocates fake
        # tensors of its own and a first backward compiles, so such a step is measured again once
        # the graphs exist.
        for _ in range(2):
            before = self._captures()
            cost = self._measure_once(fake_args, fake_kwargs, args, kwargs, hints, keep_outputs)
            if self._captures() == before:
                return cost
            self.capture_seconds += cost.seconds
            logger.info("fxtrain profile: the step captured a new graph (%.2f s); measuring it again", cost.seconds)
        raise ProfileError("fxtrain profile: the model captures a new graph on every call with these inputs; "
                           "no steady state to cost (see capture_info() of a TrainModule on them)")

    def _measure_once(self, fake_args: Any, fake_kwargs: Any, args: Any, kwargs: Any,
                      hints: Optional[List[float]], keep_outputs: bool = True) -> StepCost:
        started = time.perf_counter()
        tracker = CostTracker(self.mode, hints)
        tracker.shadows = self.shadows
        tracker.register(list(self.fakes.values()), "parameters")
        if self.optimizer is not None:
            tracker.register([list(s.values()) for s in self.optimizer.state.values()], "optimizer state")
        tracker.register([fake_args, fake_kwargs], "inputs")
        # Frees are counted as they happen (weakref finalizers on storages): with the cyclic
        # collector off during the step, a storage is freed when its last reference goes, not when a
        # collection happens to run; and nothing counts once the step is over (a collection during a
        # later costing once added 3 'end' events to this step's timeline).
        enabled = gc.isenabled()
        gc.disable()
        try:
            tracker.start_measuring()
            with self._active(tracker):
                self._step(tracker, fake_args, fake_kwargs, keep_outputs)
        finally:
            tracker.counting = False   # a later free (the caller dropping outputs) is not this step's
            if enabled:
                gc.enable()
        seconds = time.perf_counter() - started
        return StepCost(tracker=tracker, seconds=seconds, args=args, kwargs=kwargs,
                        fractions=list(tracker.fractions), keep_outputs=keep_outputs)
