"""The inspector after capture: each call measures the densities the passes decided on.

A pass turns on or off from the capturing batch. Later batches may differ (another data mix, a
curriculum that grows sequences), and the user should be able to see whether the choice still pays
without re-profiling: ``capture_info().density`` holds the last batch's values and
``Options.log_density`` logs every batch at INFO.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Tuple

import torch

logger = logging.getLogger("fxtrain")


def with_density_probes(compiled: Callable[..., Any], probes: List[Tuple[str, int, int]],
                        density: Dict[str, float], log: bool) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        for what, index, absent in probes:
            x = args[index]
            if isinstance(x, torch.Tensor) and not x.is_floating_point():
                density[what] = float((x != absent).sum()) / max(x.numel(), 1)
        if log and probes:
            logger.info("batch density: %s", ", ".join(f"{k} {v:.3f}" for k, v in density.items()))
        return compiled(*args)

    return run
