"""Inputs and parameters for a fake step: real, fake or meta tensors in, fake tensors of one mode out.

A user describes a batch too big to build with shapes alone (``fake_inputs`` / meta tensors) and a
model too big to build on the meta device; both are turned into fake tensors of the profiler's own
FakeTensorMode on one device, the device of the real parts (never a hard-coded one). Real input
tensors keep their values as shadows, which the tracker uses for data-dependent sizes.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..torch_private import FakeTensor, FakeTensorMode, tree_flatten, tree_map

Shape = Union[int, Sequence[int]]


def shapes_only(shape: Shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor with a shape and a dtype and no data (meta device): any size costs nothing to build."""
    if isinstance(shape, int):
        shape = (shape,)
    return torch.empty(tuple(int(s) for s in shape), dtype=dtype, device="meta")


def fake_inputs(**specs: Tuple[Shape, torch.dtype]) -> Dict[str, torch.Tensor]:
    """Keyword inputs from shapes: ``fake_inputs(input_ids=((B, S), torch.long), labels=((B, S), torch.long))``.

    Data-dependent sizes (fxtrain's padding and label passes select rows with ``nonzero``) are costed
    at their maximum for such inputs; pass real tensors to cost the real densities.
    """
    out = {}
    for name, spec in specs.items():
        if isinstance(spec, torch.Tensor):
            out[name] = shapes_only(spec.shape, spec.dtype)
            continue
        shape, dtype = spec
        out[name] = shapes_only(shape, dtype)
    return out


def target_device(model: torch.nn.Module, values: Any, default: Optional[torch.device] = None) -> torch.device:
    """The device of the real (or fake) tensors; if everything is on meta, ``default`` (the device a
    session already costs for: its later shapes-only batches, ``max_batch``'s probes) or torch's.

    Fake tensors on the meta device itself are not an option: some ops' autograd is registered per
    backend and would not be differentiated there (nll_loss is one), silently losing backward work.
    """
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) + tree_flatten(values)[0]
               if isinstance(t, torch.Tensor)]
    devices = {t.device for t in tensors if t.device.type != "meta"}
    if len(devices) > 1:
        raise ValueError(f"fxtrain.profile: model and inputs span several devices {sorted(map(str, devices))}")
    return devices.pop() if devices else (default or torch.get_default_device())


def to_fake(t: torch.Tensor, mode: FakeTensorMode, device: torch.device) -> torch.Tensor:
    """A fake tensor of ``mode`` with ``t``'s shape, strides and dtype, on ``device``."""
    with mode:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)


def fake_values(values: Any, mode: FakeTensorMode, device: torch.device) -> Tuple[Any, List[Tuple[torch.Tensor, torch.Tensor]]]:
    """(values with every tensor faked, [(fake, real)] for the real ones: their shadows)."""
    pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def convert(t: torch.Tensor) -> torch.Tensor:
        fake = to_fake(t, mode, device).requires_grad_(t.requires_grad)
        if not isinstance(t, FakeTensor) and t.device.type != "meta":
            pairs.append((fake, t))
        return fake

    return tree_map(lambda x: convert(x) if isinstance(x, torch.Tensor) else x, values), pairs


def batch_size(values: Any) -> Optional[int]:
    """The most common leading size among tensor inputs of rank >= 1: what the batch axis is."""
    sizes = Counter(int(t.shape[0]) for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor) and t.dim() >= 1)
    return sizes.most_common(1)[0][0] if sizes else None


def with_batch(values: Any, old: int, new: int) -> Any:
    """Shapes-only copies of ``values`` whose leading axis of size ``old`` becomes ``new``."""
    def scale(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        shape = list(t.shape)
        if shape and shape[0] == old:
            shape[0] = new
        out = shapes_only(shape, t.dtype)
        return out.requires_grad_(True) if t.requires_grad else out
    return tree_map(scale, values)
