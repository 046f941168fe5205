"""``fxtrain.profile(model, *args, **kwargs)``: cost a training step on fake tensors."""
from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Any, Dict, Optional, Tuple, Union

import torch

from ..options import Options
from .inputs import batch_size
from .report import ProfileReport, build_report
from .session import Session
from ..cost.step import OptimizerSpec, optimizer_name

logger = logging.getLogger("fxtrain")

# Capturing is the slow part: a model profiled again (another batch, other inputs of the same
# structure) with equal options reuses its session, hence its graphs. A session holds its model
# (and a TrainModule of it), so a cache keyed weakly by the model would keep every profiled model
# alive for good; instead the sessions of the last few models profiled are kept, and an older
# model is let go (profiling it again captures again).
MAX_MODELS_KEPT = 4
_sessions: "OrderedDict[int, Tuple[torch.nn.Module, Dict[Tuple[Any, ...], Session]]]" = OrderedDict()


def _session_for(model: torch.nn.Module, optimizer: OptimizerSpec, optimizations: Union[bool, str],
                 options: Optional[Options], reuse: bool) -> Session:
    if not reuse:
        return Session(model, optimizer, optimizations, options)
    entry = _sessions.pop(id(model), None)
    if entry is None or entry[0] is not model:
        entry = (model, {})
    _sessions[id(model)] = entry            # most recent last
    while len(_sessions) > MAX_MODELS_KEPT:
        _sessions.popitem(last=False)
    per_model = entry[1]
    # Options compare by value: a new but equal Options() (or none: the defaults) must not capture again.
    key = (optimizations, dataclasses.astuple(options or Options()))
    if key not in per_model:
        per_model[key] = Session(model, optimizer, optimizations, options)
    session = per_model[key]
    session.use_optimizer(optimizer)
    return session


def profile(model: torch.nn.Module, *args: Any, optimizer: OptimizerSpec = None, optimizations: Union[bool, str] = True,
            options: Optional[Options] = None, reuse: bool = True, keep_outputs: bool = True,
            **kwargs: Any) -> ProfileReport:
    """Cost one training step of ``model(*args, **kwargs)`` without running it.

    The step (forward, ``backward()`` of the loss, ``optimizer.step()``, ``zero_grad``) runs on fake
    tensors: shapes and dtypes only, so any batch size costs the same few seconds and no memory.
    ``model`` and the inputs may be real, fake or on the meta device (``fake_inputs`` builds inputs
    from shapes). ``optimizations=True`` costs what ``fxtrain.TrainModule`` runs (its capture and
    passes, decided on the inputs' values where they are real); ``False`` costs eager PyTorch;
    ``"all"`` keeps every pass the batch calls for, also those whose kernel launches cost more
    than they save on an accelerator (cost/launches.py), which TrainModule turns off there: the
    step's FLOPs if time followed FLOPs (``fxtrain bench``'s FLOP-ideal ratio).
    ``optimizer``: a ``torch.optim.Optimizer`` class or instance (or "adamw", "sgd", ...); its
    state is costed as it exists in steady state. Later calls on the same model with equal
    ``options`` reuse its captured graphs; ``reuse=False`` forces a fresh capture.
    ``keep_outputs``: the loop costed. True (default) holds the outputs through the backward
    (``out = model(**b); out.loss.backward()``); False drops everything but the loss before it
    (``loss = model(**b).loss; loss.backward()``, HF Trainer's loop), which peaks lower by what the
    outputs hold alone (an LM's logits). It does not change the capture: both loops are costed
    with the same graphs, so switching reuses the session.
    """
    from ..module import TrainModule
    if optimizations not in (True, False, "all"):
        raise ValueError(f"fxtrain.profile: optimizations takes True, False or 'all', got {optimizations!r}")
    if isinstance(model, TrainModule):   # cost the module it wraps, as fxtrain would capture it
        model = model.module
    session = _session_for(model, optimizer, optimizations, options, reuse)
    cost = session.run(args, kwargs, keep_outputs=keep_outputs)
    return build_report(session, cost, type(model).__name__, batch_size((args, kwargs)), optimizer_name(optimizer))
