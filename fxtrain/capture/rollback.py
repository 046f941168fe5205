"""Buffers as they were before a call that failed, so its eager rerun updates them exactly once.

When a call fails, TrainModule reruns it eagerly (eager fails too: the user's error; eager works:
a capture failure). If a graph of the failed call had already updated a buffer in place (BatchNorm's
running statistics), the rerun would update it a second time. A copy of every buffer on every call
would prevent that at a cost each training step pays, so copies are taken only where a graph can
have run before the failure:

- a call with a new input schema: copied before the call (it is going to capture);
- a call that captures for another reason (new sizes, a float that changed, a guard): copied when
  dynamo hands over the call's first graph from the entry frame, before any graph of the call ran;
- every call of a module whose graphs update buffers: a later graph of the call, the rest of a graph
  run in the autograd runtime (batch norm's kernel writes its statistics as it goes), or fxtrain's
  output wrappers after the aten-graph runtime wrote the updates back may fail after the update.
  Only the updated buffers are copied (batch norm's statistics: a few small tensors per layer).

Everything else — modules without buffer updates, the common case — costs nothing.
"""
from __future__ import annotations

import logging
from typing import List, Optional, Tuple

import torch
from torch import nn

from ..capture_state import compiled_frame_name, is_entry_frame
from ..torch_private import is_fake

logger = logging.getLogger("fxtrain")

_Snapshot = List[Tuple[torch.Tensor, torch.Tensor, int]]   # (buffer, copy, version when copied)


def _copy(buffers: List[torch.Tensor]) -> _Snapshot:
    return [(b, b.detach().clone(), b._version) for b in buffers]


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if is_fake(a) or a.device.type == "meta":
        return True  # no values to compare (the profiler's fake runs): versions decide
    return bool(torch.equal(a, b))


class Rollback:
    """One per TrainModule. ``begin`` opens a call; ``on_graph`` is the backend's hook; ``restore``
    undoes the failed call's buffer updates."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.updated: List[str] = []                 # names of the buffers a graph was seen to update
        self.every_call = False                      # several graphs per call and updated buffers
        self._updated_tensors: Optional[List[torch.Tensor]] = None
        self._snapshot: Optional[_Snapshot] = None

    def begin(self, new_schema: bool) -> None:
        if new_schema:
            self._snapshot = _copy(list(self.module.buffers()))
        elif self.every_call:
            self._snapshot = _copy(self._updated())
        else:
            self._snapshot = None

    def end(self) -> None:
        """The call succeeded: drop its copy (it may hold every buffer of the model)."""
        self._snapshot = None

    def on_graph(self) -> None:
        """Dynamo hands over a graph: copy the buffers if nothing of the current call ran yet."""
        if self._snapshot is None and is_entry_frame(compiled_frame_name()):
            self._snapshot = _copy(list(self.module.buffers()))

    def after_capture(self) -> None:
        """A call that captured succeeded: learn which buffers its graphs update (the copy's version
        moved, or its values), which later calls copy."""
        if self._snapshot is None:
            return
        # Versions alone miss kernels that write a buffer in place without bumping its version (the
        # batch norm kernel's running statistics, under the autograd runtime): compare values too,
        # which only capturing calls pay.
        moved = {id(buffer) for buffer, copy, version in self._snapshot
                 if buffer._version != version or not _same_values(buffer, copy)}
        names = [name for name, b in self.module.named_buffers() if id(b) in moved and name not in self.updated]
        if names:
            self.updated.extend(names)
            self._updated_tensors = None
        if self.updated and not self.every_call:
            self.every_call = True
            logger.info("fxtrain: %s updates buffers in place; each call now copies those %d buffer(s) so "
                        "that a failure can fall back without a double update",
                        type(self.module).__name__, len(self.updated))

    def restore(self) -> None:
        """Put the buffers copied for the failed call back (nothing to do without a copy: see above)."""
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is None:
            return
        with torch.no_grad():
            for buffer, copy, _ in snapshot:
                buffer.copy_(copy)

    def forget(self) -> None:
        """Buffers may have been replaced (``to()``, ``load_state_dict``): look them up by name again."""
        self._updated_tensors = None
        self._snapshot = None

    def _updated(self) -> List[torch.Tensor]:
        if self._updated_tensors is None:
            buffers = dict(self.module.named_buffers())
            self._updated_tensors = [buffers[name] for name in self.updated if name in buffers]
        return self._updated_tensors
