"""What one captured ``Function.apply`` call needs at run time, keyed by an int the graph carries.

The graph holds only that key (a constant) and the tensor arguments; everything else lives here:
the Function class itself (identity is the class object, never its name, so two classes called
``Scale`` in different scopes cannot be confused), the non-tensor arguments with their exact Python
values and types (a float stays a 64-bit float), and objects passed by reference, which stay alive
as long as the registry entry, i.e. as long as the process may run the graph.

Arguments and results are described by small trees of ``(kind, payload)`` nodes (``structure.py``
builds, walks and rebuilds them), so that anything ``apply`` may take or return in eager (keyword
arguments, lists made in the traced code, Python numbers computed from data, lists and dataclasses
of tensors, an input updated in place) is rebuilt the same way on every call. Calls that need none
of that (positional tensors and constants in, tensors out) keep flat lists that the per-call code
reads without walking a tree.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..torch_private import is_fake

# Argument and result nodes.
TENSOR = "tensor"        # argument: op tensor i; result: op output j, differentiable
DETACHED = "detached"    # result: op output j, not differentiable (comes out detached, as in eager)
CONSTANT = "constant"    # a Python value: exact scalars by value, other objects by reference
SCALAR = "scalar"        # argument: a 0-d op tensor i read back as (int|float|bool); result: same, op output j
INPUT = "input"          # result: the op's tensor argument i itself (marked dirty, or handed back in a container)
LIST, TUPLE, DICT = "list", "tuple", "dict"
# argument: a tensor subclass the traced code made by calling its class, made again for every call
# from the call's own arguments: (the class, argument nodes, ((keyword, node), ...))
NEW = "new"
NAMEDTUPLE, DATACLASS = "namedtuple", "dataclass"

Node = Tuple[str, Any]

#: dtype a Python scalar travels in (exact for bool, int64 and float64 values).
SCALAR_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64}


def qualified_name(fn_cls: type) -> str:
    """``module.__qualname__``, ``<locals>`` included: what capture_info().python_ops reports."""
    return f"{fn_cls.__module__}.{fn_cls.__qualname__}"


@dataclass
class OutputMeta:
    """How the fake kernel makes op output j without running user code.

    ``fake``: a tensor whose metadata is the output's (dynamo's trace of ``forward``: symbolic
    sizes of the capture's shape environment); ``sizes``: per dimension, a constant or
    ``(i, d)``, dimension d of tensor input i, as a real run on the capturing call showed (checked
    on every call, ``CallSpec.checks``); ``infer``: recomputed by ``infer_shape`` per fake call."""

    dtype: torch.dtype
    device: torch.device
    fake: Optional[torch.Tensor] = None
    sizes: Optional[List[Any]] = None
    infer: Optional[int] = None


@dataclass
class CallSpec:
    fn_cls: type
    # Positional and keyword arguments of apply, as nodes over the op's tensor list.
    args: List[Node]
    kwargs: Dict[str, Node]
    # What apply returns, as one node (a TUPLE node when forward returned a tuple).
    result: Node
    differentiable: List[bool]          # per tensor input: may receive a gradient
    record: bool                        # capture happened with grad enabled: keep ctx for backward
    grad_meta: List[Tuple[int, torch.dtype, torch.device]]   # (rank, dtype, device) per differentiable input
    meta: List[OutputMeta]              # per op output (the handle excluded)
    # Inputs forward updates in place (ctx.mark_dirty): (tensor input i, op output j with its new value).
    dirty: List[Tuple[int, int]] = field(default_factory=list)
    # Lists and dicts made in the traced code that forward changes: (index among the call's
    # containers, node of their contents after the call), written back by the graph.
    writes: List[Tuple[int, Node]] = field(default_factory=list)
    # The infer_shape static method, when it is what shapes the outputs.
    infer: Optional[Callable[..., Any]] = None
    # How the outputs were shaped, for logs and capture_info ("infer_shape", "traced", "real run").
    shaped_by: str = ""
    # The real run of the capturing call, waiting for the graph's first run of this call (pending.py).
    pending: Any = None
    # Per op tensor: None for a tensor, or the dtype a Python number argument travels in (route.py).
    convert: List[Optional[torch.dtype]] = field(default_factory=list)
    name: str = field(init=False)
    # Fast path: positional tensors and constants in; a tensor or a flat tuple of tensor, detached
    # and constant results out. Then ``template``/``outputs``/``single`` are read instead of the trees.
    plain: bool = field(init=False)
    template: List[Node] = field(init=False)
    outputs: List[Node] = field(init=False)
    single: bool = field(init=False)
    dirty_inputs: frozenset = field(init=False)
    n_out: int = field(init=False)
    # Outputs shaped by a real run: (op output j, sizes, dtype), checked against every call's.
    checks: List[Tuple[int, List[Any], torch.dtype]] = field(init=False)
    # For the backward op's direct call of the Function's node (op.py): per output of forward, the op
    # output whose gradient it gets (None: a constant, whose gradient is None in eager too); and per
    # argument of apply, the op tensor it is (None: a constant). ``direct``: a plain recorded call
    # without non-differentiable outputs (whose gradient depends on ctx flags Python cannot read).
    grad_slots: List[Optional[int]] = field(init=False)
    arg_slots: List[Optional[int]] = field(init=False)
    output_positions: List[int] = field(init=False)    # per op output, its position among forward's
    direct: bool = field(init=False)

    def __post_init__(self) -> None:
        self.name = qualified_name(self.fn_cls)
        self.template = list(self.args)
        flat_args = not self.kwargs and all(k in (TENSOR, CONSTANT) for k, _ in self.args)
        kind, payload = self.result
        self.single = kind != TUPLE
        self.outputs = [self.result] if self.single else list(payload)
        flat_out = all(k in (TENSOR, DETACHED, CONSTANT) for k, _ in self.outputs)
        self.plain = flat_args and flat_out and not self.dirty and not self.writes
        self.dirty_inputs = frozenset(i for i, _ in self.dirty)
        self.n_out = len(self.meta)
        self.checks = [(j, m.sizes, m.dtype) for j, m in enumerate(self.meta) if m.sizes is not None and m.sizes]
        op_outputs = itertools.count()
        self.grad_slots = [None if kind == CONSTANT else next(op_outputs) for kind, _ in self.outputs]
        self.arg_slots = [v if kind == TENSOR else None for kind, v in self.template]
        self.output_positions = [p for p, j in enumerate(self.grad_slots) if j is not None]
        self.direct = self.plain and self.record and all(kind != DETACHED for kind, _ in self.outputs)

    def arguments(self, tensors: Sequence[torch.Tensor]) -> List[Any]:
        """The positional arguments of apply (what a Function's ``flops`` static method takes)."""
        if self.plain:
            return [tensors[v] if kind == TENSOR else v for kind, v in self.template]
        return [rebuild_argument(node, tensors, []) for node in self.args]


def rebuild_argument(node: Node, tensors: Sequence[torch.Tensor], containers: List[Any]) -> Any:
    """The argument ``node`` describes, for one call: lists and dicts the traced code builds are built
    afresh (``containers`` gets the top-level ones, whose contents the graph writes back)."""
    kind, payload = node
    if kind == TENSOR:
        return tensors[payload]
    if kind == CONSTANT:
        return payload
    if kind == SCALAR:
        index, pytype, hint = payload
        t = tensors[index]
        # Fake tensors (infer_shape, a profile's fake step) have no value: the capturing call's.
        return hint if is_fake(t) else pytype(t.item())
    if kind == TUPLE:
        return tuple([rebuild_argument(c, tensors, []) for c in payload])
    if kind == NEW:
        cls, args, kwargs = payload
        return cls(*[rebuild_argument(c, tensors, []) for c in args],
                   **{k: rebuild_argument(c, tensors, []) for k, c in kwargs})
    if kind == LIST:
        value = [rebuild_argument(c, tensors, []) for c in payload]
    elif kind == DICT:
        value = {k: rebuild_argument(c, tensors, []) for k, c in payload}
    else:
        raise AssertionError(f"argument node {kind}")
    containers.append(value)
    return value


_lock = threading.Lock()
_keys = itertools.count()
SPECS: Dict[int, CallSpec] = {}


def register(spec: CallSpec) -> int:
    with _lock:
        key = next(_keys)
        SPECS[key] = spec
    return key
