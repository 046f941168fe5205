"""The dynamo backend: receives each graph dynamo captures, runs our passes, hands it to an executor."""
from __future__ import annotations

import logging
import re
import warnings
from typing import Any, Callable, List, Optional, Set

import torch
import torch.fx

from .. import torch_private as tp
from . import recipe as cache_recipe
from ..options import Options
from ..passes import DynamoExamples, ExampleSource, Plans, run_passes
from ..runtime import runner
from ..runtime.executors import Executor, executor_named
from ..runtime.replay import NotReplayable, check_graph_arity, replay_spec
from .aot import split
from .breaks import graph_break_site
from .budget import BudgetRequest, BudgetState, MemoryBudgetWarning, plan_step
from .dump import dump_capture
from ..runtime.info import CaptureInfo, GraphRecord
from ..runtime.step import CapturedStep
from ..runtime.tiered import Tier
from ..errors import Error

logger = logging.getLogger("fxtrain")


def dynamo_recompile_reason() -> str:
    """The guard that failed when dynamo recompiles a frame ('' on a first compile): dynamo records
    it only in its compile metrics, whose layout is private, hence the defensive reading."""
    try:
        reason = tp.dynamo_recompile_reason() or ""
    except Exception:
        return ""
    first = str(reason).strip().splitlines()[0] if str(reason).strip() else ""
    return re.sub(r"^\d+/\d+: ", "", first.split("#", 1)[0].strip())  # "0/3: L['t'] == 1.5  # source"


class RecompileLimitReached(Error, RuntimeError):
    """This TrainModule captured in ``Options.recompile_limit`` calls already: another is a failure.

    Dynamo's own limit counts per code object, and a TrainModule compiles through two entries
    (static sizes, then symbolic): the option's promise is per module, so TrainModule counts the
    calls that captured (a call whose model breaks into pieces is one capture, whatever its graphs)
    and tells the backend whether a new call may capture."""


def current_mode(training: bool) -> str:
    if not torch.is_grad_enabled():
        return "no_grad"
    return "train" if training else "eval"


class Backend:
    """One per TrainModule: owns the CaptureInfo that capture fills in.

    Each graph dynamo hands over becomes a ``CapturedStep`` (passes, plans, AOTAutograd's split)
    and then the runtime's callable for it. ``executor`` compiles the aten graphs and says what it
    supports (the profiler passes its own, which runs marked copies on fake tensors). ``examples``
    is where the passes read the capturing batch: dynamo's placeholders unless the caller knows
    better (the profiler, whose inputs are fake, knows their values).
    """

    def __init__(self, info: CaptureInfo, options: Options, training: Callable[[], bool],
                 owner: str = "model", on_graph: Optional[Callable[[], None]] = None,
                 executor: Optional[Executor] = None, examples: Optional[ExampleSource] = None) -> None:
        self.info = info
        self.owner = owner
        self.options = options
        self.executor = executor if executor is not None else executor_named(options.executor)
        self.examples = examples if examples is not None else DynamoExamples()
        self.context = runner.RunContext(info.density, options.log_density, info.dense_batches,
                                         options.sparsity_guard, owner)
        self.training = training
        # Called first for every graph, before anything of it runs (TrainModule copies buffers there).
        self.on_graph = on_graph
        self.may_capture = True   # set by TrainModule per call (Options.recompile_limit)
        # The optimizer a memory budget counts: Options.optimizer, or TrainModule.attach_optimizer's.
        self.optimizer: Any = options.optimizer
        self._warned: Set[str] = set()

    def budget_request(self) -> Optional[BudgetRequest]:
        """What Options.memory_budget asks of the next capture (None without a budget). Below the
        smallest achievable peak the policy is the fallback's: the profiler's executor, which
        captures under fallback="raise", says the user's own (``budget_fallback``)."""
        if self.options.memory_budget is None:
            return None
        fallback = self.executor.budget_fallback or self.options.fallback
        return BudgetRequest(int(self.options.memory_budget), "raise" if fallback == "raise" else "warn",
                             self._warn_once)

    def _warn_once(self, message: str) -> None:
        # Once per module and kind (below the smallest peak; a graph it cannot plan), whatever the
        # numbers of later captures.
        key = "below" if "below the smallest peak" in message else "not applied"
        if key in self._warned:
            return
        self._warned.add(key)
        logger.warning(message)
        warnings.warn(message, MemoryBudgetWarning, stacklevel=2)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: List[object]) -> Callable[..., object]:
        # No try/except here: dynamo restarts analysis by raising through its backend, and a real
        # failure must reach TrainModule, which applies the fallback policy.
        if not self.may_capture:
            raise RecompileLimitReached(f"{self.options.recompile_limit} calls captured already")
        if self.on_graph is not None:
            self.on_graph()
        record = GraphRecord(index=len(self.info.records), mode=current_mode(self.training()), dynamo_graph=gm,
                             reason=dynamo_recompile_reason(), break_site=graph_break_site(gm))
        recipe = cache_recipe.start(gm) if self.options.cache_dir else None
        dense = torch.fx.GraphModule(gm, _copy_graph(gm.graph))
        plans = Plans()
        record.optimizations = run_passes(gm, self.examples, self.options, plans)
        if plans.guard is None:
            dense = None  # no batch can need the graph without the passes
        step = capture_step(gm, dense, plans, example_inputs, self.executor, self.budget_request(), self.optimizer)
        for report in step.forward_reports + step.backward_reports:
            record.optimizations[report.name] = str(report)
        tier = None
        if self.executor.compiles_later:
            def tier(core: Callable[..., Any]) -> Callable[..., Any]:
                record.tier = Tier(step, core, self.options.compile_timeout, f"{self.owner} graph {record.index}")
                return record.tier
        compiled = runner.build(step, self.executor, self.context, self.options.backward, tier)
        record.step = step
        record.forward_graph, record.backward_graph = step.forward_graph, step.backward_graph
        record.backward_runner, record.inference = step.backward, step.inference
        record.runtime = f"{step.mode}: {step.mode_reason}"
        record.memory_plan = step.memory_plan
        if recipe is not None:
            cache_recipe.finish(recipe, gm)
            recipe.plan = plans.deferred.portable() if plans.deferred is not None else None
            recipe.probes = list(plans.probes)
            recipe.guard = plans.guard
            record.cache_recipe = recipe
            compiled = cache_recipe.watch(recipe, compiled)
        self.info.records.append(record)
        self.info.graphs += 1
        self.info.optimizations.update(record.optimizations)
        if self.options.save_graphs_dir:
            dump_capture(self.options.save_graphs_dir, self.owner, self.info, record)
        logger.info("captured graph %d (%s): %d nodes, executor %s, runtime %s", record.index, record.mode,
                    len(gm.graph.nodes), self.executor.name, record.runtime)
        return compiled


def capture_step(gm: torch.fx.GraphModule, dense: Optional[torch.fx.GraphModule], plans: Plans,
                 example_inputs: List[object], executor: Executor,
                 budget: Optional[BudgetRequest] = None, optimizer: Any = None) -> CapturedStep:
    """The rewritten graph, split by AOTAutograd into aten graphs compiled by ``executor``; with a
    memory budget, split again until the step fits (capture/budget.py). ``optimizer``: what a
    budget counts the state of (Options.optimizer or TrainModule.attach_optimizer's)."""
    parts = split(gm, example_inputs, executor, keep_joint=budget is not None or executor.keeps_budget_state)
    step = CapturedStep(graph=gm, dense_graph=dense, plans=plans, forward_graph=parts.forward_graph,
                        backward_graph=parts.backward_graph, inference=parts.inference,
                        backward_reports=parts.backward_reports, forward_reports=parts.forward_reports,
                        compiled_forward=parts.compiled_forward,
                        backward=parts.backward, aot_callable=parts.aot_callable)
    if parts.forward_graph is None or parts.metadata is None:
        step.not_replayable = "AOTAutograd produced no forward graph"
        return step
    try:
        step.spec = replay_spec(parts.metadata, len(example_inputs), parts.inference)
        check_graph_arity(parts.forward_graph, parts.backward_graph, step.spec, example_inputs)
    except NotReplayable as e:
        step.not_replayable = str(e)
    replayable = step.spec is not None and not step.not_replayable
    if parts.joint is not None and replayable and not step.inference:
        state = BudgetState(step, parts.joint, parts.partition_kwargs, example_inputs, optimizer, executor)
        if executor.keeps_budget_state:
            step.budget_state = state
        if budget is not None:
            step.memory_plan = plan_step(step, state, executor, budget.bytes, budget.below_minimum, budget.warn)
    elif budget is not None and not step.inference:
        if budget.warn is not None:
            budget.warn(f"fxtrain: memory budget not applied to a graph fxtrain's runtime cannot replay "
                        f"({step.not_replayable or 'no joint graph'}); it runs as captured")
    if parts.joint is not None and step.memory_plan is None and executor.compiles_ahead and step.backward is not None:
        step.backward.compile_full()   # split() left it to us: the graphs might have changed
    return step


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """The graph as dynamo traced it, before any pass: what a batch the passes cannot serve runs.
    Nodes are copied (metadata shallowly), so the passes' rewrites of ``graph`` do not reach it."""
    copy = torch.fx.Graph()
    copy._codegen = graph._codegen
    env: dict = {}
    out = copy.graph_copy(graph, env)
    copy.output(out)
    return copy
