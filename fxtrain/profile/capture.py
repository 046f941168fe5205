"""The capture the profiler costs: TrainModule's own, with the aten graphs marked node by node.

The profiler must see exactly what fxtrain runs: the same dynamo capture, the same passes, the same
AOTAutograd partition, the same run-time wrappers (absent gradients, deferred outputs, PythonOps).
So it uses a TrainModule whose backend differs in one point only: before every op of the forward
and backward graphs the generated code calls :func:`enter_node`, a plain Python call (no tensor op),
which tells the cost tracker which graph node, hence which module, the next ops belong to. Freeing
order is untouched: the marked graphs release values exactly where the unmarked ones do.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Sequence, Union

import torch
import torch.fx

from ..capture.backend import Plugins
from ..capture.budget import BudgetState
from ..module import TrainModule
from ..options import Options
from ..passes import DynamoExamples, ExampleSource
from ..runtime.executors import EagerExecutor, Executor, executor_named
from ..torch_private import boxed_copy
from ..cost.marks import mark
from ..cost.shadows import Shadows

logger = logging.getLogger("fxtrain")


class MarkedExecutor(EagerExecutor):
    """The eager executor running marked copies of the aten graphs, on fake tensors: the tracker
    sees every op of the forward and the backward with its node, hence no autograd mode (the C++
    engine would run the backward ops outside any node); no call can count a batch's values.
    Known gap: the costs are the aten-graph runtime's; a module the runtime runs in the autograd
    mode (small dense models) can peak a few percent higher (GPT-2 tiny: +5%)."""

    autograd_mode = False

    def __init__(self, base: Optional[Executor] = None) -> None:
        """``base``: the executor whose graphs to cost (its partitioner and decompositions: what
        inductor would compile, before fusion); the graphs themselves run marked, op by op."""
        self.base = base if base is not None else EagerExecutor()
        self.name = f"{self.base.name} (profiler)"
        self.skips_backward_passes = self.base.skips_backward_passes   # the base's graphs, pass for pass

    def partition(self, joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], before_cut: Any = None,
                  **kwargs: Any) -> Any:
        return self.base.partition(joint, joint_inputs, before_cut=before_cut, **kwargs)

    def decompositions(self, keep: Sequence[Any] = ()) -> Any:
        return self.base.decompositions(keep)

    def compile(self, graph: torch.fx.GraphModule, kind: str, example_inputs: Sequence[Any]) -> Any:
        return boxed_copy(mark(graph, "backward" if kind == "backward" else "forward")).forward

    def torch_level(self, graph: torch.fx.GraphModule) -> Any:
        return mark(graph, "forward").forward


class ShadowExamples(DynamoExamples):
    """The profiler captures on fake inputs, so dynamo's examples are fake too: the passes read the
    values the session keeps behind them (its shadows) and measure the batch a real capture would."""

    def __init__(self, shadows: Shadows) -> None:
        super().__init__()
        self.shadows = shadows

    def value(self, node: Any) -> Optional[torch.Tensor]:
        example = self.example(node)
        real = self.shadows.get(example) if isinstance(example, torch.Tensor) else None
        return real if real is not None else super().value(node)


def profiling_module(model: torch.nn.Module, optimizations: Union[bool, str], options: Optional[Options] = None,
                     examples: Optional[ExampleSource] = None,
                     on_budget_state: Optional[Callable[[BudgetState], None]] = None) -> TrainModule:
    """A TrainModule around ``model`` that captures as fxtrain does, for the profiler's fake runs:
    its calls see no real batch (no batch guard, no density probes), and a memory budget below the
    smallest peak does what the user's ``Options.fallback`` says (the profiler captures under "raise").

    ``optimizations=False`` turns the FLOP-reduction passes off: the graph is then the model's own
    computation, what eager PyTorch runs; ``"all"`` keeps every pass the batch calls for, those the
    device's launch cost would turn off included (cost/launches.py: the FLOP-ideal step, where time
    follows FLOPs and launches are free). ``examples``: where the passes read the batch's values.
    ``on_budget_state``: gets each capture's budget state (report.max_batch_recomputed plans again).
    """
    base = options or Options()
    # One capture costs every batch size: symbolic sizes unless the caller asked for static ones.
    updates: Dict[str, Any] = {"fallback": "raise", "save_graphs_dir": None,
                               "dynamic": True if base.dynamic is None else base.dynamic}
    if not optimizations:
        updates.update(label_sparsity="off", padding_elimination="off", upstream_slicing="off")
    import dataclasses
    # A graph loaded from Options.cache_dir runs marked too: no capture, same attribution.
    plugins = Plugins(executor=MarkedExecutor(executor_named(base.executor)), examples=examples,
                      on_budget_state=on_budget_state, real_batches=False, budget_fallback=base.fallback,
                      weigh_launches=optimizations != "all")
    return TrainModule(model, dataclasses.replace(base, **updates), plugins=plugins)
