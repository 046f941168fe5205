"""What the forward passes hand the runtime besides the rewritten graph: one explicit value.

Passes fill one ``Plans`` per capture (it is an argument of every pass and comes back from
``run_passes``), so nothing travels on ``gm.meta`` or other attributes found again later. The
capture stores it in the ``CapturedStep`` and the runtime (live or from the cache) reads it there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple


@dataclass
class Plans:
    # runtime/deferred.py: outputs computed on first use instead of in the step.
    deferred: Optional[Any] = None                                 # DeferredPlan
    # runtime/density.py: (what, placeholder index, absent value) measured per call.
    probes: List[Tuple[str, int, int]] = field(default_factory=list)
    # runtime/dense_route.py: conditions a batch must meet for the rewritten graph to serve it.
    guard: Optional[Any] = None                                    # BatchGuard
    # While the passes run: the builder ``guard`` came from, so that a later pass adds its conditions
    # and row counts to the same guard (one host transfer per step). run_passes drops it.
    guard_builder: Optional[Any] = field(default=None, repr=False, compare=False)  # GuardBuilder
