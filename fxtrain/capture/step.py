"""The captured step: one explicit value from capture to runtime.

Capture fills it (dynamo's graph, the passes' rewrite and plans, AOTAutograd's split), the cache
stores and loads it, and ``runtime/runner.py`` turns it into the callable dynamo runs: nothing
reaches the runtime by another way (no ``gm.meta`` entries, no attributes found on a ``grad_fn``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch.fx

from ..passes.base import PassReport
from ..passes.plans import Plans
from ..runtime.absent_grads import AbsentGradBackward
from ..runtime.replay import ReplaySpec


@dataclass
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
    mode: str = ""                               # "autograd" | "graph" | "aot", chosen by the runtime
    mode_reason: str = ""
    # Options.memory_budget's plan (capture/budget.py: MemoryPlan): the graphs above are the plan's,
    # made for the graph runtime, which must then run them.
    memory_plan: Optional[Any] = None
    # What re-planning this capture needs (capture/budget.py: BudgetState), for executors that
    # keep it (the profiler's: the largest batch that fits with recomputation).
    budget_state: Optional[Any] = field(default=None, repr=False)
