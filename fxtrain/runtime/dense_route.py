"""The dense route: a batch the sparse graph cannot serve runs through the graph without the passes.

The sparsity passes are exact under per-batch conditions (``passes/batch_guard.py`` writes them as one ``BatchGuard``): a label on a
padding token, or a classifier reading a position that is padding in some row, would need values
the rewritten graph never computes. Eager PyTorch trains such batches, so fxtrain must too: the
guard is evaluated before the step, and a failing batch runs the capture's own graph as dynamo
traced it, before any pass (plain torch ops under eager autograd: eager's numbers by construction,
no second capture). ``Options.sparsity_guard="raise"`` keeps the strict behaviour for benchmarks and
tests that must not silently lose the speed-up.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, List, Sequence, Tuple

import torch.fx

from ..errors import Error
from .direct import direct
from .host_counts import provide

logger = logging.getLogger("fxtrain")


class BatchGuard:
    """The conditions of one capture, and the row counts its selections need.

    ``check(*graph_inputs)`` is an int64 vector: one 0/1 per reason, one count per slot, then for
    each of ``vector_slots`` its length ``n`` and ``n`` per-row counts.
    """

    def __init__(self, check: torch.fx.GraphModule, reasons: List[str], slots: List[int],
                 vector_slots: Sequence[int] = ()) -> None:
        self.check, self.reasons, self.slots = check, reasons, slots
        self.vector_slots = list(vector_slots)

    def failed(self, args: Tuple[Any, ...]) -> List[str]:
        """The reasons this batch breaks (empty: the rewritten graph serves it), after leaving the
        counts for the step. One host synchronisation, the step's only one."""
        # copy=True: on a CPU module a copy too, so that the one transfer is one op on every device.
        values = direct(self.check)(*args).to("cpu", copy=True).tolist()
        n = len(self.reasons)
        failed = [r for r, good in zip(self.reasons, values[:n]) if not good]
        if not failed:  # the rewritten graph runs (the dense one has no selection to size)
            for slot, rows in zip(self.slots, values[n:]):
                provide(slot, rows)
            at = n + len(self.slots)
            for slot in getattr(self, "vector_slots", ()):  # absent from guards pickled before them
                size = values[at]
                provide(slot, values[at + 1:at + 1 + size])
                at += 1 + size
        return failed


class SparseBatchError(Error, RuntimeError):
    """A batch breaks a sparsity pass's per-batch condition and ``sparsity_guard="raise"``."""


class DenseRoute:
    """Chooses, per call, between the rewritten graph and the graph without passes. ``count`` is
    ``CaptureInfo.count_dense_batch`` (True: the module's first such batch, so it warns once per module)."""

    def __init__(self, guard: BatchGuard, count: Callable[[str], bool], policy: str, owner: str) -> None:
        self.guard, self.count, self.policy, self.owner = guard, count, policy, owner

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
        if self.count(reason):
            logger.warning("fxtrain: %s: %s in this batch, so it runs through the graph without the sparsity "
                           "passes (eager's numbers, eager's speed); capture_info().dense_batches counts such "
                           "batches", self.owner, reason)
        return False

    def wrap(self, sparse: Callable[..., Any], dense: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            return sparse(*args) if self.admits(args) else dense(*args)
        return run
