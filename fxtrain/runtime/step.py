"""The captured step: one explicit value from capture to runtime, immutable once built.

The capture pipeline (capture/pipeline.py: ``compile_step``) builds it in one go from its stages'
values (the passes' rewrite and plans, the partition, the executor's compiled callables), a cache
hit builds it from an entry, and ``runtime/runner.py`` turns it into the callable dynamo runs:
nothing reaches the runtime by another way (no ``gm.meta`` entries, no attributes found on a
``grad_fn``), and nothing writes into it afterwards (the runtime's choices live in its own
``Runtime`` value), so a step can be handed to another executor or runtime as it is.
Its parts that the passes fill (``Plans``, ``PassReport``) live here with it, below the passes,
so that the runtime and the cache read them without importing any pass.

``Plans``: one per capture, an argument of every forward pass (``run_passes`` returns it), so
nothing travels on ``gm.meta`` or other attributes found again later.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch.fx

from .absent_grads import AbsentGradBackward
from .deferred import DeferredPlan
from .dense_route import BatchGuard
from .replay import ReplaySpec


@dataclass
class Plans:
    # runtime/deferred.py: outputs computed on first use instead of in the step.
    deferred: Optional[DeferredPlan] = None
    # runtime/density.py: (what, placeholder index, absent value) measured per call.
    probes: List[Tuple[str, int, int]] = field(default_factory=list)
    # runtime/dense_route.py: conditions a batch must meet for the rewritten graph to serve it.
    guard: Optional[BatchGuard] = None
    # While the passes run: the builder ``guard`` came from, so that a later pass adds its conditions
    # and row counts to the same guard (one host transfer per step). run_passes drops it.
    guard_builder: Optional[Any] = field(default=None, repr=False, compare=False)  # GuardBuilder


@dataclass
class PassReport:
    """What every pass returns: whether it rewrote the graph and why (``capture_info().optimizations``)."""

    name: str
    applied: bool
    reason: str
    # Backward passes: memory traffic the rewrite removes per step (bytes, at the capture's sizes),
    # which the runtime weighs against the cost of replaying the backward graph (runtime/runner.py).
    saved_bytes: int = 0
    # Forward passes: forward FLOPs the rewrite skips on the capturing batch, and the kernels it adds
    # to the forward (``run_passes`` counts them), which the capture weighs on the graph's device
    # (cost/launches.py). None: not known at capture (a density computed in the graph).
    saved_flops: Optional[int] = None
    added_kernels: int = 0
    # Attention calls the rewrite made variable-length, and the kernel calls they make between them
    # on the capturing batch where the route runs one per run of equal lengths (the CPU's): host
    # work the CPU's launch model weighs (cost/launches.py), one kernel each on CUDA.
    attention_calls: int = 0
    attention_runs: int = 0

    def __str__(self) -> str:
        return f"{'on' if self.applied else 'off'}: {self.reason}"


@dataclass(frozen=True, eq=False)
class CapturedStep:
    # The torch-level graph after the forward passes: what the autograd mode runs.
    graph: Optional[torch.fx.GraphModule]
    # The same graph before any pass: what a batch the passes cannot serve runs (None: run the module).
    dense_graph: Optional[torch.fx.GraphModule]
    plans: Plans
    # AOTAutograd's aten graphs: what the graph mode runs, the dumps show and the cache stores.
    forward_graph: Optional[torch.fx.GraphModule] = None
    backward_graph: Optional[torch.fx.GraphModule] = None
    inference: bool = False
    spec: Optional[ReplaySpec] = None           # None: fxtrain's runtime cannot replay these graphs
    not_replayable: str = ""                    # ... and why
    backward_reports: List[PassReport] = field(default_factory=list)
    forward_reports: List[PassReport] = field(default_factory=list)   # passes on the aten forward graph
    # Compiled pieces (built by the executor; rebuilt after a cache load).
    compiled_forward: Optional[Callable[[List[Any]], Any]] = None
    backward: Optional[AbsentGradBackward] = None
    aot_callable: Optional[Callable[..., Any]] = None   # AOTAutograd's runtime, for unreplayable graphs
    # Options.memory_budget's plan (capture/budget.py: MemoryPlan): the graphs above are the plan's,
    # made for the graph runtime, which must then run them.
    memory_plan: Optional[Any] = None
    # Whether the eager executor should replay the aten graphs (where the backward passes act) rather
    # than run the autograd mode, and why: weighed on the step's device at capture (cost/launches.py:
    # replay_pays), read by runtime/runner.py's choose_mode.
    graph_mode_pays: Tuple[bool, str] = (False, "no backward pass applies: PyTorch's engine runs the backward")
