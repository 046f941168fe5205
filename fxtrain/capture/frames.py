"""Which Python frame dynamo is compiling, for rewrites that must know where a graph's outputs go.

Each TrainModule calls dynamo through an entry function of its own (``capture/entry.py``) named
``fxtrain_capture_<n>``; after a graph break dynamo continues it in a function it names
``torch_dynamo_resume_in_fxtrain_capture_<n>_at_<line>``. Graphs of other frames (an inner
``forward`` compiled on its own after a break) return to model code, not to the caller.
"""
from __future__ import annotations

from typing import Optional

ENTRY_NAME = "fxtrain_capture"
ENTRY_PREFIXES = (ENTRY_NAME + "_", "torch_dynamo_resume_in_" + ENTRY_NAME + "_")


def compiled_frame_name() -> Optional[str]:
    """The code name of the frame dynamo is translating now (None outside dynamo's backend call)."""
    try:
        from ..torch_private import current_instruction_translator
        tx = current_instruction_translator()
    except Exception:
        return None
    code = getattr(tx, "f_code", None)
    return getattr(code, "co_name", None)
