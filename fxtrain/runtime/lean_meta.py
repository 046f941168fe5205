"""Node metadata cut down to what the runtime reads, for pickling graphs (the cache's entries, the
partition worker's requests and answers): stack traces, every node's fake value and whole module
stacks would triple the size and the load time."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch.fx

from .absent_grads import values_read
from .shapes import VALUE_KEY, value_info

MODULE_KEYS = ("nn_module_stack", "fwd_nn_module_stack")
MODULE_META = "fxtrain_module"


@contextlib.contextmanager
def lean_meta(gm: Optional[torch.fx.GraphModule], keep_values: bool, keep_fakes: bool = False,
              every_fake: bool = False) -> Iterator[None]:
    """Temporarily strip node metadata down to what the runtime reads; restored afterwards.
    ``keep_fakes``: the placeholders keep their fake values (symbolic sizes included), which a code
    generator compiles a loaded graph against (and finds its own kernel cache with); ``every_fake``:
    every node does (the partition worker's graphs: what ``capture_info()`` shows of a capture)."""
    if gm is None:
        yield
        return
    saved = {n: n.meta for n in gm.graph.nodes}
    keep = values_read(gm) if keep_values else set()
    try:
        for n in gm.graph.nodes:
            info = value_info(n) if n in keep else None
            n.meta = {VALUE_KEY: info} if info is not None else {}
            if (every_fake or keep_fakes and n.op == "placeholder") and "val" in saved[n]:
                n.meta["val"] = saved[n]["val"]
            for name in MODULE_KEYS:  # the profiler's per-module attribution: innermost module only
                stack = saved[n].get(name)
                if stack:  # under a name of ours: GraphPickler drops nn_module_stack
                    key, (path, cls) = list(stack.items())[-1]
                    n.meta[MODULE_META] = (name, key, path, getattr(cls, "__name__", str(cls)))
        yield
    finally:
        for n in gm.graph.nodes:
            n.meta = saved[n]
