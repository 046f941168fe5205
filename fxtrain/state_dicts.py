"""State dicts of wrappers: the wrapped module's keys, with tied entries saveable by safetensors.

HF ``Trainer`` saves a model that is not a ``PreTrainedModel`` (any wrapper: ``TrainModule``,
``ModuleWithLoss``) with ``safetensors.torch.save_file(model.state_dict())``, and safetensors refuses
entries that share memory, which every model with tied weights (BERT's decoder and word embeddings,
GPT-2's ``lm_head`` and ``wte``) has: the first checkpoint (step 500 with Trainer's defaults) fails.
``save_pretrained`` avoids it by dropping the tied keys, but a wrapper's state dict must keep the
wrapped module's keys (checkpoints load into the bare module with ``strict=True``). So the second and
later entries over one storage are copies: the keys and values are the wrapped module's, loading
them writes the same value twice, and only those entries stop aliasing the parameter (an in-place
write to them no longer reaches the model; ``keep_vars=True`` returns the parameters themselves).
"""
from __future__ import annotations

from typing import Any, Collection, Dict, Set, Tuple

import torch


def unshared(state: Dict[str, Any], skip: Collection[str] = ()) -> Dict[str, Any]:
    """Copy, in place in ``state``, each tensor entry (not in ``skip``: entries another module put
    in a shared ``destination``) whose memory an earlier entry already covers."""
    seen: Set[Tuple[Any, ...]] = set()
    for key, value in state.items():
        if key in skip or not isinstance(value, torch.Tensor) or value.device.type == "meta":
            continue
        try:
            storage = value.untyped_storage()
        except (RuntimeError, NotImplementedError):   # tensor subclasses without a storage
            continue
        where = (value.device, storage.data_ptr(), storage.nbytes())
        if where[1] == 0:
            continue
        if where in seen:
            state[key] = value.clone()
        else:
            seen.add(where)
    return state


def wrapped_state_dict(module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``module.state_dict(*args, **kwargs)`` with tied entries copied (see the module docstring)."""
    names = ("destination", "prefix", "keep_vars")
    given = dict(zip(names, args), **kwargs)
    destination = given.get("destination")
    skip = set(destination) if destination is not None else ()
    state = module.state_dict(*args, **kwargs)
    return state if given.get("keep_vars") else unshared(state, skip)
