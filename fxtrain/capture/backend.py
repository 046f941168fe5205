"""The dynamo backend: receives each graph dynamo captures, runs our passes, hands it to an executor."""
from __future__ import annotations

import logging
import re
from typing import Callable, List, Optional

import torch
import torch.fx

from ..cache import recipe as cache_recipe
from ..options import Options
from ..passes import run_passes
from ..passes.batch_guard import META_KEY as GUARD_KEY
from ..passes.defer import META_KEY as DEFERRED_KEY
from ..runtime import compile_graph
from ..passes.density import PROBES_KEY
from ..runtime.dense_route import DenseRoute
from ..runtime.deferred import with_deferred
from ..runtime.density import with_density_probes
from .breaks import graph_break_site
from .dump import dump_capture
from .info import CaptureInfo, GraphRecord

logger = logging.getLogger("fxtrain")


def dynamo_recompile_reason() -> str:
    """The guard that failed when dynamo recompiles a frame ('' on a first compile): dynamo records
    it only in its compile metrics, whose layout is private, hence the defensive reading."""
    try:
        from torch._dynamo.utils import get_metrics_context
        reason = get_metrics_context()._metrics.get("recompile_reason") or ""
    except Exception:
        return ""
    first = str(reason).strip().splitlines()[0] if str(reason).strip() else ""
    return re.sub(r"^\d+/\d+: ", "", first.split("#", 1)[0].strip())  # "0/3: L['t'] == 1.5  # source"


class RecompileLimitReached(RuntimeError):
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

    Subclasses change how a graph is compiled (``compile``) and whether each call measures the
    batch's densities (``probe_density``: impossible on fake tensors, where values are unknown).
    """

    probe_density = True

    def __init__(self, info: CaptureInfo, options: Options, training: Callable[[], bool],
                 owner: str = "model", on_graph: Optional[Callable[[], None]] = None) -> None:
        self.info = info
        self.owner = owner
        self.options = options
        self.training = training
        # Called first for every graph, before anything of it runs (TrainModule copies buffers there).
        self.on_graph = on_graph
        self.may_capture = True   # set by TrainModule per call (Options.recompile_limit)

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
        traced = _copy_graph(gm.graph)
        record.optimizations = run_passes(gm, example_inputs, self.options)
        record.report_to = self.info.optimizations
        compiled = self.compile(gm, example_inputs, record)
        plan = gm.meta.pop(DEFERRED_KEY, None)
        if plan is not None:
            compiled = with_deferred(compiled, plan)
        guard = gm.meta.pop(GUARD_KEY, None)
        if guard is not None and self.probe_density:
            route = DenseRoute(guard, self.info.dense_batches, self.options.sparsity_guard, self.owner)
            compiled = route.wrap(compiled, torch.fx.GraphModule(gm, traced))
        probes = gm.meta.pop(PROBES_KEY, None)
        if probes and self.probe_density:
            compiled = with_density_probes(compiled, probes, self.info.density, self.options.log_density)
        if recipe is not None:
            cache_recipe.finish(recipe, gm)
            recipe.plan = plan.portable() if plan is not None else None
            recipe.probes = list(probes or [])
            recipe.guard = guard
            record.cache_recipe = recipe
            compiled = cache_recipe.watch(recipe, compiled)
        self.info.records.append(record)
        self.info.graphs += 1
        self.info.optimizations.update(record.optimizations)
        if self.options.save_graphs_dir:
            dump_capture(self.options.save_graphs_dir, self.owner, self.info, record)
            if record.backward_graph is None and not record.inference:
                # AOTAutograd compiles the backward at the first backward: dump it then.
                record.backward_hooks.append(lambda: dump_capture(self.options.save_graphs_dir, self.owner,
                                                                  self.info, record))
        logger.info("captured graph %d (%s): %d nodes, executor %s", record.index, record.mode,
                    len(gm.graph.nodes), self.options.executor)
        return compiled

    def compile(self, gm: torch.fx.GraphModule, example_inputs: List[object], record: GraphRecord) -> Callable[..., object]:
        return compile_graph(gm, example_inputs, self.options.executor, record)


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """The graph as dynamo traced it, before any pass: what a batch the passes cannot serve runs.
    Nodes are copied (metadata shallowly), so the passes' rewrites of ``graph`` do not reach it."""
    copy = torch.fx.Graph()
    copy._codegen = graph._codegen
    env: dict = {}
    out = copy.graph_copy(graph, env)
    copy.output(out)
    return copy
