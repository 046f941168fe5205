"""Runtime: executors compile aten graphs; runner.build turns a captured step into what runs."""
from .executors import EXECUTORS, EagerExecutor, Executor, InductorExecutor, executor_named

__all__ = ["EXECUTORS", "EagerExecutor", "Executor", "InductorExecutor", "executor_named"]
