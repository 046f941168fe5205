"""Custom ops whose backward no graph can hold: found before AOTAutograd, and called between graphs.

A custom op (``torch.library.custom_op``) with a Python backward (``register_autograd``) is one node
in dynamo's graph, and AOTAutograd traces its backward on fake tensors. A backward that reads
tensor values in Python (``for end in offs.tolist()``, transformers' ``grouped_mm_fallback`` before
5.2x) fails there with a data-dependent error, after the whole graph was traced. Dynamo's answer to
that error is a graph break somewhere earlier and another try: on a 2-layer HF Mixtral (torch
2.11, transformers 5.17) eleven tries of the 300-node graph (34 s of a 64 s first step) before the
breaks landed around the op; on a model whose layer loop holds the op, no graph at all.

So before AOTAutograd traces a graph in the training process, the backend runs each custom op's
forward and backward on the capture's fake tensors (a few milliseconds). An op whose backward fails
there is learnt by that TrainModule: the backend raises the error at once (dynamo files it and
traces the frame again), and from then on dynamo breaks the graph at each call of the op while the
module captures with gradients on (``UntraceableOps.breaking``); the op runs between graphs as
eager runs it, forward and backward. That Mixtral's first step at a new batch size (symbolic):
70-75 s -> 23-27 s, one failed try (bench/moe_first_step.py). A
capture that the partition worker partitions later runs in the autograd mode meanwhile, which runs
the op's own backward: it keeps the op in its graph (one graph), and stays in the autograd mode
when the worker's trace fails on it. Outside a module's captures (a user's torch.compile, an
inference capture) dynamo treats the op as before. A custom op whose backward is itself an op with a
fake implementation (transformers 5.2x's ``grouped_mm_fallback_backward``) traces, and stays in the
graph.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.fx

from .. import torch_private as tp

logger = logging.getLogger("fxtrain")

# Namespaces whose ops are torch's or fxtrain's own: their backwards are traceable or handled.
_OWN_NAMESPACES = frozenset({"aten", "prims", "fxtrain"})


_reasons: Dict[str, str] = {}   # qualified op name -> why its backward cannot be traced (a fact of the op)


class UntraceableOps:
    """One TrainModule's custom ops whose backward cannot be traced, learnt by its backend. Per
    module, as its graph breaks are: what one module met never changes how another captures."""

    def __init__(self) -> None:
        self._ops: List[Any] = []          # as dynamo's graphs call them (packet or overload)
        self._installed: List[Any] = []    # those this module's open compile made dynamo break at
        self._depth = 0

    def _install(self, op: Any) -> None:
        if self._depth and op not in self._installed and tp.dynamo_break_at(op):
            self._installed.append(op)

    @contextlib.contextmanager
    def breaking(self) -> Iterator[None]:
        """While the module compiles a frame with gradients on: dynamo breaks the graph at every op
        learnt so far (and at those learnt during the compile), and forgets them on the way out.
        Ops another module or the user made dynamo break at stay as they were."""
        if not torch.is_grad_enabled():
            yield
            return
        self._depth += 1
        try:
            for op in list(self._ops):
                self._install(op)
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                for op in self._installed:
                    tp.dynamo_unbreak_at(op)
                self._installed.clear()

    def check(self, gm: torch.fx.GraphModule) -> None:
        """Raise the error of the first custom op in dynamo's graph ``gm`` whose backward cannot be
        traced, after learning it (module docstring). Each op is tried once per graph."""
        tried = set()
        for node in gm.graph.nodes:
            op = node.target
            if node.op != "call_function" or op in tried:
                continue
            name = tp.op_qualified_name(op)
            if name is None or name.partition("::")[0] in _OWN_NAMESPACES:
                continue
            tried.add(op)
            error = _backward_error(node)
            if error is None:
                continue
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            why = (f"the backward of custom op {name} cannot be traced ({type(error).__name__}: {first}: it "
                   f"reads tensor values in Python); each call runs between graphs, as eager runs it")
            if _reasons.setdefault(name, why) is why:
                logger.warning("fxtrain: %s. A backward written as a custom op with a fake "
                               "implementation would keep it in the graph.", why)
            if op not in self._ops:
                self._ops.append(op)
            self._install(op)
            raise error


def explain(message: str) -> Optional[str]:
    """fxtrain's reason for a break dynamo filed as a skipped call of a learnt op (dynamo names it
    a builtin it cannot trace), else None."""
    if "skipped" not in message:
        return None
    for name, why in list(_reasons.items()):
        namespace, _, op = name.partition("::")
        if name in message or (f".{namespace}." in message and f".{op}" in message):
            return why
    return None


def _example(value: Any) -> Any:
    return value.meta.get("example_value") if isinstance(value, torch.fx.Node) else value


def _backward_error(node: torch.fx.Node) -> Optional[BaseException]:
    """The data-dependent error the backward of ``node``'s op raises on the capture's fake tensors,
    or None (it traces, needs no gradient, or fails in a way AOTAutograd will report itself)."""
    out = node.meta.get("example_value")
    outputs = [t for t in tp.tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    fake_mode = getattr(outputs[0], "fake_mode", None) if outputs else None
    if fake_mode is None:
        return None
    args, kwargs = tp.tree_map(_example, (node.args, node.kwargs))
    leaves: List[torch.Tensor] = []

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.requires_grad:
            value = value.detach().requires_grad_()
            leaves.append(value)
        return value

    with fake_mode, tp.fake_trial(fake_mode), torch.enable_grad():
        args, kwargs = tp.tree_map(leaf, (args, kwargs))
        try:
            result = node.target(*args, **kwargs)
        except Exception:
            return None
        grads = [t for t in tp.tree_flatten(result)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not leaves or not grads:
            return None
        try:
            torch.autograd.grad(grads, leaves, [torch.ones_like(t) for t in grads], allow_unused=True)
        except tp.DATA_DEPENDENT_ERRORS as error:
            return error
        except Exception:
            return None
    return None
