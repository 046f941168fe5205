"""PythonOp: custom ``torch.autograd.Function``s kept intact, as opaque nodes, inside one graph."""
from .pending import close_step_log, forget as forget_runs, offer_step, open_step_log
from .python_call import raised_as_eager
from .registry import CallSpec, qualified_name
from .route import install, routing

install()

__all__ = ["CallSpec", "close_step_log", "forget_runs", "offer_step", "open_step_log", "qualified_name", "raised_as_eager", "routing"]
