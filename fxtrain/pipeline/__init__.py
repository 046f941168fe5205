"""Pipeline parallelism: split a captured graph into stages and train them on torch.distributed."""
from .capture import SplitError
from .costs import CostFn, node_flops, node_params
from .marker import pipe_split
from .partition import min_max_partition
from .pipe import Pipe, split

__all__ = ["CostFn", "Pipe", "SplitError", "min_max_partition", "node_flops", "node_params", "pipe_split", "split"]
