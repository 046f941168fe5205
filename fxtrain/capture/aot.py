"""The partition stage's trace: a rewritten dynamo graph split by AOTAutograd into aten forward
and backward graphs, compiled by nobody yet (the pipeline's compile stage compiles the graphs the
partition settles on, once). The partition hook runs fxtrain's backward passes on the backward
graph at capture time; the forward compiler runs the forward graph passes. AOTAutograd's own
runtime is kept for graphs fxtrain's runtime cannot replay (``runtime/replay.py: NotReplayable``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.fx

from .. import torch_private as tp
from ..passes import FORWARD_GRAPH_PASSES, JOINT_GRAPH_PASSES, backward_pass_ops, run_backward_passes
from ..runtime.step import PassReport
from ..runtime.absent_grads import AbsentGradBackward
from ..runtime.executors import Executor


@dataclass
class Split:
    """What AOTAutograd's hooks saw: filled while it traces (its hooks are callbacks), read by the
    partition stage, which returns its own value."""

    forward_graph: Optional[torch.fx.GraphModule] = None
    backward_graph: Optional[torch.fx.GraphModule] = None
    metadata: Any = None                     # AOTAutograd's ViewAndMutationMeta
    inference: bool = False
    forward_inputs: List[Any] = field(default_factory=list)   # the forward compiler's example inputs
    # The backward of ``backward_graph``, compiled lazily by the executor: the one AOTAutograd's
    # runtime calls, so the compile stage compiles this very object for these graphs.
    backward: Optional[AbsentGradBackward] = None
    backward_reports: List[PassReport] = field(default_factory=list)
    forward_reports: List[PassReport] = field(default_factory=list)
    aot_callable: Optional[Callable[..., Any]] = None   # AOTAutograd's own runtime around the above
    # With keep_joint: a copy of the joint graph and the partitioner's arguments, so that a memory
    # budget (capture/budget.py) can split it again, saving less.
    joint: Optional[torch.fx.GraphModule] = None
    partition_kwargs: Dict[str, Any] = field(default_factory=dict)
    # The compiled forward AOTAutograd's runtime calls, set once by the compile stage.
    linked: List[Callable[[List[Any]], Any]] = field(default_factory=list, repr=False)

    def link(self, compiled_forward: Callable[[List[Any]], Any]) -> None:
        self.linked[:] = [compiled_forward]


def split(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], executor: Executor,
          keep_joint: bool = False) -> Split:
    """``keep_joint``: keep a copy of the joint graph (a memory budget re-partitions it)."""
    result = Split()

    def partition(joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
        result.backward_reports.extend(joint_pass(joint) for joint_pass in JOINT_GRAPH_PASSES)

        def keep(cut: torch.fx.GraphModule) -> None:
            # The graph the cut sees (inductor rewrites the joint graph first), copied before the
            # cut, which may rewrite it in place: the forward's saved nodes are nodes of this copy.
            result.joint = torch.fx.GraphModule(cut, tp.copy_graph(cut.graph))
            result.partition_kwargs = dict(kwargs)
        fw, bw = executor.partition(joint, joint_inputs, before_cut=keep if keep_joint else None, **kwargs)
        result.backward_reports.extend(run_backward_passes(bw, executor))
        result.backward_graph = bw
        result.backward = backward_of(bw, executor)
        return fw, bw

    def forward_compiler(fw: torch.fx.GraphModule, inputs: List[Any], inference: bool = False) -> Callable[..., Any]:
        result.forward_reports = [forward_pass(fw) for forward_pass in FORWARD_GRAPH_PASSES]
        result.forward_graph = fw
        result.metadata = tp.aot_metadata()
        result.inference = inference
        result.forward_inputs = list(inputs)
        linked = result.linked

        def run(args: List[Any]) -> Any:
            return linked[0](args)
        run._boxed_call = True  # type: ignore[attr-defined]
        # Read by absent_grads.release_materialization when AOTAutograd's runtime runs this graph.
        run.fxtrain_accepts_none = lambda: result.backward is not None and result.backward.accepts_none  # type: ignore[attr-defined]
        return run

    def backward_compiler(bw: torch.fx.GraphModule, _inputs: List[Any]) -> Callable[..., Any]:
        assert result.backward is not None
        if bw is not result.backward_graph:  # AOTAutograd copied it after partitioning: run its copy
            result.backward = AbsentGradBackward(bw, result.backward.compile)
            result.backward_graph = bw
        return result.backward.boxed()

    kwargs: Dict[str, Any] = dict(fw_compiler=forward_compiler, bw_compiler=backward_compiler,
                                  inference_compiler=functools.partial(forward_compiler, inference=True),
                                  partition_fn=partition)
    decompositions = executor.decompositions(keep=backward_pass_ops(executor))
    if decompositions is not None:
        kwargs["decompositions"] = decompositions
    result.aot_callable = tp.aot_autograd(**kwargs)(gm, example_inputs)
    return result


def backward_of(bw: torch.fx.GraphModule, executor: Executor) -> AbsentGradBackward:
    """``bw``'s runtime object, compiling with ``executor`` when first needed: each graph compiled
    with its own placeholders' values (the whole backward, its absent-gradient specialisations,
    its B/W parts: runtime/weight_split.py)."""
    return AbsentGradBackward(bw, lambda g: executor.compile(g, "backward", tp.placeholder_examples(g)))
