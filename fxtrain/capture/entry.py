"""A dynamo entry point of its own for every TrainModule.

Dynamo keeps its cache of captured graphs on the code object of the function it compiles. If all
TrainModules shared one entry function, two models (or two instances of one model class) would
evict each other and hit the recompile limit; copying the code object gives each its own cache.
"""
from __future__ import annotations

import itertools
import types
from typing import Any, Callable, ContextManager, Optional

from ..torch_private import dynamo_compile
from ..capture_state import ENTRY_NAME

_counter = itertools.count()


def _entry(module, args, kwargs):
    return module(*args, **kwargs)


def make_entry(backend: Callable[..., Any], dynamic: Optional[bool], fullgraph: bool,
               around_compile: Callable[[Optional[str]], ContextManager[Any]]) -> Callable[..., Any]:
    """``torch.compile`` of a fresh entry function; ``around_compile(code_name)`` is entered whenever
    dynamo compiles a frame for it (not on calls that hit its cache), with the frame's code name."""
    name = f"{ENTRY_NAME}_{next(_counter)}"
    code = _entry.__code__.replace(co_name=name, co_qualname=name)
    fn = types.FunctionType(code, _entry.__globals__, name)
    return dynamo_compile(fn, backend, dynamic, fullgraph, around_compile)
