"""The inspector after capture: each call measures the densities the passes decided on.

A pass turns on or off from the capturing batch. Later batches may differ (another data mix, a
curriculum that grows sequences), and the user should be able to see whether the choice still pays
without re-profiling: ``capture_info().density`` holds the last batch's values and
``Options.log_density`` logs every batch at INFO.

Each call only counts on the device; the count becomes a number when someone reads it. Converting
it per call would cost a device-to-host synchronisation per probe and step on a GPU.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, List, Tuple

import torch

from .info import Densities

logger = logging.getLogger("fxtrain")


def with_density_probes(compiled: Callable[..., Any], probes: List[Tuple[str, int, int]],
                        density: Densities, log: bool) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        for what, index, absent in probes:
            x = args[index]
            if isinstance(x, torch.Tensor) and not x.is_floating_point():
                density.record(what, (x != absent).sum(), x.numel())
        if log and probes:
            logger.info("batch density: %s", ", ".join(f"{k} {v:.3f}" for k, v in density.items()))
        return compiled(*args)

    return run
