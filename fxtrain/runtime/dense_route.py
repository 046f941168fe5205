"""The dense route: a batch the sparse graph cannot serve runs through the graph without the passes.

The sparsity passes are exact under per-batch conditions (``passes/batch_guard.py``): a label on a
padding token, or a classifier reading a position that is padding in some row, would need values
the rewritten graph never computes. Eager PyTorch trains such batches, so fxtrain must too: the
guard is evaluated before the step, and a failing batch runs the capture's own graph as dynamo
traced it, before any pass (plain torch ops under eager autograd: eager's numbers by construction,
no second capture). ``Options.sparsity_guard="raise"`` keeps the strict behaviour for benchmarks and
tests that must not silently lose the speed-up.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict

from ..passes.batch_guard import BatchGuard
from ..errors import Error

logger = logging.getLogger("fxtrain")


class SparseBatchError(Error, RuntimeError):
    """A batch breaks a sparsity pass's per-batch condition and ``sparsity_guard="raise"``."""


class DenseRoute:
    """Chooses, per call, between the rewritten graph and the graph without passes.

    ``counts`` is ``CaptureInfo.dense_batches``: reason -> number of batches that took the route.
    """

    def __init__(self, guard: BatchGuard, counts: Dict[str, int], policy: str, owner: str) -> None:
        self.guard, self.counts, self.policy, self.owner = guard, counts, policy, owner

    def admits(self, args: Any) -> bool:
        """True when the rewritten graph serves this batch; otherwise counts it (or raises)."""
        failed = self.guard.failed(args)
        if not failed:
            return True
        reason = "; ".join(failed)
        if self.policy == "raise":
            raise SparseBatchError(
                f"fxtrain: {reason}, which the sparsity passes do not compute; nothing ran. Options("
                f"sparsity_guard='dense') (the default) trains such batches through the graph without "
                f"the passes; Options(padding_elimination='off') turns the pass off.")
        first = not self.counts  # shared by the module's captures: log once per module
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if first:
            logger.warning("fxtrain: %s: %s in this batch, so it runs through the graph without the sparsity "
                           "passes (eager's numbers, eager's speed); capture_info().dense_batches counts such "
                           "batches", self.owner, reason)
        return False

    def wrap(self, sparse: Callable[..., Any], dense: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            return sparse(*args) if self.admits(args) else dense(*args)
        return run
