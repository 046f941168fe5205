"""Split a rewritten dynamo graph into aten forward and backward graphs (AOTAutograd), as values.

AOTAutograd is used for its tracing and partitioning; what it compiles is handed back here, not
kept in closures: the partition hook gets the backward graph at capture time (AOTAutograd would
compile it only at the first backward), runs fxtrain's backward passes on it (the forward compiler
runs the forward graph passes on the forward graph), and the result is a
``Split`` the capture puts into its ``CapturedStep``. The callable AOTAutograd returns is kept only
for graphs fxtrain's runtime cannot replay (``runtime/replay.py: NotReplayable``).
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.fx

from .. import torch_private as tp
from ..passes import FORWARD_GRAPH_PASSES, backward_pass_ops, run_backward_passes
from ..runtime.step import PassReport
from ..runtime.absent_grads import AbsentGradBackward
from ..runtime.executors import Executor


@dataclass
class Split:
    forward_graph: Optional[torch.fx.GraphModule] = None
    backward_graph: Optional[torch.fx.GraphModule] = None
    metadata: Any = None                     # AOTAutograd's ViewAndMutationMeta
    inference: bool = False
    compiled_forward: Optional[Callable[[List[Any]], Any]] = None
    backward: Optional[AbsentGradBackward] = None
    backward_reports: List[PassReport] = field(default_factory=list)
    forward_reports: List[PassReport] = field(default_factory=list)
    aot_callable: Optional[Callable[..., Any]] = None   # AOTAutograd's own runtime around the above
    # With keep_joint: a copy of the joint graph and the partitioner's arguments, so that a memory
    # budget (capture/budget.py) can split it again, saving less.
    joint: Optional[torch.fx.GraphModule] = None
    partition_kwargs: Dict[str, Any] = field(default_factory=dict)


def split(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], executor: Executor,
          keep_joint: bool = False) -> Split:
    """``keep_joint``: keep a copy of the joint graph (a memory budget re-partitions it); the
    executor then compiles nothing ahead, since the graphs may still change."""
    result = Split()

    def partition(joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
        def keep(cut: torch.fx.GraphModule) -> None:
            # The graph the cut sees (inductor rewrites the joint graph first), copied before the
            # cut, which may rewrite it in place: the forward's saved nodes are nodes of this copy.
            result.joint = torch.fx.GraphModule(cut, copy.deepcopy(cut.graph))
            result.partition_kwargs = dict(kwargs)
        fw, bw = executor.partition(joint, joint_inputs, before_cut=keep if keep_joint else None, **kwargs)
        result.backward_reports.extend(run_backward_passes(bw, executor))
        result.backward_graph = bw
        # Each graph compiled with its own placeholders' values: the whole backward, its
        # absent-gradient specialisations (same inputs) and its B/W parts (weight_split.py).
        result.backward = AbsentGradBackward(bw, lambda g: executor.compile(g, "backward", tp.placeholder_examples(g)))
        return fw, bw

    def forward_compiler(fw: torch.fx.GraphModule, inputs: List[Any], inference: bool = False) -> Callable[..., Any]:
        result.forward_reports = [forward_pass(fw) for forward_pass in FORWARD_GRAPH_PASSES]
        result.forward_graph = fw
        result.metadata = tp.aot_metadata()
        result.inference = inference
        result.compiled_forward = executor.compile(fw, "inference" if inference else "forward", inputs)
        compiled = result.compiled_forward

        def run(args: List[Any]) -> Any:
            return compiled(args)
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
    if executor.compiles_ahead and result.backward is not None and not keep_joint:
        # Still inside dynamo's compile of this graph: guards the compiler adds join the capture's.
        result.backward.compile_full()
    return result
