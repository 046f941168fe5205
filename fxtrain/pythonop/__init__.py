"""PythonOp: custom ``torch.autograd.Function``s kept intact, as opaque nodes, inside one graph."""
from .registry import CallSpec, qualified_name
from .route import install, routing

install()

__all__ = ["CallSpec", "qualified_name", "routing"]
