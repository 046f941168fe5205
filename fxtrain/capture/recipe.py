"""What only dynamo knows, noted while it captures, so that a later process can skip it.

Dynamo turns ``module(*args, **kwargs)`` into a call of the graph on flat inputs (parameters,
buffers, input tensors, sizes), each named by a *source* such as
``L['module']._modules['bert']._parameters['weight']`` or ``L['kwargs']['input_ids'].size()[0]``.
Those names are Python expressions: evaluated on the next call they give that call's graph inputs,
which is all a cache hit needs instead of re-tracing. The shape guards of the capture (which sizes
may vary, which must match) are kept as one expression; the source files dynamo traced are hashed.

Anything dynamo would do besides calling the graph makes the capture uncacheable: side effects on
existing objects, hooks, inputs that are not reachable from the call's arguments (globals).
"""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.fx

from .. import torch_private as tp

logger = logging.getLogger("fxtrain")


@dataclass
class Recipe:
    sources: List[str] = field(default_factory=list)
    checks: List[Optional[Tuple[str, bool]]] = field(default_factory=list)  # tensor inputs: dtype, requires_grad
    guard_code: Optional[str] = None
    files: Dict[str, str] = field(default_factory=dict)
    bypass: Optional[str] = None                 # why this capture cannot be cached
    plan: Optional[Any] = None                   # portable DeferredPlan
    probes: List[Tuple[str, int, int]] = field(default_factory=list)
    guard: Optional[Any] = None                  # BatchGuard: batches the sparse graph cannot serve
    watching: bool = True
    last_outputs: Optional[Any] = None           # the graph's outputs on the capturing call


def _noop_mutation(tx: Any, variable: Any) -> bool:
    """An attribute store on an existing object that leaves it as it was (set, then reset)."""
    stores = tx.output.side_effects.store_attr_mutations.get(variable)
    if not stores:
        return False
    obj = getattr(variable, "value", None)
    if obj is None:
        return False
    for name, vt in stores.items():
        if not vt.is_python_constant():
            return False
        try:
            if getattr(obj, name) != vt.as_python_constant():
                return False
        except Exception:
            return False
    return True


def _side_effects(tx: Any) -> Optional[str]:
    new_objects = tp.dynamo_new_object_mutation_types()
    effects = tx.output.side_effects
    if effects.tensor_hooks or effects.save_for_backward:
        return "the model registers tensor hooks or saves tensors for backward outside the graph"
    for variable in list(effects.id_to_variable.values()):
        if not effects.is_modified(variable):
            continue
        if isinstance(variable.mutation_type, new_objects):
            continue  # objects created during the call (the output dataclass, lists): rebuilt from outputs
        if _noop_mutation(tx, variable):
            continue
        return f"the model changes an existing object ({type(variable).__name__}) as a side effect"
    return None


def start(gm: torch.fx.GraphModule) -> Recipe:
    """Called in the backend before our passes: sources, side effects, traced files."""
    recipe = Recipe()
    try:
        tx = tp.current_instruction_translator()
        recipe.bypass = _side_effects(tx)
    except Exception as e:  # no translator: not a normal dynamo capture
        recipe.bypass = f"no dynamo context ({type(e).__name__})"
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
        name = source.name if source is not None else None
        name = name() if callable(name) else name
        if not isinstance(name, str) or not name.startswith("L["):
            recipe.bypass = recipe.bypass or f"graph input {node.name} does not come from the call's arguments"
            name = ""
        recipe.sources.append(name)
        value = node.meta.get("example_value")
        recipe.checks.append((str(value.dtype), bool(value.requires_grad)) if isinstance(value, torch.Tensor) else None)
    recipe.files = source_files(tp.dynamo_traced_code())
    return recipe


def finish(recipe: Recipe, gm: torch.fx.GraphModule, plans: Any) -> None:
    """Called after compilation, when every shape guard (dynamo's and AOTAutograd's) is known;
    ``plans``: the step's (runtime/step.py: Plans), which a hit runs with."""
    recipe.plan = plans.deferred.portable() if plans.deferred is not None else None
    recipe.probes = list(plans.probes)
    recipe.guard = plans.guard
    values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    shape_env = next((v.fake_mode.shape_env for v in values if isinstance(v, torch.Tensor)
                      and getattr(v, "fake_mode", None) is not None), None)
    if shape_env is None:
        return
    try:
        recipe.guard_code = shape_env.produce_guards_expression(values, ignore_static=False)
    except Exception as e:
        recipe.bypass = recipe.bypass or f"shape guards could not be written down ({type(e).__name__}: {e})"


def watch(recipe: Recipe, compiled: Any) -> Any:
    """Remember the graph's outputs of the capturing call: the returned object is built from them."""
    def run(*args: Any) -> Any:
        out = compiled(*args)
        if recipe.watching:
            recipe.last_outputs, recipe.watching = out, False
        return out
    return run


def file_digest(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def source_files(codes: Iterable[Any]) -> Dict[str, str]:
    """sha256 of every real file the traced code came from (frozen and generated code has none)."""
    files: Dict[str, str] = {}
    for code in codes:
        path = getattr(code, "co_filename", "")
        if path and path not in files and os.path.isfile(path):
            digest = file_digest(path)
            if digest is not None:
                files[path] = digest
    return files


def changed_files(files: Dict[str, str]) -> List[str]:
    return [path for path, digest in files.items() if file_digest(path) != digest]
