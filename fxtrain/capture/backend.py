"""The dynamo backend: each graph dynamo captures goes through the pipeline (capture/pipeline.py)
to the runtime, and its record into the module's CaptureInfo."""
from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from typing import Any, Callable, Dict, List, Optional, Set

import torch
import torch.fx

from .. import torch_private as tp
from . import partition_worker, recipe as cache_recipe, untraceable_ops
from ..options import Options
from ..passes import DynamoExamples, ExampleSource
from ..runtime import runner
from ..runtime.executors import Executor, executor_named
from .breaks import graph_break_site
from .budget import BudgetRequest, BudgetState, MemoryBudgetWarning
from .dump import dump_capture
from .pipeline import CaptureContext, Rewritten, compile_step, finish, from_worker, rewrite, unpartitioned
from ..runtime.info import CaptureInfo, GraphRecord
from ..runtime.pending import PendingPartition, Ready
from ..runtime.tiered import TierMaker
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


@dataclasses.dataclass(frozen=True)
class Plugins:
    """What a tool around TrainModule plugs into its captures (the profiler: fake batches)."""

    executor: Optional[Executor] = None        # compiles the aten graphs (default: Options.executor's)
    examples: Optional[ExampleSource] = None   # where the passes read the batch (default: dynamo's)
    on_budget_state: Optional[Callable[[BudgetState], None]] = None   # observer (capture/pipeline.py)
    real_batches: bool = True                  # calls see real values: batch guards, density probes
    budget_fallback: Optional[str] = None      # policy below the smallest peak, if not Options.fallback's
    # False: keep every "auto" pass the batch calls for, whatever its kernel launches cost on the
    # device (cost/launches.py). The fuzzer's: it tests what the passes compute, and the launch model
    # turns them off for models as small as its own.
    weigh_launches: bool = True


def current_mode(training: bool) -> str:
    if not torch.is_grad_enabled():
        return "no_grad"
    return "train" if training else "eval"


class Backend:
    """One per TrainModule; ``plugins``: what a tool plugs into its captures (the profiler)."""

    def __init__(self, info: CaptureInfo, options: Options, training: Callable[[], bool],
                 owner: str = "model", on_graph: Optional[Callable[[], None]] = None,
                 plugins: Optional[Plugins] = None, *, alive: Callable[[], bool]) -> None:
        self.info = info
        # The module's custom ops whose backward cannot be traced (TrainModule._compiling breaks at them).
        self.untraceable = untraceable_ops.UntraceableOps()
        self.alive = alive   # whether the TrainModule still exists (a background compile for one gone is skipped)
        self.owner = owner
        self.options = options
        self.plugins = plugins if plugins is not None else Plugins()
        self.executor = self.plugins.executor or executor_named(options.executor)
        self.examples = self.plugins.examples or DynamoExamples()
        self.context = runner.RunContext(info.density, options.log_density, info.count_dense_batch,
                                         options.sparsity_guard, owner, self.plugins.real_batches)
        self.training = training
        # Called first for every graph, before anything of it runs (TrainModule copies buffers there).
        self.on_graph = on_graph
        self.may_capture = True   # set by TrainModule per call (Options.recompile_limit)
        # The optimizer a memory budget counts: Options.optimizer, or TrainModule.attach_optimizer's.
        self.optimizer: Any = options.optimizer
        self._warned: Set[str] = set()

    def budget_request(self) -> Optional[BudgetRequest]:
        """What Options.memory_budget asks of the next capture (None without a budget). Below the
        smallest achievable peak the policy is the fallback's: the profiler, which captures under
        fallback="raise", says the user's own (``Plugins.budget_fallback``)."""
        if self.options.memory_budget is None:
            return None
        fallback = self.plugins.budget_fallback or self.options.fallback
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
        mode, reason, site = current_mode(self.training()), dynamo_recompile_reason(), graph_break_site(gm)
        recipe = cache_recipe.start(gm) if self.options.cache_dir else None
        context = CaptureContext(self.options, self.executor, self.examples, self.budget_request(),
                                 self.optimizer, self.plugins.on_budget_state,
                                 weigh_launches=self.plugins.weigh_launches)
        index = len(self.info.records)
        if self.partitions_later(gm, example_inputs):
            rewritten = rewrite(gm, context)
            request = partition_worker.request(rewritten.graph, example_inputs, self.executor.name)
            if request is not None:
                return self._partition_later(rewritten, request, mode, reason, site, index, recipe)
            self.untraceable.check(gm)   # raises for dynamo to break there, before AOTAutograd's trace fails
            step, reports = finish(rewritten, example_inputs, context)
        else:
            self.untraceable.check(gm)
            step, reports = compile_step(gm, example_inputs, context)
        # The tier keeps the step's graphs, not AOTAutograd's runtime (dropped below).
        tier = TierMaker(dataclasses.replace(step, aot_callable=None), self.options,
                         f"{self.owner} graph {index}", self.alive) if self.executor.compiles_later else None
        runtime = runner.build(step, self.executor, self.context, self.options.backward, tier)
        if runtime.mode != "aot":
            step = dataclasses.replace(step, aot_callable=None)   # AOTAutograd's runtime: not needed
        compiled = runtime.call
        if recipe is not None:
            cache_recipe.finish(recipe, gm, step.plans)
            compiled = cache_recipe.watch(recipe, compiled)
        record = self.info.add(GraphRecord(index=index, mode=mode, dynamo_graph=gm, reason=reason,
                                           break_site=site, optimizations=reports, step=step, run=runtime,
                                           tier=tier.made if tier else None, cache_recipe=recipe))
        if self.options.save_graphs_dir:
            dump_capture(self.options.save_graphs_dir, self.owner, self.info, record)
        logger.info("captured graph %d (%s): %d nodes, executor %s, runtime %s", record.index, record.mode,
                    len(gm.graph.nodes), self.executor.name, record.runtime)
        return compiled

    def partitions_later(self, gm: torch.fx.GraphModule, example_inputs: List[object]) -> bool:
        """Whether this capture runs in the autograd mode until the partition worker has partitioned
        it (runtime/pending.py: why). Not where the partition must come first: a graph of symbolic
        sizes (its partition may add shape guards, which must join dynamo's before the capture is
        installed), a memory budget (its plan is the partition), graph dumps (they write the aten
        graphs at capture), the graph mode asked for, the profiler's captures, an
        executor without the autograd mode, custom autograd Functions (PythonOps: their classes may
        not import in the worker); nor for a graph that does not pickle (``partition_worker.request``).
        Autocast is no reason: the worker traces under the capture's (``partition_worker.autocast_now``).
        Nor is the cache: it stores the whole step when the partition is back (cache/session.py), so a
        cache_dir costs the first step nothing (issue 19: +3.3 s when it partitioned at capture)."""
        options, plugins = self.options, self.plugins
        if not (self.executor.autograd_mode and plugins.executor is None and plugins.real_batches
                and plugins.on_budget_state is None and options.backward != "graph"
                and options.memory_budget is None and not options.save_graphs_dir
                and torch.is_grad_enabled()):
            return False
        tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
        if len(tensors) != len(example_inputs) or tp.detect_fake_mode(tensors) is None:
            return False   # symbolic scalars among the inputs
        if any(isinstance(d, torch.SymInt) for t in tensors for d in (*t.shape, *t.stride())):
            return False
        return not any(n.op == "call_function" and str(n.target).startswith("fxtrain.python_op")
                       for n in gm.graph.nodes)

    def _partition_later(self, rewritten: Rewritten, request: bytes, mode: str, reason: str, site: Any,
                         index: int, recipe: Optional[cache_recipe.Recipe]) -> Callable[..., object]:
        owner = f"{self.owner} graph {index}"
        before = unpartitioned(rewritten)
        box: Dict[str, Any] = {}

        def partitioned() -> Ready:
            step, reports, pending.cpu_seconds = from_worker(rewritten, partition_worker.partition(request),
                                                             self.executor)
            tier = TierMaker(step, self.options, owner, self.alive) if self.executor.compiles_later else None
            core, run_mode, why = runner.core_for(step, self.executor, self.options.backward, tier)
            run = dataclasses.replace(box["runtime"], mode=run_mode, reason=why)

            def record() -> None:
                made = tier.made if tier else None
                if made is not None:   # the capture's calls so far count as the tier's (its steps)
                    made.calls = pending.calls
                self.info.note_partition(box["record"], step, run, reports, made)
            return Ready(core, record, step, run_mode, reports, tier.made if tier else None)

        pending = PendingPartition(owner, partitioned)
        box["runtime"] = runtime = runner.build(before, self.executor, self.context, later=pending)
        compiled = runtime.call
        if recipe is not None:   # the cache stores the whole step once the partition is back
            cache_recipe.finish(recipe, rewritten.graph, before.plans)
            compiled = cache_recipe.watch(recipe, compiled)
        box["record"] = record = self.info.add(GraphRecord(
            index=index, mode=mode, dynamo_graph=rewritten.graph, reason=reason, break_site=site,
            optimizations=dict(rewritten.reports), step=before, run=runtime, pending=pending,
            cache_recipe=recipe))
        logger.info("captured graph %d (%s): %d nodes, executor %s, runtime %s (partitioned later)",
                    index, mode, len(rewritten.graph.graph.nodes), self.executor.name, record.runtime)
        return compiled
