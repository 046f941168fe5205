"""What every pass returns: whether it rewrote the graph and why (``capture_info().optimizations``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch.fx

from ..options import Options


@dataclass
class PassReport:
    name: str
    applied: bool
    reason: str

    def __str__(self) -> str:
        return f"{'on' if self.applied else 'off'}: {self.reason}"


Pass = Callable[[torch.fx.GraphModule, Sequence[object], Options], PassReport]
