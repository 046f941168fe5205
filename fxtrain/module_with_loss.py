"""ModuleWithLoss: bring a loss computed in the training loop into the captured graph.

Loss-side rewrites (label sparsity) can only see a loss that is inside the graph. Many training
loops call ``model(**inputs)`` and compute the loss afterwards, so the loss and the logits it reads
live outside any capture. Wrapping model and loss together puts both in one graph.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

from torch import nn

from .signature import forward_signature, present
from .state_dicts import wrapped_state_dict


class ModuleWithLoss(nn.Module):
    """``model`` followed by ``loss_fn(outputs, *targets)``, as one module to wrap in TrainModule.

    The keyword arguments named in ``target_keys`` (default ``("labels",)``) are taken out of the
    call and given to ``loss_fn`` instead of the model. When the model returns a transformers
    ``ModelOutput`` the result is that output with ``loss`` set (what HF ``Trainer`` reads);
    otherwise it is ``(loss, outputs)``. Parameters and state-dict names are the model's own.
    ``forward`` presents the model's signature with the target keys as required keyword-only
    parameters (HF ``Trainer`` keeps the dataset columns and finds the label names it names).
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[..., Any], target_keys: Sequence[str] = ("labels",)) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"fxtrain.ModuleWithLoss wraps a torch.nn.Module, got {type(model).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self.model = model
        self.loss_fn = loss_fn
        self.target_keys = tuple(target_keys)
        self._present()

    def _present(self) -> None:
        model = self._modules["model"]
        doc = getattr(model.forward, "__doc__", None)
        note = (f"fxtrain.ModuleWithLoss: {', '.join(self.target_keys)} go(es) to the loss function, not to "
                f"{type(model).__name__}.forward, whose documentation follows.")
        present(self, ModuleWithLoss, _with_targets(forward_signature(model), self.target_keys),
                f"{note}\n\n{doc}" if doc else note, type(model).__name__)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self._present()   # copies reduce to ModuleWithLoss itself (fxtrain/signature.py)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        missing = [k for k in self.target_keys if k not in kwargs]
        if missing:
            raise TypeError(f"fxtrain.ModuleWithLoss: missing target keyword argument(s) {missing} "
                            f"(target_keys={list(self.target_keys)})")
        targets = [kwargs.pop(k) for k in self.target_keys]
        outputs = self.model(*args, **kwargs)
        loss = self.loss_fn(outputs, *targets)
        if any(c.__name__ == "ModelOutput" for c in type(outputs).__mro__):
            outputs["loss"] = loss
            return outputs
        return loss, outputs

    # Names are the model's own, so checkpoints load into the bare model (as with TrainModule).
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return wrapped_state_dict(self.model, args, kwargs)   # tied entries copied: fxtrain/state_dicts.py

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        return self.model.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[Tuple[str, Any]]:
        return self.model.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)


def _with_targets(signature: Optional[inspect.Signature], targets: Sequence[str]) -> Optional[inspect.Signature]:
    """The model's parameters, then the targets as keyword-only parameters without a default (the
    call takes them only by keyword and requires them), before a ``**kwargs``."""
    if signature is None:
        return None
    kept = [p for p in signature.parameters.values() if p.name not in targets]
    var_kw = [p for p in kept if p.kind is inspect.Parameter.VAR_KEYWORD]
    kept = [p for p in kept if p.kind is not inspect.Parameter.VAR_KEYWORD]
    added = [inspect.Parameter(t, inspect.Parameter.KEYWORD_ONLY) for t in targets]
    try:
        return signature.replace(parameters=kept + added + var_kw)
    except ValueError:   # a target named like a positional-only parameter: nothing truthful to show
        return None
