"""Whether fxtrain is capturing a graph right now, and which Python frame dynamo is compiling.

Shared by the capture, the PythonOps that run user code during it and the passes, all above it.
Dynamo evaluates ``torch.compiler.is_compiling()`` as a constant True while it traces and it is
False at run time, so user code guarded by ``is_capturing()`` is left out of the graph without a
guard that would force a recapture. fxtrain's own non-dynamo traces (fake-tensor runs) set the
flag explicitly.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

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


# Which frame dynamo is compiling, for rewrites that must know where a graph's outputs go. Each TrainModule calls dynamo through an entry function of its own (``capture/entry.py``) named
# ``fxtrain_capture_<n>``; after a graph break dynamo continues it in a function it names
# ``torch_dynamo_resume_in_fxtrain_capture_<n>_at_<line>``. Graphs of other frames (an inner
# ``forward`` compiled on its own after a break) return to model code, not to the caller.
ENTRY_NAME = "fxtrain_capture"
ENTRY_PREFIXES = (ENTRY_NAME + "_", "torch_dynamo_resume_in_" + ENTRY_NAME + "_")


def is_entry_frame(code_name: Optional[str]) -> bool:
    """Whether ``code_name`` is a TrainModule's entry function (nothing of the call ran yet) rather
    than a resume function or a frame called after a graph break."""
    return bool(code_name and code_name.startswith(ENTRY_NAME + "_"))


def compiled_frame_name() -> Optional[str]:
    """The code name of the frame dynamo is translating now (None outside dynamo's backend call)."""
    try:
        from .torch_private import current_instruction_translator
        tx = current_instruction_translator()
    except Exception:
        return None
    code = getattr(tx, "f_code", None)
    return getattr(code, "co_name", None)
