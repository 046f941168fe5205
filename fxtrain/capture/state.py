"""Whether fxtrain is capturing a graph right now.

Dynamo evaluates ``torch.compiler.is_compiling()`` as a constant True while it traces and it is
False at run time, so user code guarded by ``is_capturing()`` is left out of the graph without a
guard that would force a recapture. fxtrain's own non-dynamo traces (fake-tensor runs) set the
flag explicitly.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

_local = threading.local()


def is_capturing() -> bool:
    """True while fxtrain captures a graph: skip collectives, logging or anything not to be traced."""
    if getattr(_local, "real", 0):
        return False
    if torch.compiler.is_compiling():
        return True
    return getattr(_local, "depth", 0) > 0


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Mark a region where fxtrain traces user code outside dynamo (e.g. on fake tensors)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


@contextlib.contextmanager
def real_step() -> Iterator[None]:
    """A step's real run of user code made while capturing (a Function's forward shaped by its run
    on the capturing call, pythonop/op.py): it is not a capture, so ``is_capturing()`` is false, but
    a TrainModule called inside runs eagerly, as in fxtrain's own fake runs (it cannot start a
    capture of its own inside this one)."""
    _local.real = getattr(_local, "real", 0) + 1
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.real -= 1
        _local.depth -= 1


def in_fake_run() -> bool:
    """True inside fxtrain's own runs of user code while it captures (not dynamo's trace): fake-tensor
    runs (``infer_shape``) and ``real_step``; nested TrainModules run eagerly there.

    ``is_dynamo_compiling`` (true only in code dynamo traces), not ``is_compiling``: torch 2.13 holds
    the latter true for the whole compile session, including our fake runs, where a nested
    TrainModule would otherwise start a capture of its own on fake inputs.
    """
    return getattr(_local, "depth", 0) > 0 and not torch.compiler.is_dynamo_compiling()
