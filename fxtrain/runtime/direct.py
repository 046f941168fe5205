"""Run fxtrain's own graph modules as plain functions, never through ``nn.Module.__call__``.

The graphs fxtrain builds (the rewritten step, a batch guard's check, a deferred output's
computation) are not modules of the user's model: a global module hook (MemTracker, tracing or
sharding tools) must not see them, since one that acts on what it sees (e.g. registers gradient
hooks on the parameters it finds among the inputs) would change the step, and ``__call__``'s hook
dispatch is a per-call cost besides.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.fx


def direct(graph: Any) -> Callable[..., Any]:
    """``graph``'s generated forward, or ``graph`` itself when it is not a graph module.

    A lazily recompiled module's ``forward`` generates the code on first use and then calls the
    module (hooks included), and a bound copy taken earlier keeps doing so on every call: reading
    ``code`` generates it now, so ``forward`` is the generated function.
    """
    if not isinstance(graph, torch.fx.GraphModule):
        return graph
    graph.code  # noqa: B018 (materialises a lazy module's code)
    return graph.forward
