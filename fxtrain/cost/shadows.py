"""Real values behind fake tensors (see tracker.py): looked up by tensor, or by storage for aliases.

Autograd hands a saved output back as a new tensor object over the same storage (and AOTAutograd
may alias graph outputs), so a value is found again through its storage when the object differs;
the storage key is only trusted while the fake tensor it was recorded for is alive.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Dict, Optional, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary


def _layout(t: torch.Tensor) -> Tuple:
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


class Shadows:
    def __init__(self) -> None:
        self._by_tensor: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._by_storage: Dict[int, Tuple[weakref.ref, Tuple, torch.Tensor]] = {}

    def set(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        self._by_tensor[fake] = real
        try:
            key = fake.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return
        self._by_storage[key] = (weakref.ref(fake), _layout(fake), real)

    def get(self, fake: torch.Tensor) -> Optional[torch.Tensor]:
        real = self._by_tensor.get(fake)
        if real is not None:
            return real
        try:
            key = fake.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return None
        entry = self._by_storage.get(key)
        if entry is None:
            return None
        ref, layout, real = entry
        owner = ref()
        if owner is None:
            del self._by_storage[key]
            return None
        if layout != _layout(fake) or owner.untyped_storage()._cdata != key:
            return None
        return real

    def drop(self, fake: torch.Tensor) -> None:
        self._by_tensor.pop(fake, None)
        with contextlib.suppress(RuntimeError, NotImplementedError):
            self._by_storage.pop(fake.untyped_storage()._cdata, None)

    def __contains__(self, fake: object) -> bool:
        return isinstance(fake, torch.Tensor) and self.get(fake) is not None

    def __getitem__(self, fake: torch.Tensor) -> torch.Tensor:
        real = self.get(fake)
        if real is None:
            raise KeyError("no value")
        return real
