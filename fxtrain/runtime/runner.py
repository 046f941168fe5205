"""The one runtime: a ``CapturedStep`` in, the callable dynamo (or a cache hit) runs out.

Three ways to run a step's core, chosen per capture (``choose_mode``):

- "autograd": the torch-level graph after fxtrain's forward passes runs under PyTorch's own
  autograd; the C++ engine runs the backward, node by node, freeing saved tensors as it goes. The
  fewest Python calls per step: on small or dense models the aten replay's per-op Python call
  (several µs each) is the step. Only an executor that runs ops as written offers it.
- "graph": the aten forward and backward graphs run through ``runtime/replay.py`` with the
  executor's compiled code. Chosen when fxtrain's backward passes (which exist only on the aten
  backward graph: the vocabulary-wide one-hot of cross-entropy, a tied embedding's zero-filled
  gradient) save more than replaying the backward op by op costs on the step's device (weighed at
  capture: ``CapturedStep.graph_mode_pays``, cost/launches.py: ``replay_pays``), or when the
  executor compiles (inductor), or on the profiler's fake tensors.
- "aot": AOTAutograd's own runtime, for graphs whose metadata the replay does not handle
  (aliased outputs, subclasses, ...; ``NotReplayable`` says which).

Around the core, the same wrappers whatever the mode: deferred outputs (the passes' plan), the
dense route (batches the rewritten graph cannot serve), the density probes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch

from .info import Densities
from .step import CapturedStep
from .absent_grads import release_materialization
from .checkpointed import checkpointing_eagerly
from .deferred import with_deferred
from .dense_route import DenseRoute
from .direct import direct
from .density import with_density_probes
from .executors import Executor
from .replay import replayed

logger = logging.getLogger("fxtrain")

MODES = ("auto", "autograd", "graph")


@dataclass
class RunContext:
    """Where a step's calls report (the module's CaptureInfo) and how they behave.

    ``measures_batches``: calls see real values, so the batch guard and the density probes run
    (false for the profiler, whose calls run on fake tensors)."""

    density: Optional[Densities]
    log_density: bool
    count_dense_batch: Callable[[str], bool]   # CaptureInfo.count_dense_batch
    sparsity_guard: str
    owner: str
    measures_batches: bool = True


@dataclass(frozen=True)
class Runtime:
    """What the runtime made of a step: the callable dynamo runs, and the mode it runs in and why.
    The runtime's own value: the step it was built from is left as it was."""

    call: Callable[..., Any]
    mode: str       # "autograd" | "graph" | "aot"
    reason: str

    def __str__(self) -> str:
        return f"{self.mode}: {self.reason}"


def choose_mode(step: CapturedStep, executor: Executor, preference: str = "auto") -> Tuple[str, str]:
    """("autograd" | "graph" | "aot", why)."""
    if preference not in MODES:
        raise ValueError(f"unknown backward mode {preference!r}; choose one of {MODES}")
    graph_mode = ("graph", "") if step.spec is not None else ("aot", f"not replayable: {step.not_replayable}")
    if step.memory_plan is not None:
        # The budget was planned, and costed, on the aten graphs: only the graph mode runs them.
        return graph_mode[0], graph_mode[1] or "memory budget: the plan is made for the aten graphs"
    can_autograd = executor.autograd_mode and step.graph is not None
    if preference == "graph" or not can_autograd:
        why = f"executor {executor.name} compiles the aten graphs" if not executor.autograd_mode else \
            "asked for (Options.backward)" if preference == "graph" else "no torch-level graph (cache entry)"
        return graph_mode[0], graph_mode[1] or why
    if preference == "autograd":
        return "autograd", "asked for (Options.backward)"
    if step.inference:
        return "autograd", "no backward to run"
    pays, why = step.graph_mode_pays
    return (graph_mode[0], graph_mode[1] or why) if pays else ("autograd", why)


def _aot_runtime(aot_callable: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        out = aot_callable(*args)
        if torch.is_grad_enabled():
            release_materialization(out)
        return out
    return run


def core_for(step: CapturedStep, executor: Executor, preference: str = "auto",
             tiered: Optional[Callable[[Callable[..., Any]], Callable[..., Any]]] = None
             ) -> Tuple[Callable[..., Any], str, str]:
    """What runs ``step``'s graphs (the flat graph inputs in, the dynamo graph's outputs out), the
    mode and why. ``tiered`` wraps it (runtime/tiered.py swaps the code it runs later)."""
    mode, reason = choose_mode(step, executor, preference)
    if mode == "autograd":
        assert step.graph is not None
        core: Callable[..., Any] = executor.torch_level(step.graph)
    elif mode == "graph":
        assert step.spec is not None and step.compiled_forward is not None
        core = replayed(step.compiled_forward, step.backward, step.spec)
    else:
        assert step.aot_callable is not None
        core = _aot_runtime(step.aot_callable)
    return (tiered(core) if tiered is not None else core), mode, reason


def build(step: CapturedStep, executor: Executor, context: RunContext, preference: str = "auto",
          tiered: Optional[Callable[[Callable[..., Any]], Callable[..., Any]]] = None,
          later: Optional[Callable[[Callable[..., Any]], Callable[..., Any]]] = None) -> Runtime:
    """The runtime for ``step``: its ``call`` takes the flat graph inputs and returns the dynamo
    graph's outputs. (Only the "aot" mode needs ``step.aot_callable``: a caller keeping the step
    may drop it, ``dataclasses.replace(step, aot_callable=None)``, with what AOTAutograd holds.)
    ``tiered`` wraps the core (what runs the graphs), inside the deferred outputs, dense route and
    probes, so that a core swapped later (runtime/tiered.py) keeps them. ``later``: ``step`` is
    not partitioned yet; its autograd mode runs until ``later`` (runtime/pending.py) swaps in the
    core of the whole step, made by ``core_for``."""
    if later is not None:
        assert step.graph is not None and executor.autograd_mode
        core = later(executor.torch_level(step.graph))
        mode, reason = "autograd", "while the partition runs in the background"
    else:
        core, mode, reason = core_for(step, executor, preference, tiered)
    logger.debug("%s: runtime mode %s (%s)", context.owner, mode, reason)
    plans = step.plans
    if plans.deferred is not None:
        core = with_deferred(core, plans.deferred)
    if plans.guard is not None and context.measures_batches:
        route = DenseRoute(plans.guard, context.count_dense_batch, context.sparsity_guard, context.owner)
        if step.dense_graph is not None:   # a cache hit has none: cache/call.py runs the module instead
            core = route.wrap(core, direct(checkpointing_eagerly(step.dense_graph)))
    if plans.probes and context.measures_batches and context.density is not None:
        core = with_density_probes(core, plans.probes, context.density, context.log_density)
    return Runtime(core, mode, reason)
