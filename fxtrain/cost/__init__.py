"""The cost model, below the budget planner and the profiler that both use it: FLOPs per op, and a
fake step's live bytes and peak counted op by op (``tracker``) on marked graphs (``marks``)."""
