"""PythonOp: custom ``torch.autograd.Function``s kept intact, as opaque nodes, inside one graph."""
from .pending import close_step_log, offer_step, open_step_log
from .pending import forget as forget_runs
from .python_call import raised_as_eager
from .registry import CallSpec, qualified_name
from .route import install, routing

install()

__all__ = ["CallSpec", "close_step_log", "forget_runs", "offer_step", "open_step_log", "qualified_name", "raised_as_eager", "routing"]
