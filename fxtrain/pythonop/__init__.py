"""PythonOp: custom ``torch.autograd.Function``s kept intact, as opaque nodes, inside one graph."""
from .pending import forget as forget_runs
from .registry import CallSpec, qualified_name
from .route import install, routing

install()

__all__ = ["CallSpec", "forget_runs", "qualified_name", "routing"]
