"""Arguments and results of ``apply`` as trees of ``(kind, payload)`` nodes (kinds in registry.py).

A custom op passes tensors only, but ``apply`` takes and returns whatever Python allows: keyword
arguments, lists built in the traced code, Python numbers computed from data (``x.item() * 2``), a
list or a dataclass holding tensors, an input returned after an in-place update. Each is described
once, at capture, from what the Function really returned (or what dynamo's trace of its forward,
or its ``infer_shape``, says it returns), and then:

- ``rebuild_argument`` (registry.py, which CallSpec needs it in) makes the arguments for each real
  call (fresh containers every call, as the traced code makes them every call);
- ``collect`` walks what the real call returned and fills the op's outputs in order: tensors, and
  Python numbers as 0-d tensors (the graph reads them back with ``.item()``, so they are the values
  of this call, never constants of the capturing one); a call whose result no longer fits the
  description raises, naming the Function, instead of returning something else than eager would;
- ``build`` runs inside dynamo's trace and makes, from the op's outputs, the objects the model's
  code receives: the same containers, the same Python types, the very input objects where eager
  hands an input back.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import Error
from .registry import (CONSTANT, DATACLASS, DETACHED, DICT, INPUT, LIST, NAMEDTUPLE, SCALAR, SCALAR_DTYPES,
                       TENSOR, TUPLE, Node, OutputMeta, rebuild_argument)


class Unrepresentable(Error):
    """A value the op pair cannot carry from one call to the model's code (a str, an arbitrary object)."""


def scalar_type(value: Any) -> Optional[type]:
    """The Python type a scalar output travels as, or None if it is not a number.

    bool before int (bool is an int); a numpy float64 is a float and comes back as one."""
    if isinstance(value, bool):
        return bool
    if isinstance(value, int):
        return int
    if isinstance(value, float):
        return float
    return None


def is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and type(value) is not tuple and hasattr(type(value), "_fields")


def is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def dataclass_attributes(value: Any) -> List[str]:
    """The attributes a dataclass instance carries: rebuilt one by one on a new instance, not
    through ``__init__`` (its ``__post_init__`` ran in the user's forward already)."""
    try:
        return list(vars(value))
    except TypeError:
        raise Unrepresentable(f"a {type(value).__name__} with __slots__") from None


# ------------------------------------------------------------------------------ run time
def rebuild_call(args: List[Node], kwargs: Dict[str, Node],
                 tensors: Sequence[torch.Tensor]) -> Tuple[List[Any], Dict[str, Any], List[Any]]:
    containers: List[Any] = []
    pos = [rebuild_argument(n, tensors, containers) for n in args]
    kw = {k: rebuild_argument(n, tensors, containers) for k, n in kwargs.items()}
    return pos, kw, containers


class Mismatch(Error, RuntimeError):
    pass


def collect(node: Node, value: Any, outs: List[Any], call_inputs: Sequence[torch.Tensor]) -> None:
    """Fill ``outs`` (the op's outputs, by index) from ``value``, what a real call produced where
    the capture saw ``node``. Raises Mismatch when the call's result has another structure."""
    kind, payload = node
    if kind in (TENSOR, DETACHED):
        if not isinstance(value, torch.Tensor):
            raise Mismatch(f"a {type(value).__name__} where the capturing call returned a tensor")
        if outs[payload] is None:
            outs[payload] = value
        return
    if kind == SCALAR:
        index, pytype = payload
        if scalar_type(value) is not pytype:
            raise Mismatch(f"a {type(value).__name__} where the capturing call returned a {pytype.__name__}")
        outs[index] = torch.scalar_tensor(value, dtype=SCALAR_DTYPES[pytype])
        return
    if kind == INPUT:
        if value is not call_inputs[payload]:
            raise Mismatch("another object where the capturing call returned one of its inputs")
        return
    if kind == CONSTANT:
        if payload is None and value is not None:
            raise Mismatch(f"a {type(value).__name__} where the capturing call returned None")
        return
    if kind in (TUPLE, LIST):
        if type(value) is not (tuple if kind == TUPLE else list) or len(value) != len(payload):
            raise Mismatch(f"a {type(value).__name__} of {len(value) if hasattr(value, '__len__') else '?'} "
                           f"where the capturing call returned a {kind} of {len(payload)}")
        for c, v in zip(payload, value):
            collect(c, v, outs, call_inputs)
        return
    if kind == DICT:
        if type(value) is not dict or list(value) != [k for k, _ in payload]:
            raise Mismatch("a dict with other keys than the capturing call's")
        for k, c in payload:
            collect(c, value[k], outs, call_inputs)
        return
    if kind in (NAMEDTUPLE, DATACLASS):
        key, children = payload
        cls = CLASSES[key]
        if type(value) is not cls:
            raise Mismatch(f"a {type(value).__name__} where the capturing call returned a {cls.__name__}")
        pairs = zip(children, value) if kind == NAMEDTUPLE else ((c, getattr(value, name)) for name, c in children)
        for c, v in pairs:
            collect(c, v, outs, call_inputs)
        return
    raise AssertionError(f"result node {kind}")


# ------------------------------------------------------------------- traced by dynamo
#: Classes of the named tuples and dataclasses the Functions return, by a key their nodes hold: the
#: graph's output must be rebuilt from a class dynamo can name (a global of this module), since an
#: object of a class it only got from a closure, without a source, cannot leave the compiled region.
CLASSES: Dict[int, type] = {}


def class_key(cls: type) -> int:
    CLASSES[id(cls)] = cls   # kept alive here, so the id stays this class's
    return id(cls)


def build(node: Node, outs: Sequence[Any], tensors: Sequence[Any]) -> Any:
    """The object the model's code receives for ``node`` (dynamo traces this; payloads are constants)."""
    kind, payload = node
    if kind == TENSOR:
        return outs[payload]
    if kind == DETACHED:
        return outs[payload].detach()
    if kind == SCALAR:
        return outs[payload[0]].item()
    if kind == INPUT:
        return tensors[payload]
    if kind == CONSTANT:
        return payload
    if kind == TUPLE:
        return tuple([build(c, outs, tensors) for c in payload])
    if kind == LIST:
        return [build(c, outs, tensors) for c in payload]
    if kind == DICT:
        return {k: build(c, outs, tensors) for k, c in payload}
    if kind == NAMEDTUPLE:
        return CLASSES[payload[0]](*[build(c, outs, tensors) for c in payload[1]])
    if kind == DATACLASS:
        obj = object.__new__(CLASSES[payload[0]])
        for name, c in payload[1]:
            object.__setattr__(obj, name, build(c, outs, tensors))
        return obj
    raise AssertionError(f"result node {kind}")


# -------------------------------------------------------------------------- capture time
class Describer:
    """Turns one observed result (real tensors, fakes from infer_shape) into nodes, numbering the
    op's outputs and recording how the fake kernel shapes each."""

    def __init__(self, call_inputs: Sequence[Any], record: bool, real: bool, objects: bool = False) -> None:
        self.call_inputs = list(call_inputs)
        self.record = record
        self.real = real                      # sizes from a real run: fixed (the capture is guarded on them)
        # Keep what a graph cannot carry as constants, the very objects: for a spec that serves one
        # call only (the Python call that takes a capture's run, python_call.py).
        self.objects = objects
        self.meta: List[OutputMeta] = []
        self.dirty: Dict[int, int] = {}       # input index -> op output
        self.seen: Dict[int, Node] = {}       # id(tensor) -> its node, for identity
        self.tensors: List[Any] = []          # per op output: the observed tensor (or None for scalars)

    def _new(self, value: torch.Tensor) -> int:
        j = len(self.meta)
        if self.real:
            self.meta.append(OutputMeta(value.dtype, value.device, sizes=list(value.shape)))
        else:
            self.meta.append(OutputMeta(value.dtype, value.device, infer=j))
        self.tensors.append(value)
        return j

    def result(self, value: Any) -> Node:
        """apply's result: the tensors of a returned tuple are its differentiable outputs."""
        if type(value) is tuple:
            return (TUPLE, [self.leaf(v, top=True) for v in value])
        return self.leaf(value, top=True)

    def leaf(self, value: Any, top: bool) -> Node:
        if isinstance(value, torch.Tensor):
            known = self.seen.get(id(value))
            if known is not None:
                return known
            i = next((i for i, t in enumerate(self.call_inputs) if value is t), None)
            if i is not None:
                if top:
                    # apply hands an input back as itself only when forward marked it dirty.
                    if i not in self.dirty:
                        self.dirty[i] = self._new(value)
                node: Node = (INPUT, i)
            else:
                j = self._new(value)
                differentiable = top and self.record and (value.requires_grad if self.real else
                                                          (value.is_floating_point() or value.is_complex()))
                node = (TENSOR if differentiable else DETACHED, j)
            self.seen[id(value)] = node
            return node
        pytype = scalar_type(value)
        if pytype is not None:
            j = len(self.meta)
            self.meta.append(OutputMeta(SCALAR_DTYPES[pytype], torch.device("cpu"), sizes=[]))
            self.tensors.append(None)
            return (SCALAR, (j, pytype))
        if value is None:
            return (CONSTANT, None)
        return self.container(value)

    def container(self, value: Any) -> Node:
        if type(value) is tuple:
            return (TUPLE, [self.leaf(v, top=False) for v in value])
        if type(value) is list:
            return (LIST, [self.leaf(v, top=False) for v in value])
        if type(value) is dict:
            if not all(type(k) in (str, int) for k in value):
                if self.objects:
                    return (CONSTANT, value)
                raise Unrepresentable("a dict whose keys are not str or int")
            return (DICT, [(k, self.leaf(v, top=False)) for k, v in value.items()])
        if is_namedtuple(value):
            return (NAMEDTUPLE, (class_key(type(value)), [self.leaf(v, top=False) for v in value]))
        if is_dataclass_instance(value):
            try:
                names = dataclass_attributes(value)
            except Unrepresentable:
                if self.objects:
                    return (CONSTANT, value)
                raise
            return (DATACLASS, (class_key(type(value)), [(n, self.leaf(getattr(value, n), top=False)) for n in names]))
        if self.objects:
            return (CONSTANT, value)
        raise Unrepresentable(f"a {type(value).__name__}")
