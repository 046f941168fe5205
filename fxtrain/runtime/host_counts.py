"""Row counts read ahead of the step, so that a sparse step synchronises with the device once.

The sparsity passes run part of the step on selected rows (real tokens, labelled positions): the
number of rows is known only from the batch's values. ``torch.nonzero`` finds it by reading the
count back to the host, one device-to-host synchronisation per selection, on top of the batch
guard's own read. Instead the batch guard (``passes/batch_guard.py``) computes every count the step
needs together with its conditions, and reads them to the host in one transfer before the step;
each selection in the graph is ``nonzero_static(valid, size=count(valid, slot))``, where ``count``
returns the number the guard left under ``slot``: a host read, no synchronisation.

The same guard read also leaves per-row numbers (``row_lengths``, a host tensor of each sequence's
real tokens) where an op must know where each sequence starts in the packed rows, and per-token
flags (``document_lengths``: which tokens begin a document of a packed row) from which the host
derives the documents' lengths: the number of documents varies from batch to batch, the flags do not.

``count`` is exact either way: with no number left for it (a path that did not run the guard) it
counts on the device itself, which costs the synchronisation ``nonzero`` would have. A number is
used once (popped), so a stale one from an earlier batch can never size a selection.
"""
from __future__ import annotations

import secrets
import threading
from typing import Dict, List, Union

import torch

_local = threading.local()


def _table() -> Dict[int, Union[int, List[int]]]:
    table = getattr(_local, "counts", None)
    if table is None:
        table = _local.counts = {}
    return table


def new_slot() -> int:
    """A slot id for one selection: random, so that ids pickled into cached graphs and guards
    (``Options.cache_dir``) do not meet the ids of another capture in a later process."""
    return secrets.randbits(62)


def provide(slot: int, value: Union[int, List[int]]) -> None:
    """The number of rows the next ``count(..., slot)`` on this thread returns, or (a list) the
    per-row numbers the next ``row_lengths(..., slot)`` returns."""
    _table()[slot] = [int(v) for v in value] if isinstance(value, list) else int(value)


@torch.library.custom_op("fxtrain_host::count", mutates_args=())
def count(valid: torch.Tensor, slot: int) -> int:
    """``int(valid.sum())`` for a bool ``valid``: read ahead by the batch guard, else counted here."""
    value = _table().pop(slot, None)
    if value is None:
        return int(valid.sum())  # nothing read ahead: one synchronisation, the same number
    return value


@count.register_fake
def _count_fake(valid: torch.Tensor, slot: int) -> torch.SymInt:
    return torch.library.get_ctx().new_dynamic_size()


HOST_COUNT = torch.ops.fxtrain_host.count.default


@torch.library.custom_op("fxtrain_host::row_lengths", mutates_args=())
def row_lengths(valid: torch.Tensor, slot: int) -> torch.Tensor:
    """``valid.sum(1)`` for a 2-d bool ``valid``, as an int64 tensor on the host: the length of each
    sequence, for ops that slice the packed real tokens sequence by sequence
    (``runtime/varlen_attention.py``). Read ahead by the batch guard, else counted here (one
    synchronisation, the same numbers)."""
    value = _table().pop(slot, None)
    if not isinstance(value, list) or len(value) != valid.shape[0]:
        return valid.sum(1).to("cpu")
    return torch.tensor(value, dtype=torch.int64)


@row_lengths.register_fake
def _row_lengths_fake(valid: torch.Tensor, slot: int) -> torch.Tensor:
    return torch.empty((valid.shape[0],), dtype=torch.int64, device="cpu")


HOST_ROW_LENGTHS = torch.ops.fxtrain_host.row_lengths.default


@torch.library.custom_op("fxtrain_host::document_lengths", mutates_args=())
def document_lengths(starts: torch.Tensor, slot: int) -> torch.Tensor:
    """The documents of packed rows, for ``varlen_attention`` over the flattened rows: ``starts``
    (``[batch, seq]`` bool) marks each token that begins a document (a row's first token always
    does). An int64 host tensor of ``batch * seq`` entries: every row's document lengths in order,
    then zeros (zero-length blocks are skipped), so that its size does not depend on the values.
    The batch guard reads the flags ahead (a fixed-size vector, whatever the number of documents);
    else they are read here (one synchronisation, the same numbers)."""
    value = _table().pop(slot, None)
    rows, seq = starts.shape
    if not isinstance(value, list) or len(value) != rows * seq:
        value = starts.to("cpu").flatten().tolist()
    # Host lists, not tensor ops: a CPU nonzero would look like a device read to a sync counter.
    at = [i for i, flag in enumerate(value) if flag or i % seq == 0] + [rows * seq]
    found = [end - start for start, end in zip(at, at[1:])]
    return torch.tensor(found + [0] * (rows * seq - len(found)), dtype=torch.int64)


@document_lengths.register_fake
def _document_lengths_fake(starts: torch.Tensor, slot: int) -> torch.Tensor:
    return torch.empty((starts.shape[0] * starts.shape[1],), dtype=torch.int64, device="cpu")


HOST_DOCUMENT_LENGTHS = torch.ops.fxtrain_host.document_lengths.default
