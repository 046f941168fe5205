"""Executors: what turns one aten graph (a forward or a backward) into something that runs.

An executor is an object that says what it supports; the runtime (runtime/runner.py) asks it to
compile each graph and never branches on its name. Two ship:

- ``EagerExecutor`` ("eager", the default): no code generation, so a first step costs little more
  than eager PyTorch. Graphs run op by op with the boxed calling convention (the graph clears its
  argument list and drops every value after its last use, so the backward frees each saved tensor
  as soon as it has read it). It also allows the *autograd* runtime mode: the torch-level graph
  runs under PyTorch's own autograd engine, which costs the fewest Python calls per step.
- ``InductorExecutor`` ("inductor"): torch's code generator on the same aten graphs (after
  fxtrain's backward passes), with the recomputing partitioner that pays when kernels are fused.
- ``AutoExecutor`` ("auto"): the eager one, and each capture moves to inductor-compiled graphs
  once a worker process has compiled them (runtime/tiered.py).

The profiler's executor (profile/capture.py) is a third: the eager one running marked copies.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.fx

from .. import torch_private as tp
from ..pythonop.op import calling_directly
from .checkpointed import checkpointing_eagerly
from .direct import direct

Compiled = Callable[[List[Any]], Any]   # boxed: takes the argument list, may clear it


class Executor:
    """How graphs are compiled, and what the runtime may do with this executor's output.

    ``autograd_mode``: the runtime may skip the aten graphs and run the torch-level graph under eager
    autograd (only an executor that runs ops as written can promise eager's numbers there).
    ``kind``: "forward", "backward" or "inference".
    """

    name = "executor"
    autograd_mode = False
    # Compiling may add shape guards (a code generator specialises): the backward is then compiled
    # at capture, with the forward, so its guards join the capture's before any call relies on them.
    compiles_ahead = False
    # Backward passes this executor does not want (name -> why, shown in capture_info()): their ops
    # are then decomposed like any other, so the code generator sees and fuses them.
    skips_backward_passes: Dict[str, str] = {}
    # Each capture runs this executor's code first while a worker compiles its graphs with inductor;
    # the compiled graphs replace it when ready (runtime/tiered.py).
    compiles_later = False

    def partition(self, joint: torch.fx.GraphModule, joint_inputs: Sequence[Any],
                  before_cut: Optional[Callable[[torch.fx.GraphModule], None]] = None, **kwargs: Any) -> Any:
        """Split ``joint`` into forward and backward. ``before_cut`` sees the joint graph exactly
        as the cut does (a memory budget re-cuts that graph: capture/budget.py)."""
        if before_cut is not None:
            before_cut(joint)
        return tp.default_partition(joint, joint_inputs, **kwargs)

    def decompositions(self, keep: Sequence[Any] = ()) -> Optional[Dict[Any, Callable[..., Any]]]:
        """``keep``: ops to leave whole, since the backward passes this executor runs rewrite them
        (the capture knows which: the passes sit above the runtime)."""
        return None

    def compile(self, graph: torch.fx.GraphModule, kind: str, example_inputs: Sequence[Any]) -> Compiled:
        raise NotImplementedError

    def torch_level(self, graph: torch.fx.GraphModule) -> Callable[..., Any]:
        """What runs the torch-level graph in the autograd mode (unboxed)."""
        return direct(graph)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class EagerExecutor(Executor):
    name = "eager"
    autograd_mode = True

    def torch_level(self, graph: torch.fx.GraphModule) -> Callable[..., Any]:
        return direct(calling_directly(checkpointing_eagerly(graph)))

    def compile(self, graph: torch.fx.GraphModule, kind: str, example_inputs: Sequence[Any]) -> Compiled:
        return tp.boxed_copy(graph).forward


class InductorExecutor(Executor):
    name = "inductor"
    compiles_ahead = True
    # cross_entropy_grad removes the eager executor's one-hot fill and extra passes over the logits;
    # inductor fuses the decomposed log_softmax and nll_loss gradients into one kernel already, and
    # keeping the two ops whole for the pass costs more than it saves: the partitioner cannot
    # recompute log_softmax into an unfusible op, so the forward writes a [rows, vocab] log_softmax
    # to save it (GPT-2, vocab 50257: ~4% of a dense step) instead of reusing the logits.
    skips_backward_passes = {"cross_entropy_grad": "inductor fuses the log_softmax and nll_loss gradients itself"}

    def partition(self, joint: torch.fx.GraphModule, joint_inputs: Sequence[Any],
                  before_cut: Optional[Callable[[torch.fx.GraphModule], None]] = None, **kwargs: Any) -> Any:
        # Recomputing cheap ops in the backward pays here: inductor fuses them into kernels it runs anyway.
        return tp.inductor_partition(joint, joint_inputs, before_cut=before_cut, **kwargs)

    def decompositions(self, keep: Sequence[Any] = ()) -> Optional[Dict[Any, Callable[..., Any]]]:
        # Inductor's own table, less the ops fxtrain's backward passes rewrite (they must see them).
        return tp.inductor_decompositions(keep=keep)

    def compile(self, graph: torch.fx.GraphModule, kind: str, example_inputs: Sequence[Any]) -> Compiled:
        return inductor_compile_graph(graph, kind, example_inputs)


def inductor_compile_graph(graph: torch.fx.GraphModule, kind: str, example_inputs: Optional[Sequence[Any]] = None,
                           cached_only: bool = False) -> Compiled:
    """``example_inputs``: the placeholders' fake values if not given. ``cached_only``: load from
    inductor's FX graph cache or raise (torch_private.inductor_compile)."""
    # Inductor rewrites the graph it is given in place (views become reshapes, aliases go), and
    # keys its kernel cache on the pickled module, attribute order included (a module loaded
    # from fxtrain's cache has another order than the live one). It gets a fresh module around
    # a copy: the graph fxtrain keeps, caches and costs stays as captured, and a process that
    # loads it from fxtrain's cache hits the kernels the capture compiled.
    # (A copy of the graph's nodes only: attributes stay shared, fake constants included.)
    fresh = torch.fx.GraphModule(graph, tp.copy_graph(graph.graph))
    examples = tp.placeholder_examples(graph) if example_inputs is None else example_inputs
    return tp.inductor_compile(fresh, examples, is_backward=kind == "backward",
                               is_inference=kind == "inference", cached_only=cached_only)


class AutoExecutor(EagerExecutor):
    """The eager executor now, inductor later (runtime/tiered.py): each capture starts on the eager
    executor's code, and a worker process compiles its aten graphs with inductor meanwhile."""

    name = "auto"
    compiles_later = True


EXECUTORS: Dict[str, Callable[[], Executor]] = {"eager": EagerExecutor, "inductor": InductorExecutor,
                                                "auto": AutoExecutor}


def executor_named(name: str) -> Executor:
    try:
        return EXECUTORS[name]()
    except KeyError:
        raise ValueError(f"unknown executor {name!r}; available: {sorted(EXECUTORS)}") from None
