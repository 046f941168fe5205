"""The capture pipeline: dynamo's graph in, the compiled step out, through named stages that each
return a new value (docs/architecture.md, "The capture pipeline"): passes (``rewrite``), partition
(``partition``: AOTAutograd's split, re-cut by the memory budget's planner when there is one, so a
budgeted step is compiled once and never rewritten), compile (``compile_graphs``). What varies
between callers (the profiler, the cache, the budget) comes in as parameters, in ``CaptureContext``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from .. import torch_private as tp
from ..options import Options
from ..cost.launches import DeviceRates, DeviceStep, StepLoad, launch_bound, rates_for, replay_pays
from ..passes import ExampleSource, Plans, contraction_dtype, forward_flops, kernel_ops, run_passes
from ..passes.checkpoints import NAME as CHECKPOINTS, NotConvex, OpenRegions, close_checkpoints, has_checkpoints, \
    open_checkpoints, tag_added
from ..pythonop.route import drop_unused_subclasses
from ..runtime.absent_grads import AbsentGradBackward
from ..runtime.executors import Executor
from ..runtime.replay import NotReplayable, ReplaySpec, check_graph_arity, replay_spec
from ..runtime.step import CapturedStep, PassReport
from .aot import Split, backward_of, split
from .budget import BudgetRequest, BudgetState, MemoryPlan, plan_budget


@dataclass(frozen=True)
class CaptureContext:
    """What one capture is made with, besides dynamo's graph and its example inputs."""

    options: Options
    executor: Executor
    examples: ExampleSource
    budget: Optional[BudgetRequest] = None     # Options.memory_budget's partitioner; None: the executor's
    optimizer: Any = None                      # whose state a budget counts
    # Observer: gets each replayable training capture's BudgetState (the profiler's max_batch_recomputed).
    on_budget_state: Optional[Callable[[BudgetState], None]] = None
    # Launch and FLOP rates the passes are weighed with (cost/launches.py); None: the graph's device's.
    launch_rates: Optional[DeviceRates] = None
    # False: no pass is turned off for its launches (Plugins.weigh_launches: the fuzzer tests the passes).
    weigh_launches: bool = True


@dataclass(frozen=True)
class Rewritten:
    graph: torch.fx.GraphModule                    # dynamo's graph, rewritten in place by the passes
    dense_graph: Optional[torch.fx.GraphModule]    # the graph before any pass (None: no batch guard needs it)
    plans: Plans
    reports: Dict[str, str]
    # The step on its device after the passes that stay on (cost/launches.py); None on the CPU, or
    # where launches are not weighed: what the runtime's choice of mode is weighed with.
    device_step: Optional[DeviceStep] = None


@dataclass(frozen=True)
class Partition:
    forward_graph: Optional[torch.fx.GraphModule]
    backward_graph: Optional[torch.fx.GraphModule]
    inference: bool
    spec: Optional[ReplaySpec]
    not_replayable: str
    forward_reports: List[PassReport]
    backward_reports: List[PassReport]
    memory_plan: Optional[MemoryPlan]
    traced: Split          # AOTAutograd's trace: its runtime, and the baseline graphs' backward

    baseline = property(lambda self: self.forward_graph is self.traced.forward_graph)   # not a plan's re-cut


@dataclass(frozen=True)
class Compiled:
    forward: Optional[Callable[[List[Any]], Any]]
    backward: Optional[AbsentGradBackward]


def compile_step(gm: torch.fx.GraphModule, example_inputs: List[Any],
                 context: CaptureContext) -> Tuple[CapturedStep, Dict[str, str]]:
    """dynamo's graph (rewritten in place) → the compiled step and the capture's pass reports."""
    return finish(rewrite(gm, context), example_inputs, context)


def finish(rewritten: Rewritten, example_inputs: List[Any],
           context: CaptureContext) -> Tuple[CapturedStep, Dict[str, str]]:
    """The partition and compile stages: at capture, or later on a thread (runtime/pending.py)."""
    parts = partition(rewritten.graph, example_inputs, context)
    compiled = compile_graphs(parts, context.executor)
    step = CapturedStep(graph=rewritten.graph, dense_graph=rewritten.dense_graph, plans=rewritten.plans,
                        forward_graph=parts.forward_graph, backward_graph=parts.backward_graph,
                        inference=parts.inference, spec=parts.spec, not_replayable=parts.not_replayable,
                        backward_reports=parts.backward_reports, forward_reports=parts.forward_reports,
                        compiled_forward=compiled.forward, backward=compiled.backward,
                        aot_callable=parts.traced.aot_callable, memory_plan=parts.memory_plan,
                        graph_mode_pays=graph_mode_pays(parts.backward_graph, parts.backward_reports, rewritten))
    reports = dict(rewritten.reports)
    reports.update((r.name, str(r)) for r in parts.forward_reports + parts.backward_reports)
    return step, reports


def from_worker(rewritten: Rewritten, answer: bytes,
                executor: Executor) -> Tuple[CapturedStep, Dict[str, str], float]:
    """The compile stage on the partition a worker made of ``rewritten`` (capture/partition_worker.py);
    also the partition's CPU seconds there (the sizes policy counts them: capture/sizes.py)."""
    fw, bw, inference, spec, why, forward_reports, backward_reports, cpu = tp.unpickle_graphs(
        answer, tp.FakeTensorMode(shape_env=ShapeEnv()))
    for gm in (fw, bw):
        if gm is not None:
            gm.recompile()
    forward = executor.compile(fw, "inference" if inference else "forward", tp.placeholder_examples(fw)) \
        if fw is not None else None
    backward = backward_of(bw, executor) if bw is not None else None
    if executor.compiles_ahead and backward is not None:
        backward.compile_ahead()
    step = CapturedStep(graph=rewritten.graph, dense_graph=rewritten.dense_graph, plans=rewritten.plans,
                        forward_graph=fw, backward_graph=bw, inference=inference, spec=spec, not_replayable=why,
                        backward_reports=backward_reports, forward_reports=forward_reports,
                        compiled_forward=forward, backward=backward,
                        graph_mode_pays=graph_mode_pays(bw, backward_reports, rewritten))
    reports = dict(rewritten.reports)
    reports.update((r.name, str(r)) for r in forward_reports + backward_reports)
    return step, reports, cpu


def graph_mode_pays(backward_graph: Optional[torch.fx.GraphModule], backward_reports: List[PassReport],
                    rewritten: Rewritten) -> Tuple[bool, str]:
    """Whether replaying the aten backward graph (where the backward passes act) beats PyTorch's
    engine on the step's device, and why: the runtime's choice of mode (runtime/runner.py)."""
    saved = sum(r.saved_bytes for r in backward_reports if r.applied)
    ops = sum(1 for n in backward_graph.graph.nodes if n.op == "call_function") if backward_graph else 0
    return replay_pays(saved, ops, rewritten.device_step)


def unpartitioned(rewritten: Rewritten) -> CapturedStep:
    """The step before its partition: what the autograd mode runs until ``finish`` is done."""
    return CapturedStep(graph=rewritten.graph, dense_graph=rewritten.dense_graph, plans=rewritten.plans,
                        not_replayable="not partitioned yet")


# ------------------------------------------------------------------------------------- passes
def rewrite(gm: torch.fx.GraphModule, context: CaptureContext) -> Rewritten:
    """The forward passes, less those that would make the step slower on the graph's device: the
    host time of the kernel ops they add against the device time of the FLOPs they skip, weighed
    against the dense step's own ops and FLOPs (cost/launches.py). Each is weighed as it applies,
    on the graph the passes before it left; one found slower is turned off and the passes start
    again, without it, on the graph as dynamo traced it, so that those after it see the graph they
    will run on. (Weighing them all at the end and running all passes again cost BERT-base 2 x 128
    a second padding elimination, ~0.2 s of its first step, whenever label sparsity was off.)

    Activation-checkpointed regions are opened for the passes and closed again after them
    (passes/checkpoints.py): the dense graph, the step's load and every pass see the layers inside
    them, and the graph that leaves this stage has torch's region calls where dynamo's had them."""
    drop_unused_subclasses(gm)
    whole = _copy_graph(gm.graph) if has_checkpoints(gm) else None
    try:
        return _rewrite(gm, context, open_checkpoints(gm))
    except NotConvex as e:   # the passes' ops left a region with a gap: rewrite with the regions whole
        gm.graph = whole
        gm.delete_all_unused_submodules()   # the bodies of the regions closed before the gap
        return _rewrite(gm, context, OpenRegions(PassReport(CHECKPOINTS, False, f"{e}: the regions left whole")))


def _rewrite(gm: torch.fx.GraphModule, context: CaptureContext, opened: OpenRegions) -> Rewritten:
    dense = torch.fx.GraphModule(gm, _copy_graph(gm.graph))
    device_type, dtype = contraction_dtype(dense)
    rates = (None if not context.weigh_launches else
             context.launch_rates if context.launch_rates is not None else rates_for(device_type))
    load = StepLoad(kernel_ops(dense), forward_flops(dense)) if rates is not None else None

    def weigh(report: PassReport) -> Optional[str]:
        if getattr(context.options, report.name, "on") != "auto":
            return None
        return launch_bound(report.saved_flops, report.added_kernels, load, rates, dtype,
                            report.attention_calls, report.attention_runs)

    off: Dict[str, PassReport] = {}
    while True:
        plans = Plans()
        before = set(gm.graph.nodes)
        reports, slower = run_passes(gm, context.examples,
                                     dataclasses.replace(context.options, **dict.fromkeys(off, "off")), plans, weigh)
        if slower is None:
            break
        off[slower.name] = slower
        gm.graph = _copy_graph(dense.graph)
    # (assigning gm.graph recompiled it; run_passes recompiles what it rewrites)
    if opened.report.applied:
        tag_added(gm, before)   # what the passes added inside a region is recomputed with it
        close_checkpoints(gm, opened)
        gm.delete_all_unused_submodules()   # dynamo's bodies, replaced by the closed regions'
        if plans.guard is not None:
            close_checkpoints(dense, opened)
    reports = {opened.report.name: opened.report, **reports, **off}
    on = [r for r in reports.values() if r.applied]
    device_step = DeviceStep(rates, StepLoad(load.kernels + sum(r.added_kernels for r in on),
                                        max(0, load.flops - sum(r.saved_flops or 0 for r in on))), dtype) \
        if rates is not None and load is not None else None
    return Rewritten(gm, dense if plans.guard is not None else None, plans,
                     {name: str(r) for name, r in reports.items()}, device_step)


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """The graph as dynamo traced it, before any pass: what a batch the passes cannot serve runs,
    and what the passes run on again when some are turned off. Nodes are copied (metadata
    shallowly), so the passes' rewrites of ``graph`` do not reach it; the placeholders keep their
    dynamo sources, which AOTAutograd reads when it partitions the copy."""
    copy = torch.fx.Graph()
    copy._codegen = graph._codegen
    copy.output(copy.graph_copy(graph, {}))
    tp.carry_dynamo_sources(graph, copy)
    return copy


# ---------------------------------------------------------------------------------- partition
def partition(graph: torch.fx.GraphModule, example_inputs: List[Any], context: CaptureContext) -> Partition:
    executor, budget = context.executor, context.budget
    traced = split(graph, example_inputs, executor,
                   keep_joint=budget is not None or context.on_budget_state is not None)
    spec, why = None, "AOTAutograd produced no forward graph"
    try:
        if traced.forward_graph is not None and traced.metadata is not None:
            spec = replay_spec(traced.metadata, len(example_inputs), traced.inference)
            check_graph_arity(traced.forward_graph, traced.backward_graph, spec, example_inputs)
            why = ""
    except NotReplayable as e:
        spec, why = None, str(e)
    parts = Partition(traced.forward_graph, traced.backward_graph, traced.inference, spec, why,
                      list(traced.forward_reports), list(traced.backward_reports), None, traced)
    if traced.inference:
        return parts
    if traced.joint is None or spec is None:
        if budget is not None and budget.warn is not None:
            budget.warn(f"fxtrain: memory budget not applied to a graph fxtrain's runtime cannot replay "
                        f"({why or 'no joint graph'}); it runs as captured")
        return parts
    state = BudgetState(traced, spec, example_inputs, context.optimizer, executor)
    if context.on_budget_state is not None:
        context.on_budget_state(state)
    if budget is None:
        return parts
    plan, k = plan_budget(state, budget)
    if not k:
        return dataclasses.replace(parts, memory_plan=plan)
    fw, bw, reports = state.graphs(k)
    return dataclasses.replace(parts, forward_graph=fw, backward_graph=bw, spec=state.spec_for(fw),
                               backward_reports=list(reports), memory_plan=plan)


# ------------------------------------------------------------------------------------ compile
def compile_graphs(parts: Partition, executor: Executor) -> Compiled:
    """The executor's callables for the partition's graphs, compiled once. The backward compiles
    at capture (still inside dynamo's compile of this graph, so shape guards a code generator adds
    join the capture's) where the executor ``compiles_ahead``, else at its first call."""
    traced, fw = parts.traced, parts.forward_graph
    if fw is None:
        return Compiled(None, traced.backward)
    forward = executor.compile(fw, "inference" if parts.inference else "forward",
                               traced.forward_inputs if parts.baseline else tp.placeholder_examples(fw))
    backward = traced.backward
    if parts.baseline:
        traced.link(forward)   # AOTAutograd's runtime (the "aot" mode) runs these graphs
    elif parts.backward_graph is not None:
        backward = backward_of(parts.backward_graph, executor)
    if executor.compiles_ahead and backward is not None:
        backward.compile_ahead()
    return Compiled(forward, backward)
