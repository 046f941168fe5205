"""Executors: what turns a captured dynamo graph into something that runs forward and backward.

"eager" splits the graph with AOTAutograd into aten forward/backward graphs and runs them op by op
(no code generation, so the first step costs little more than eager PyTorch). "inductor" hands the
graph to torch's code generator: faster kernels on some workloads, tens of seconds on the first step.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List

import torch
import torch.fx
from functorch.compile import default_partition, make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._guards import TracingContext

from ..capture.info import GraphRecord
from .absent_grads import AbsentGradBackward

Compiled = Callable[..., object]
Runnable = Callable[[torch.fx.GraphModule, str], torch.fx.GraphModule]


def as_is(graph: torch.fx.GraphModule, _kind: str) -> torch.fx.GraphModule:
    """The runnable that runs each graph itself."""
    return graph


def compile_eager(gm: torch.fx.GraphModule, example_inputs: List[object], record: GraphRecord,
                  runnable: Runnable = as_is) -> Compiled:
    """AOTAutograd's forward and backward graphs, run op by op.

    ``runnable(graph, "forward" | "backward")`` gives the module that actually runs each graph: the
    graph itself here, a copy announcing each op to the cost tracker in the profiler. The record
    keeps the graphs themselves (what the dumps and the cache store).
    """
    backward: List[AbsentGradBackward] = []

    def forward_compiler(fw: torch.fx.GraphModule, _inputs: List[object], inference: bool = False) -> Compiled:
        record.forward_graph = fw
        # What the cache needs to run these graphs without AOTAutograd (runtime/replay.py).
        context = TracingContext.try_get()
        record.aot_metadata = context.fw_metadata if context is not None else None
        record.inference = inference
        run = make_boxed_func(runnable(fw, "forward").forward)
        # Read after the step (absent_grads.release_materialization), when the backward exists.
        run.fxtrain_accepts_none = lambda: bool(backward) and backward[0].accepts_none
        return run

    def backward_compiler(bw: torch.fx.GraphModule, _inputs: List[object]) -> Compiled:
        from ..passes import BACKWARD_PASSES  # passes import the runtime: resolve at compile time

        for backward_pass in BACKWARD_PASSES:
            report = backward_pass(bw)
            record.report(report.name, str(report))
        record.backward_graph = bw
        backward.append(AbsentGradBackward(runnable(bw, "backward")))
        record.backward_runner = backward[-1]
        for hook in record.backward_hooks:  # e.g. the debug dump and the cache, waiting for this graph
            hook()
        record.backward_hooks.clear()
        return backward[-1].boxed()

    # default_partition saves what the backward needs instead of recomputing it: recomputation only
    # pays when a code generator fuses it away, which this executor does not do.
    compiler = aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler,
                            inference_compiler=functools.partial(forward_compiler, inference=True),
                            partition_fn=default_partition)
    return compiler(gm, example_inputs)


def _compile_inductor(gm: torch.fx.GraphModule, example_inputs: List[object], record: GraphRecord) -> Compiled:
    from torch._inductor.compile_fx import compile_fx
    return compile_fx(gm, example_inputs)


EXECUTORS: Dict[str, Callable[[torch.fx.GraphModule, List[object], GraphRecord], Compiled]] = {
    "eager": compile_eager,
    "inductor": _compile_inductor,
}


def compile_graph(gm: torch.fx.GraphModule, example_inputs: List[object], executor: str,
                  record: GraphRecord) -> Compiled:
    try:
        build = EXECUTORS[executor]
    except KeyError:
        raise ValueError(f"unknown executor {executor!r}; available: {sorted(EXECUTORS)}") from None
    return build(gm, example_inputs, record)
