"""Inspect a call's inputs: reject what cannot work with a clear message, and summarise the schema.

The schema (structure, dtypes, ranks, requires_grad, exact scalar types) tells TrainModule whether a
call may trigger a capture, so that only those calls pay for the safety net of the eager fallback.
"""
from __future__ import annotations

from typing import Any, Hashable, List, Optional, Tuple

import torch

_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def _is_numpy(x: Any) -> bool:
    return type(x).__module__ == "numpy" and type(x).__name__ in ("ndarray", "matrix")


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
    if _is_numpy(value):
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


def call_sizes(args: Tuple[Any, ...], kwargs: dict) -> Hashable:
    """Every tensor of a call as (path, size), in order: what a static capture is specialised to."""
    sizes = []
    stack = [(f"kwargs[{k!r}]", v) for k, v in reversed(list(kwargs.items()))]
    stack += [(f"args[{i}]", a) for i, a in reversed(list(enumerate(args)))]
    while stack:
        path, value = stack.pop()
        if isinstance(value, torch.Tensor):
            sizes.append((path, tuple(value.shape)))
        elif isinstance(value, dict):
            stack.extend((f"{path}[{k!r}]", v) for k, v in reversed(list(value.items())))
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return tuple(sizes)


def size_change(first: Hashable, now: Hashable) -> str:
    """The first tensor whose size differs between two ``call_sizes``, for a person to read."""
    for (path, a), (_, b) in zip(first, now):
        if a != b:
            return f"{path} {list(a)} -> {list(b)}"
    return "sizes changed"


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
