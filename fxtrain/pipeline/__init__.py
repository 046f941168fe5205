"""Pipeline parallelism: split a captured graph into stages and train them on torch.distributed."""
from typing import Any

from .costs import CostFn, node_flops, node_params
from .errors import PipelineError, SplitError
from .marker import pipe_split
from .partition import min_max_partition
from .pipe import Pipe, split

__all__ = ["CostFn", "Pipe", "PipelineError", "PipelineRunner", "SplitError", "min_max_partition", "node_flops",
           "node_params", "pipe_split", "split"]


def __getattr__(name: str) -> Any:
    # The runner imports torch.distributed.pipelining: only when a pipeline is built.
    if name == "PipelineRunner":
        from .runner import PipelineRunner
        return PipelineRunner
    raise AttributeError(name)
