"""Graph passes.

Forward passes are functions ``(GraphModule, ExampleSource, Options, Plans) -> PassReport``: they
rewrite the dynamo-level graph before AOTAutograd (so their rewrites are differentiated like any
other torch code and the backward shrinks with the forward) and put what the runtime needs besides
the graph (deferred outputs, density probes, the batch guard) into the capture's ``Plans``. What
they read of the capturing batch comes from the ``ExampleSource`` alone (``density.py``), so a pass
runs the same on dynamo's graph, the profiler's fake capture and a hand-built ``GraphModule``.
Backward passes are ``GraphModule -> PassReport`` on the aten backward graph after partitioning;
forward graph passes the same on the aten forward graph (what the graph runtime replays).
Ordering needs are declared in ``RUNS_AFTER`` and checked, not left to a list's order.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch.fx

from .. import torch_private as tp
from ..options import Options
from ..runtime.executors import Executor
from ..runtime.step import PassReport, Plans
from .base import Pass
from . import cross_entropy_grad as _ce_grad, embedding_grad as _emb_grad
from .cross_entropy_grad import cross_entropy_grad
from .density import DynamoExamples, ExampleSource
from .documents import packed_attention
from .embedding_grad import tied_embedding_grad
from .label_sparsity import label_sparsity
from .noop_copies import noop_copies
from .padding_elimination import padding_elimination
from .rows import contraction_dtype, forward_flops, kernel_ops
from .scatter_in_place import scatter_in_place
from .upstream_slicing import upstream_slicing

# Padding elimination keeps the row selections the others inserted and checks them on real tokens.
# Packed attention takes the attentions padding elimination leaves (its own per-sequence attention
# on real tokens comes first where a batch is padded; a packed one has no attention_mask).
RUNS_AFTER: Dict[str, Tuple[str, ...]] = {"padding_elimination": ("label_sparsity", "upstream_slicing"),
                                          "packed_attention": ("padding_elimination",)}


def ordered(passes: Sequence[Pass]) -> List[Pass]:
    """``passes`` in an order that meets ``RUNS_AFTER`` (stable otherwise); raises on a cycle."""
    by_name = {p.__name__: p for p in passes}
    done: List[Pass] = []
    visiting: set = set()

    def visit(p: Pass) -> None:
        if p in done:
            return
        if p.__name__ in visiting:
            raise ValueError(f"pass ordering cycle through {p.__name__}")
        visiting.add(p.__name__)
        for name in RUNS_AFTER.get(p.__name__, ()):
            if name in by_name:
                visit(by_name[name])
        visiting.discard(p.__name__)
        done.append(p)

    for p in passes:
        visit(p)
    return done


PASSES: List[Pass] = ordered([label_sparsity, upstream_slicing, padding_elimination, packed_attention])
BACKWARD_PASSES: List[Callable[[torch.fx.GraphModule], PassReport]] = [cross_entropy_grad, tied_embedding_grad]
FORWARD_GRAPH_PASSES: List[Callable[[torch.fx.GraphModule], PassReport]] = [scatter_in_place]
# On the joint graph, before the partitioner: what must hold in both directions at once.
JOINT_GRAPH_PASSES: List[Callable[[torch.fx.GraphModule], PassReport]] = [noop_copies]
# The aten ops each backward pass rewrites: a code generator must leave them whole for the pass.
BACKWARD_PASS_OPS: Dict[str, Tuple[object, ...]] = {"cross_entropy_grad": _ce_grad.OPS, "tied_embedding_grad": _emb_grad.OPS}


def run_backward_passes(bw: torch.fx.GraphModule, executor: Executor) -> List[PassReport]:
    """The backward passes on ``bw``, less those ``executor`` skips (reported as off, with its reason).

    Then each op kept whole for them (``backward_pass_ops``) that no pass rewrote is decomposed as
    the executor's table would have done at the trace: to a code generator a whole op is an opaque
    kernel call. Under inductor that was the gradient of every untied embedding (BERT's position and
    token types: ``embedding_dense_backward``), which on CUDA past 3,072 indices is PyTorch's
    sort-based kernel of ~15 launches, where inductor fuses its decomposition (a zero fill and an
    accumulating scatter) as torch.compile does. One sized by a row count only the batch knows (the
    sparsity passes' row gathers) stays whole where its decomposition asks something of that count
    and so cannot be traced (torch 2.13 and 2.14: ``tp.decompose_calls``)."""
    skips = executor.skips_backward_passes
    reports = [PassReport(p.__name__, False, skips[p.__name__]) if p.__name__ in skips else p(bw)
               for p in BACKWARD_PASSES]
    table = executor.decompositions()
    if table is not None:
        tp.decompose_calls(bw, backward_pass_ops(executor), table)
    return reports


def backward_pass_ops(executor: Executor) -> List[object]:
    """The ops to keep whole for the backward passes ``executor`` runs."""
    skips = executor.skips_backward_passes
    return [op for name, ops in BACKWARD_PASS_OPS.items() if name not in skips for op in ops]


def run_passes(gm: torch.fx.GraphModule, examples: ExampleSource, options: Options, plans: Plans,
               weigh: Optional[Callable[[PassReport], Optional[str]]] = None
               ) -> Tuple[Dict[str, PassReport], Optional[PassReport]]:
    """The forward passes on ``gm``, in order; each report carries the kernels its rewrite added to
    the forward (``rows.kernel_ops`` before and after), which ``weigh`` (the capture's launch model,
    capture/pipeline.py) weighs against the FLOPs it saves on the graph's device. The reports, and
    the first pass ``weigh`` finds slower (None: all kept): there the passes stop, with ``gm`` and
    ``plans`` part-rewritten, so that the caller reruns them without it on the graph as dynamo traced
    it; the passes after it never ran on a graph they would not see."""
    reports: Dict[str, PassReport] = {}
    changed = False
    kernels = kernel_ops(gm)
    for p in PASSES:
        report = p(gm, examples, options, plans)
        if report.applied:
            now = kernel_ops(gm)
            report.added_kernels, kernels = now - kernels, now
            why = weigh(report) if weigh is not None else None
            if why:
                reports[report.name] = PassReport(report.name, False, why)
                return reports, reports[report.name]
        reports[report.name] = report
        changed |= report.applied
    plans.guard_builder = None  # plans.guard is final: the builder (and the graph it copies from) can go
    if changed:
        gm.graph.lint()
        gm.recompile()
    return reports, None


__all__ = ["BACKWARD_PASSES", "BACKWARD_PASS_OPS", "backward_pass_ops", "contraction_dtype", "forward_flops",
           "kernel_ops", "run_backward_passes", "DynamoExamples", "ExampleSource",
           "FORWARD_GRAPH_PASSES", "PASSES", "Pass", "PassReport", "Plans", "RUNS_AFTER", "ordered", "run_passes"]
