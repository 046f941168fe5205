"""What one captured ``Function.apply`` call needs at run time, keyed by an int the graph carries.

The graph holds only that key (a constant) and the tensor arguments; everything else lives here:
the Function class itself (identity is the class object, never its name, so two classes called
``Scale`` in different scopes cannot be confused), the non-tensor arguments with their exact Python
values and types (a float stays a 64-bit float), and objects passed by reference, which stay alive
as long as the registry entry, i.e. as long as the process may run the graph.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

TENSOR = "tensor"
DETACHED = "detached"   # a tensor output that is not differentiable
CONSTANT = "constant"


def qualified_name(fn_cls: type) -> str:
    """``module.__qualname__``, ``<locals>`` included: what capture_info().python_ops reports."""
    return f"{fn_cls.__module__}.{fn_cls.__qualname__}"


@dataclass
class CallSpec:
    fn_cls: type
    # One entry per positional argument of apply: (TENSOR, index into the tensor list) or (CONSTANT, value).
    template: List[Tuple[str, Any]]
    # Per output of apply: (TENSOR or DETACHED, index into the op's outputs) or (CONSTANT, value); `single` when
    # apply returned one object rather than a tuple.
    outputs: List[Tuple[str, Any]]
    single: bool
    differentiable: List[bool]          # per tensor input: may receive a gradient
    record: bool                        # capture happened with grad enabled: keep ctx for backward
    shape_fn: Callable[[Sequence[torch.Tensor]], List[torch.Tensor]]
    grad_meta: List[Tuple[int, torch.dtype, torch.device]]   # (rank, dtype, device) per differentiable input
    # Tensor outputs' (shape, dtype, device) when shaped by a real run: the only shapes the graph knows.
    seen: Optional[List[Tuple[torch.Size, torch.dtype, torch.device]]] = None
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = qualified_name(self.fn_cls)

    def arguments(self, tensors: Sequence[torch.Tensor]) -> List[Any]:
        return [tensors[v] if kind == TENSOR else v for kind, v in self.template]


_lock = threading.Lock()
_keys = itertools.count()
SPECS: Dict[int, CallSpec] = {}


def register(spec: CallSpec) -> int:
    with _lock:
        key = next(_keys)
        SPECS[key] = spec
    return key
