"""The training step the profiler costs and the measurement checks, defined once.

A step is one of two loops, which differ only in when the model's outputs are released
(``keep_outputs``)::

    # keep_outputs=True (default)            # keep_outputs=False (HF Trainer, Lightning)
    out = model(*args, **kwargs)             loss = loss_of(model(*args, **kwargs))
    loss_of(out).backward()                  loss.backward()    # only the loss outlived the forward
    del out
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

in steady state: the optimizer state exists before the step, gradients do not. The loops cost the
same FLOPs; their peaks differ by what the outputs hold alone through the backward (an LM's logits:
batch x sequence x vocabulary floats). Dropping the outputs frees nothing autograd saved for the
backward: those tensors stay alive either way.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from .. import torch_private as tp

OptimizerSpec = Union[None, str, type, torch.optim.Optimizer, Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]]

_BY_NAME: Dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad, "rmsprop": torch.optim.RMSprop,
}


def find_loss(out: Any) -> Optional[torch.Tensor]:
    """fxtrain's one rule for the loss in a model's output (the profiler, the pipeline planner and
    the fuzzer read it alike): ``out.loss`` / ``out["loss"]`` (HF outputs), else the output itself
    or its first element (nested); None when that is no tensor."""
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None:
        loss = out
        while isinstance(loss, (tuple, list)) and loss:
            loss = loss[0]
    return loss if isinstance(loss, torch.Tensor) else None


def loss_of(out: Any) -> torch.Tensor:
    """The tensor a training loop calls ``backward()`` on (``find_loss``); a non-scalar tensor is
    summed, which is what ``backward()`` with a gradient of ones computes."""
    loss = find_loss(out)
    if loss is None:
        raise TypeError(f"fxtrain.profile: cannot find a loss in the model's output of type {type(out).__name__}; "
                        f"return a tensor, a tuple starting with one, or an object with a .loss")
    return loss if loss.dim() == 0 else loss.sum()


def held_by_outputs(out: Any, loss: torch.Tensor) -> List[torch.Tensor]:
    """The tensors a loop holding ``out`` keeps alive, other than ``loss`` (which both loops keep).

    Walks tuples, lists, dicts (HF ``ModelOutput``) and plain objects (HF caches) in the output.
    A deferred output of fxtrain (``runtime/deferred.py``) is not read, which would compute it:
    what it holds is what its pending computation keeps (the tensors it will be computed from),
    or its values once something computed them.
    """
    from ..runtime.deferred import DeferredTensor
    skip = {id(loss)}
    found: List[torch.Tensor] = []
    seen: set = set()
    stack: List[Tuple[Any, int]] = [(out, 0)]
    while stack:
        value, depth = stack.pop()
        if id(value) in seen or depth > 8 or isinstance(value, (str, bytes, int, float, bool, type(None))):
            continue
        seen.add(id(value))
        if isinstance(value, DeferredTensor):
            pending = value._pending
            held = pending.values if pending.values is not None else pending.inputs
            stack.extend((t, depth + 1) for t in held)
        elif isinstance(value, torch.Tensor):
            if id(value) not in skip:
                found.append(value)
        elif isinstance(value, (tuple, list)):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, torch.nn.Module):
            continue   # a module returned by the model holds parameters, not outputs
        elif hasattr(value, "__dict__"):
            stack.extend((v, depth + 1) for v in vars(value).values())
    return found


def optimizer_name(spec: OptimizerSpec) -> Optional[str]:
    """How reports name an optimizer spec (None: no optimizer)."""
    if spec is None or isinstance(spec, str):
        return spec.lower() if spec is not None else None
    if isinstance(spec, torch.optim.Optimizer):
        return type(spec).__name__
    return getattr(spec, "__name__", type(spec).__name__)


def optimizer_factory(spec: OptimizerSpec) -> Optional[Callable[[Any], torch.optim.Optimizer]]:
    """How to build the optimizer for a set of parameters (ours are fake copies of the user's).

    An optimizer instance is rebuilt with its class and each group's hyper-parameters, so the
    costed state is what that instance would allocate.
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        try:
            return _BY_NAME[spec.lower()]
        except KeyError:
            raise ValueError(f"unknown optimizer {spec!r}; known: {', '.join(sorted(_BY_NAME))}") from None
    if isinstance(spec, torch.optim.Optimizer):
        return lambda params: _rebuild(spec, params)
    if callable(spec):
        return spec
    raise TypeError(f"optimizer must be a torch.optim.Optimizer class or instance, got {type(spec).__name__}")


def _rebuild(opt: torch.optim.Optimizer, params: Any) -> torch.optim.Optimizer:
    """Same class and per-group hyper-parameters as ``opt``, over ``params`` (a {old param: new} map)."""
    mapping = params if isinstance(params, dict) else None
    if mapping is None:
        return type(opt)(params, **opt.defaults)
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [mapping[p] for p in g["params"] if p in mapping]} for g in opt.param_groups]
    return type(opt)(groups, **opt.defaults)


def optimizer_over(spec: OptimizerSpec, params: List[torch.Tensor],
                   mapping: Optional[Dict[Any, Any]] = None) -> Optional[torch.optim.Optimizer]:
    """The optimizer ``spec`` names, over ``params`` (fake copies of the user's); an instance is
    rebuilt group by group through ``mapping`` ({user's parameter: copy}) when given."""
    if spec is None or not params:
        return None
    if isinstance(spec, torch.optim.Optimizer):
        return _implementation_of_real_parameters(_rebuild(spec, mapping if mapping is not None else params))
    factory = optimizer_factory(spec)
    assert factory is not None
    return _implementation_of_real_parameters(factory(params))


def _implementation_of_real_parameters(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Each group that leaves ``foreach`` to torch gets the choice torch makes for real parameters.

    Torch picks the multi-tensor step for plain parameters on the devices with foreach kernels (a
    GPU) and never for fake tensors (their type is not a plain tensor's), so over fake copies the
    costed step would loop tensor by tensor where the user's runs foreach, whose temporaries are
    larger: 7% of a BERT-tiny step's peak when a CPU run was made to choose as a GPU does. On the CPU
    both choose the loop, as before."""
    devices = set(tp.foreach_kernel_devices())
    for group in optimizer.param_groups:
        if ("foreach" in group and group["foreach"] is None and not group.get("fused")
                and not group.get("differentiable")):
            group["foreach"] = all(p.device.type in devices for p in group["params"])
    return optimizer


def warm_optimizer_state(optimizer: Optional[torch.optim.Optimizer], params: List[torch.Tensor]) -> None:
    """The steady-state optimizer state: one step on stand-in gradients of ``params``.

    The step runs with the multi-tensor (foreach) implementation where the optimizer has one: it
    allocates the same state as the per-tensor loop in a few dozen fake ops instead of thousands.
    Measured steps run the implementation the optimizer would choose itself.
    """
    if optimizer is None:
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    groups = [g for g in optimizer.param_groups if "foreach" in g and not g.get("fused")]
    saved = [g["foreach"] for g in groups]
    for g in groups:
        g["foreach"] = True
    try:
        optimizer.step()
    finally:
        for g, value in zip(groups, saved):
            g["foreach"] = value
    optimizer.zero_grad(set_to_none=True)


def make_optimizer(spec: OptimizerSpec, model: torch.nn.Module) -> Optional[torch.optim.Optimizer]:
    """The optimizer a real step uses: the instance itself, or one built over ``model``'s parameters."""
    if isinstance(spec, torch.optim.Optimizer):
        return spec
    return optimizer_over(spec, [p for p in model.parameters() if p.requires_grad])
