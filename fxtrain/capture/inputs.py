"""Inspect a call's inputs: reject what cannot work with a clear message, and summarise the schema.

The schema (structure, dtypes, ranks, requires_grad, exact scalar types) tells TrainModule whether a
call may trigger a capture, so that only those calls pay for the safety net of the eager fallback.
"""
from __future__ import annotations

from typing import Any, FrozenSet, Hashable, Iterable, List, Optional, Sequence, Tuple

import torch


def _path(path: Any) -> str:
    """``path`` is built lazily, as (parent, key) pairs: only an error message reads it."""
    if isinstance(path, tuple):
        parent, key = path
        return f"{_path(parent)}[{key!r}]"
    return path


def schema(value: Any, path: Any, device: Optional[torch.device], shapes: Optional[List[Any]] = None) -> Hashable:
    """Hashable summary of one input; raises TypeError/ValueError for inputs that cannot work.
    ``shapes`` (if given) receives every tensor's size in order: the call's sizes, in the same walk."""
    if isinstance(value, torch.Tensor):
        if shapes is not None:
            shapes.append(value.shape)
        where = value.device
        if device is not None and where != device and value.dim() > 0:
            raise ValueError(
                f"fxtrain.TrainModule: input {_path(path)} is on device '{where}' but the module's "
                f"parameters are on '{device}'; move the input with .to('{device}') (or the module with .to()).")
        return ("T", value.dtype, value.dim(), value.requires_grad, where.type, value.layout)
    if type(value).__module__ == "numpy" and type(value).__name__ in ("ndarray", "matrix"):
        raise TypeError(f"fxtrain.TrainModule: input {_path(path)} is a numpy array; pass a torch.Tensor "
                        f"(torch.from_numpy(x).to(device)) instead.")
    if isinstance(value, (bool, str, bytes, type(None))):
        return (type(value), value)
    if isinstance(value, (int, float, complex)):
        return (type(value),)
    if isinstance(value, dict):
        return (type(value), tuple((k, schema(v, (path, k), device, shapes)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(schema(v, (path, i), device, shapes) for i, v in enumerate(value)))
    # Any other object (a cache, a config, an enum): dynamo guards on it itself.
    return (type(value), id(value))


def call_schema(args: Tuple[Any, ...], kwargs: dict, device: Optional[torch.device],
                shapes: Optional[List[Any]] = None) -> Hashable:
    return (tuple([schema(a, ("args", i), device, shapes) for i, a in enumerate(args)]),
            tuple([(k, schema(v, ("kwargs", k), device, shapes)) for k, v in kwargs.items()]))


def call_tensors(args: Tuple[Any, ...], kwargs: dict) -> List[Tuple[str, torch.Tensor]]:
    """Every tensor of a call as (path, tensor), in the order ``schema`` meets them (args, then
    kwargs; containers depth first), so that index ``i`` here is shape ``i`` of a ``call_schema`` walk."""
    found = []
    stack = [(f"kwargs[{k!r}]", v) for k, v in reversed(list(kwargs.items()))]
    stack += [(f"args[{i}]", a) for i, a in reversed(list(enumerate(args)))]
    while stack:
        path, value = stack.pop()
        if isinstance(value, torch.Tensor):
            found.append((path, value))
        elif isinstance(value, dict):
            stack.extend((f"{path}[{k!r}]", v) for k, v in reversed(list(value.items())))
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return found


def call_sizes(args: Tuple[Any, ...], kwargs: dict) -> Hashable:
    """Every tensor of a call as (path, size), in order: what a static capture is specialised to."""
    return tuple((path, tuple(t.shape)) for path, t in call_tensors(args, kwargs))


def changed_dims(first: Sequence[Sequence[int]], now: Sequence[Sequence[int]]) -> FrozenSet[Tuple[int, int]]:
    """(tensor index, dimension) of every size that differs between two calls of one schema."""
    return frozenset((i, d) for i, (a, b) in enumerate(zip(first, now)) for d, (m, n) in enumerate(zip(a, b))
                     if m != n)


def leading_dims(shapes: Sequence[Sequence[int]]) -> FrozenSet[Tuple[int, int]]:
    """(tensor index, 0) of every input with a dimension: the batch dimension, by convention."""
    return frozenset((i, 0) for i, shape in enumerate(shapes) if len(shape))


def describe_dims(dims: Iterable[Tuple[int, int]], paths: Sequence[Tuple[str, Any]],
                  first: Sequence[Sequence[int]], now: Sequence[Sequence[int]]) -> str:
    """``kwargs['x'] dim 0 (4 -> 3)``, for a person to read which sizes became symbolic
    (``(4)`` for a size this call did not change)."""
    return ", ".join(f"{paths[i][0]} dim {d} ({first[i][d]}{'' if first[i][d] == now[i][d] else f' -> {now[i][d]}'})"
                     for i, d in sorted(dims))


def first_tensor_device(args: Tuple[Any, ...], kwargs: dict) -> Optional[torch.device]:
    """The device of the first tensor among a call's inputs (depth first), or None."""
    stack = list(reversed(list(kwargs.values()))) + list(reversed(args))
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            return value.device
        if isinstance(value, dict):
            stack.extend(reversed(list(value.values())))
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
    return None


def autocast_state(device: Optional[torch.device], args: Tuple[Any, ...], kwargs: dict) -> Tuple[str, bool, Any]:
    """Autocast as the call will see it: enabled and dtype for the device the step runs on (the
    module's, else the inputs'). Autocast is per device type, so reading another type's state (a
    CUDA module under ``torch.autocast("cpu")``) would key the call on a context that changes nothing."""
    if device is None:
        device = first_tensor_device(args, kwargs)
    kind = device.type if device is not None else "cpu"
    try:
        return kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)
    except (RuntimeError, ValueError):  # a device type without autocast
        return kind, False, None
