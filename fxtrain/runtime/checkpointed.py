"""Checkpointed regions of a torch-level graph, run as eager PyTorch runs them.

Dynamo records each ``torch.utils.checkpoint`` call (HF's ``gradient_checkpointing_enable``) as a
call of torch's region op on a body graph (``torch_private.CHECKPOINT_OP``). When AOTAutograd
traces the graph, that op is what it should be: the body's ops, tagged for the partitioner to
recompute in the backward (the graph mode's aten graphs). Called on real tensors, as fxtrain's
autograd mode and its dense route call the torch-level graph, torch's implementation is not eager's
checkpoint: torch 2.11 runs the body as plain code (nothing recomputed: a checkpointed 4-layer
BERT-MLM kept 39.1 MiB for its backward where eager's checkpointing keeps 9.1), and 2.13 and 2.14
run it through ``torch.utils.checkpoint`` with ``preserve_rng_state=False``, because under a
compiler the random numbers are functionalised (inductor's ``replace_random_passes``): run eagerly,
the backward's recomputation of a checkpointed dropout drew a fresh mask, and the gradients were
not eager's (a 2-layer BERT-MLM with dropout 0.1: off by up to 1e-2 where the loss agreed to the
last bit). tests/test_checkpointing.py checks both.

So the code that runs a torch-level graph calls :func:`run_checkpointed` in the op's place
(:func:`checkpointing_eagerly`, a copy: the graph itself keeps torch's op for AOTAutograd, the
cache and the profiler): ``torch.utils.checkpoint`` on the body, non-reentrant, with the arguments
its user gave (``preserve_rng_state`` defaults to True, as in eager) and a selective policy's
``context_fn``. A reentrant call runs non-reentrant here: the same values and gradients, without the
reentrant variant's limits.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.utils.checkpoint

from .. import torch_private as tp
from .direct import direct

# checkpoint's own arguments that change what an eager run computes or checks; use_reentrant is set.
_PASSED = ("preserve_rng_state", "determinism_check", "debug")


def run_checkpointed(body: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """The region ``body(*args)`` under ``torch.utils.checkpoint``, as its user called it."""
    options = {k: kwargs[k] for k in _PASSED if k in kwargs}
    context_fn = tp.checkpoint_context_fn(body)
    if context_fn is not None:
        options["context_fn"] = context_fn
    return torch.utils.checkpoint.checkpoint(direct(body), *args, use_reentrant=False, **options)


def checkpointing_eagerly(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``graph`` whose region calls go to :func:`run_checkpointed`; ``graph`` itself where
    it has none."""
    if not any(tp.is_checkpoint_call(n) for n in graph.graph.nodes):
        return graph
    copied = torch.fx.GraphModule(graph, tp.copy_graph(graph.graph))
    for n in copied.graph.nodes:
        if tp.is_checkpoint_call(n):
            n.target = run_checkpointed
    copied.recompile()
    return copied
