"""Runtime: executors that run the captured graphs."""
from .executors import EXECUTORS, compile_graph

__all__ = ["EXECUTORS", "compile_graph"]
