"""Which module an op belongs to when the step runs eagerly (``optimizations=False``).

torch's ``ModuleTracker`` follows modules through forward and backward (hooks on module inputs and
outputs); the innermost of its active modules is the one an op is attributed to.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils.module_tracker import ModuleTracker


class InnermostModule(ModuleTracker):
    """ModuleTracker that answers with the innermost active module's qualified name."""

    def __init__(self, root: torch.nn.Module) -> None:
        super().__init__()
        self._root_name = self._get_mod_name(root)

    def current(self) -> Optional[str]:
        names = [p for p in self.parents if p != "Global"]
        if not names:
            return None
        deepest = max(names, key=lambda n: (n.count("."), len(n)))
        if deepest == self._root_name:
            return ""
        return deepest[len(self._root_name) + 1:] if deepest.startswith(self._root_name + ".") else deepest
