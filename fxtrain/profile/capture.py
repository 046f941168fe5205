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
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.fx

from ..module import TrainModule
from ..options import Options
from ..passes import DynamoExamples, ExampleSource
from ..runtime.executors import EagerExecutor, Executor, executor_named
from ..torch_private import boxed_copy
from .shadows import Shadows

logger = logging.getLogger("fxtrain")


@dataclass(frozen=True)
class NodeInfo:
    """What the tracker attributes the next ops to."""

    graph: str              # "forward" | "backward"
    name: str               # FX node name
    module: str             # qualified module name ("" for the root)
    module_type: str


_local = threading.local()
_NODES: List[Optional[NodeInfo]] = [None]
_nodes_lock = threading.Lock()


def current_node() -> Optional[NodeInfo]:
    return getattr(_local, "node", None)


def enter_node(index: int) -> None:
    """Called by the marked graphs before each op (index 0: between ops, outside any node)."""
    _local.node = _NODES[index]


def _module_of(node: torch.fx.Node, backward: bool) -> tuple:
    stack = node.meta.get("fwd_nn_module_stack" if backward else "nn_module_stack") or {}
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    return _clean_path(path), getattr(cls, "__name__", str(cls).rsplit(".", 1)[-1].rstrip("'>"))


def _clean_path(path: str) -> str:
    """dynamo's ``L['self'].bert.encoder.layer[0]`` / ``L__self___bert...`` -> ``bert.encoder.layer.0``."""
    for prefix in ("L['self'].", "L['self']", "L['module'].", "L['module']", "self.", "module."):
        if path.startswith(prefix):
            path = path[len(prefix):]
            break
    path = path.replace("[", ".").replace("]", "").replace("'", "").replace('"', "")
    path = path.replace("._modules.", ".").replace("_modules.", "")
    while ".." in path:
        path = path.replace("..", ".")
    return path.strip(".")


def mark(gm: torch.fx.GraphModule, graph: str) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose code announces each op's node to the tracker."""
    new = torch.fx.GraphModule(gm, _marked_graph(gm.graph, graph))
    return new


def _marked_graph(source: torch.fx.Graph, graph: str) -> torch.fx.Graph:
    out = torch.fx.Graph()
    env: Dict[torch.fx.Node, torch.fx.Node] = {}
    backward = graph == "backward"
    for node in source.nodes:
        if node.op == "call_function":
            module, module_type = _module_of(node, backward)
            with _nodes_lock:
                _NODES.append(NodeInfo(graph, node.name, module, module_type))
                index = len(_NODES) - 1
            out.call_function(enter_node, (index,))
        elif node.op == "output":
            out.call_function(enter_node, (0,))
        env[node] = out.node_copy(node, lambda n: env[n])
    return out


class MarkedExecutor(EagerExecutor):
    """The eager executor running marked copies of the aten graphs, on fake tensors: the tracker
    sees every op of the forward and the backward with its node, hence no autograd mode (the C++
    engine would run the backward ops outside any node); no call can count a batch's values.
    Known gap: the costs are the aten-graph runtime's; a module the runtime runs in the autograd
    mode (small dense models) can peak a few percent higher (GPT-2 tiny: +5%)."""

    autograd_mode = False
    measures_batches = False
    keeps_budget_state = True   # report.max_batch_recomputed plans the capture again at other sizes

    def __init__(self, base: Optional[Executor] = None, budget_fallback: Optional[str] = None) -> None:
        """``base``: the executor whose graphs to cost (its partitioner and decompositions: what
        inductor would compile, before fusion); the graphs themselves run marked, op by op.
        ``budget_fallback``: the user's ``Options.fallback``, which decides what a memory budget
        below the smallest achievable peak does (the profiler itself captures under "raise")."""
        self.base = base if base is not None else EagerExecutor()
        self.name = f"{self.base.name} (profiler)"
        self.skips_backward_passes = self.base.skips_backward_passes   # the base's graphs, pass for pass
        self.budget_fallback = budget_fallback

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


def profiling_module(model: torch.nn.Module, optimizations: bool, options: Optional[Options] = None,
                     examples: Optional[ExampleSource] = None) -> TrainModule:
    """A TrainModule around ``model`` that captures as fxtrain does, for the profiler's fake runs.

    ``optimizations=False`` turns the FLOP-reduction passes off: the graph is then the model's own
    computation, what eager PyTorch runs. ``examples``: where the passes read the batch's values.
    """
    base = options or Options()
    # One capture costs every batch size: symbolic sizes unless the caller asked for static ones.
    updates: Dict[str, Any] = {"fallback": "raise", "save_graphs_dir": None,
                               "dynamic": True if base.dynamic is None else base.dynamic}
    if not optimizations:
        updates.update(label_sparsity="off", padding_elimination="off", upstream_slicing="off")
    import dataclasses
    # A graph loaded from Options.cache_dir runs marked too: no capture, same attribution.
    return TrainModule(model, dataclasses.replace(base, **updates),
                       executor=MarkedExecutor(executor_named(base.executor), budget_fallback=base.fallback),
                       examples=examples)
