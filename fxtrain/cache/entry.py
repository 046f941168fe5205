"""A cache entry: the graphs of one capture plus what it takes to call them without dynamo.

Graphs are pickled with torch's GraphPickler, keeping only the node metadata the runtime reads
(shapes and dtypes of the backward graph's placeholders and add operands, for absent-gradient
specialisation, as plain descriptions rather than fake tensors, which are slow to rebuild) and
the innermost module of each node (the profiler's attribution): the rest (stack traces, fake values
of every node, whole module stacks) would triple the size and the load time.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx

from .. import torch_private as tp
from ..runtime.lean_meta import MODULE_META, lean_meta
from ..runtime.replay import NotReplayable, ReplaySpec, check_graph_arity
from .key import versions
from ..capture.recipe import Recipe

FORMAT = 2   # 2: the torch-level graph and the runtime mode of the capture
_PLAIN = (bool, int, float, complex, str, bytes, type(None))


@dataclass
class Entry:
    recipe: Recipe
    spec: ReplaySpec
    forward_graph: torch.fx.GraphModule
    backward_graph: Optional[torch.fx.GraphModule]
    treespec: Any
    leaves: List[Tuple[str, Any]]                      # ("out", index), ("const", value), ...: _leaf_recipe
    optimizations: Dict[str, str] = field(default_factory=dict)
    header: Dict[str, Any] = field(default_factory=dict)
    # The rewritten torch-level graph and the runtime mode the capture chose: a hit runs as the
    # live capture did ("autograd" runs ``graph`` under PyTorch's engine; "graph" the aten graphs).
    graph: Optional[torch.fx.GraphModule] = None
    mode: str = "graph"
    # Options.memory_budget's plan (capture/budget.py: MemoryPlan): the graphs are the plan's, and a
    # hit reports it in capture_info() as the live capture did.
    memory_plan: Optional[Any] = None


def output_recipe(out: Any, graph_outputs: Any) -> Tuple[Any, List[Tuple[str, Any]]]:
    """How the returned object is built from the graph's outputs (by identity), or NotReplayable."""
    if graph_outputs is None:
        raise NotReplayable("the graph's outputs were not seen")
    by_id = {id(t): i for i, t in enumerate(graph_outputs) if isinstance(t, torch.Tensor)}
    leaves, spec = tp.tree_flatten(out)
    return spec, [_leaf_recipe(leaf, by_id) for leaf in leaves]


def _leaf_recipe(leaf: Any, by_id: Dict[int, int], depth: int = 0) -> Tuple[str, Any]:
    """("out", graph output index), ("const", value), ("list"/"tuple"/"dict", items) or ("object",
    (class, attribute recipes)). An object that is no pytree node is rebuilt from its attributes
    (``__new__``, then its ``__dict__``) when they are tensors the graph returns, plain values or
    more of the same, and at least one is such a tensor, so the object holds this call's results:
    transformers' ``DynamicCache``, which HF causal LMs return with their default ``use_cache``. An
    object holding none (a config, a shared helper) would come back as a copy where eager returns
    the very object: refused, as are objects with slots or their own pickling."""
    if isinstance(leaf, torch.Tensor):
        if id(leaf) not in by_id:
            raise NotReplayable("the model returns a tensor that is not a graph output")
        return ("out", by_id[id(leaf)])
    if isinstance(leaf, _PLAIN + (torch.dtype, torch.device)):
        return ("const", leaf)
    kind = type(leaf)
    if depth < 4 and kind in (list, tuple):
        return (kind.__name__, [_leaf_recipe(x, by_id, depth + 1) for x in leaf])
    if depth < 4 and kind is dict and all(isinstance(k, _PLAIN) for k in leaf):
        return ("dict", [(k, _leaf_recipe(v, by_id, depth + 1)) for k, v in leaf.items()])
    state = getattr(leaf, "__dict__", None)
    if (depth < 4 and isinstance(state, dict) and not any(c.__dict__.get("__slots__") for c in kind.__mro__)
            and kind.__reduce_ex__ is object.__reduce_ex__ and kind.__reduce__ is object.__reduce__):
        attrs = {name: _leaf_recipe(v, by_id, depth + 1) for name, v in state.items()}
        if _holds_output(list(attrs.values())):
            return ("object", (kind, attrs))
    raise NotReplayable(f"the model returns a {kind.__name__}, which fxtrain cannot rebuild")


def _holds_output(recipes: List[Tuple[str, Any]]) -> bool:
    return any(kind == "out" or (kind in ("list", "tuple") and _holds_output(value)) or
               (kind == "dict" and _holds_output([v for _, v in value])) or
               (kind == "object" and _holds_output(list(value[1].values()))) for kind, value in recipes)


def rebuild_leaf(recipe: Tuple[str, Any], outs: Any) -> Any:
    kind, value = recipe
    if kind == "out":
        return outs[value]
    if kind == "const":
        return value
    if kind in ("list", "tuple"):
        items = [rebuild_leaf(r, outs) for r in value]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {k: rebuild_leaf(r, outs) for k, r in value}
    cls, attrs = value
    obj = cls.__new__(cls)
    obj.__dict__.update({name: rebuild_leaf(r, outs) for name, r in attrs.items()})
    return obj


def outputs_of(recipe: Recipe, out: Any) -> Tuple[Any, List[Tuple[str, Any]]]:
    """How the capturing call's returned object is built from the graph's outputs (the entry's
    ``treespec`` and ``leaves``), read at that call: or NotReplayable."""
    if recipe.bypass:
        raise NotReplayable(recipe.bypass)
    return output_recipe(out, recipe.last_outputs)


def build(step: Any, mode: str, recipe: Recipe, outputs: Tuple[Any, List[Tuple[str, Any]]],
          about: Dict[str, Any]) -> Entry:
    """The entry for a whole step (partitioned) that runs in runtime ``mode``, or NotReplayable.
    ``outputs``: ``outputs_of`` the capturing call."""
    if step is None or step.forward_graph is None or step.spec is None:
        raise NotReplayable(getattr(step, "not_replayable", "") or "the capture has no aten graphs")
    for gm in (step.forward_graph,):
        if any(n.op == "call_function" and str(n.target).startswith("fxtrain.python_op") for n in gm.graph.nodes):
            raise NotReplayable("the graph holds custom autograd Functions (PythonOps), which are not cached yet")
    spec = step.spec
    check_graph_arity(step.forward_graph, step.backward_graph, spec, recipe.sources)
    treespec, leaves = outputs
    header = dict(about, format=FORMAT, created=time.time(), **versions())
    return Entry(recipe=recipe, spec=spec, forward_graph=step.forward_graph, backward_graph=step.backward_graph,
                 graph=step.graph if mode == "autograd" else None, mode=mode,
                 treespec=treespec, leaves=leaves, header=header, memory_plan=step.memory_plan)


def _plan_graphs(recipe: Recipe) -> List[torch.fx.GraphModule]:
    """The dynamo-level graphs a recipe holds: the deferred outputs' and the batch guard's."""
    plan = recipe.plan
    guard = [recipe.guard.check] if recipe.guard is not None else []
    if plan is None:
        return guard
    found, stack = guard, [plan.gm]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.fx.GraphModule):
            found.append(obj)
        elif obj is not None and hasattr(obj, "__dict__"):
            stack.extend(v for v in vars(obj).values() if isinstance(v, torch.fx.GraphModule) or
                         type(v).__name__ == "_DenseThenHead")
    return found


def dumps(entry: Entry) -> bytes:
    with contextlib.ExitStack() as stack:
        fakes = entry.header.get("executor", "eager") != "eager"
        stack.enter_context(lean_meta(entry.forward_graph, keep_values=False, keep_fakes=fakes))
        stack.enter_context(lean_meta(entry.graph, keep_values=False))
        stack.enter_context(lean_meta(entry.backward_graph, keep_values=True, keep_fakes=fakes))
        for gm in _plan_graphs(entry.recipe):
            stack.enter_context(lean_meta(gm, keep_values=False))
        recipe = entry.recipe
        last, recipe.last_outputs = recipe.last_outputs, None
        try:
            return tp.pickle_graphs(entry)
        finally:
            recipe.last_outputs = last


def loads(payload: bytes) -> Entry:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    entry = tp.unpickle_graphs(payload, tp.FakeTensorMode(shape_env=ShapeEnv()))
    if not isinstance(entry, Entry):
        raise TypeError(f"payload holds a {type(entry).__name__}, not a cache entry")
    for gm in [entry.forward_graph, entry.backward_graph, entry.graph, *_plan_graphs(entry.recipe)]:
        if gm is not None:
            for n in gm.graph.nodes:
                if MODULE_META in n.meta:
                    name, key, path, cls = n.meta.pop(MODULE_META)
                    n.meta[name] = {key: (path, cls)}
            gm.recompile()
    return entry

