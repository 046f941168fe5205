"""Present a wrapped module's ``forward`` signature and docstring on the wrapper.

Tools decide what to pass a model by reading ``inspect.signature(model.forward)``: HF ``Trainer``
keeps only the dataset columns it names (``remove_unused_columns=True``, the default), finds the label
names in ``inspect.signature(type(model).forward)`` (so it reports ``eval_loss``), and decides from a
``**kwargs`` whether the model takes ``num_items_in_batch``. A wrapper whose forward is
``(*args, **kwargs)`` names nothing, so those tools drop every column and find no labels. Trainer reads
the *class* attribute, so a per-instance attribute is not enough: each wrapper instance gets a
subclass of its class (one per distinct signature, cached) whose ``forward`` is a copy of the
wrapper's own function carrying the wrapped module's ``__signature__`` and ``__doc__``. The call runs
the very same code object, so hooks, ``nn.Module.__call__``, DDP and ``torch.compile`` see no
difference; the class name says what is wrapped (``TrainModule[BertForMaskedLM]``), which is also
what Trainer matches ``QuestionAnswering`` against to find ``start_positions``.

No ``__wrapped__`` is set: ``inspect.unwrap`` users (accelerate's fp32 unwrapping walks it) would then
call the wrapped module's forward directly, around the capture. Copies and pickles reduce to the base
class (the generated one cannot be imported by name), whose ``__setstate__`` presents again.
"""
from __future__ import annotations

import copyreg
import inspect
import threading
import types
from typing import Any, Callable, Dict, Optional, Tuple

_classes: Dict[Tuple[Any, ...], type] = {}
_lock = threading.Lock()


def forward_signature(module: Any) -> Optional[inspect.Signature]:
    """What ``inspect.signature(module.forward)`` says (without ``self``), or None where it cannot say."""
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError, AttributeError):
        return None


def present(instance: Any, base: type, signature: Optional[inspect.Signature], doc: Optional[str], about: str) -> None:
    """Give ``instance`` (of class ``base``, which defines ``forward``) a class whose ``forward``
    presents ``signature`` and ``doc``. ``about`` names what is wrapped, for the class name. A
    signature that cannot be had (a builtin) leaves the instance as it is."""
    if signature is None or type(instance) is not base:
        return   # a user's subclass of the wrapper keeps its own class and forward
    instance.__class__ = _presenting_class(base, signature, doc, about)


def _presenting_class(base: type, signature: inspect.Signature, doc: Optional[str], about: str) -> type:
    key = (base, about, str(signature), doc)
    with _lock:
        cls = _classes.get(key)
        if cls is None:
            name = f"{base.__name__}[{about}]"
            forward = _copy_function(base.__dict__["forward"], f"{name}.forward")
            this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
            forward.__signature__ = signature.replace(parameters=[this, *signature.parameters.values()])
            forward.__doc__ = doc
            cls = type(base)(name, (base,), {"forward": forward, "__module__": base.__module__,
                                              "__qualname__": name, "__doc__": base.__doc__,
                                              "__reduce_ex__": _reduce_as(base)})
            _classes[key] = cls
        return cls


def _reduce_as(base: type) -> Callable[[Any, int], Any]:
    def __reduce_ex__(self: Any, protocol: int) -> Any:
        rv = base.__reduce_ex__(self, protocol)
        if isinstance(rv, tuple) and len(rv) >= 2 and rv[1] and rv[1][0] is type(self):
            # pickle insists that copyreg.__newobj__ makes the object's own class: make the base's
            make = _new if rv[0] is copyreg.__newobj__ else rv[0]
            rv = (make, (base, *rv[1][1:]), *rv[2:])
        return rv
    return __reduce_ex__


def _new(cls: type, *args: Any) -> Any:
    return cls.__new__(cls, *args)


def _copy_function(fn: Callable[..., Any], qualname: str) -> types.FunctionType:
    """The same code, globals, defaults and closure under another function object, so metadata set on
    it does not reach ``fn`` (which every other instance shares)."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = qualname
    copy.__module__ = fn.__module__
    copy.__dict__.update(fn.__dict__)
    return copy
