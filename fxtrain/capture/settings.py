"""Dynamo settings fxtrain captures under: applied only while dynamo converts one of a TrainModule's frames
(TrainModule._compiling, via torch_private.dynamo_compile), never globally nor on calls that hit a capture."""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Set

from ..options import Options

# Logger methods, including those libraries attach to logging.Logger (transformers adds warning_once).
_LOG_METHODS = ("debug", "info", "warning", "warn", "error", "exception", "critical", "log",
                "warning_once", "info_once", "warning_advice")


def logging_functions() -> Set[Callable[..., Any]]:
    """Logging calls met during capture are dropped from the graph instead of breaking it.

    A warning that a library logs from inside ``forward`` (transformers' ``warning_once`` about the
    loss type, for one) would otherwise split the model into several graphs. The message is not
    emitted from captured code; eager runs (and the first, capturing, call's Python) still log.
    """
    return {getattr(logging.Logger, name) for name in _LOG_METHODS if hasattr(logging.Logger, name)}


def dynamo_settings(options: Options, specialize_float: bool = True) -> Dict[str, Any]:
    """``specialize_float=False`` once a float argument changed value (``capture/scalars.py``)."""
    return dict(
        recompile_limit=options.recompile_limit,
        # Past the limit dynamo would silently run eager; raising sends it through our fallback policy.
        fail_on_recompile_limit_hit=True,
        # Float scalars in model code (scales, eps) otherwise make dynamo restart its analysis once,
        # which doubles the first step's capture time. A module whose float arguments change value
        # captures with False from then on: the float becomes a graph input instead of a guard.
        specialize_float=specialize_float,
        ignore_logging_functions=logging_functions(),
        # Sparsity passes select rows with nonzero(): a size known only at run time, which the
        # shape environment must accept (and user code calling nonzero then stays in the graph).
        capture_dynamic_output_shape_ops=True,
    )
