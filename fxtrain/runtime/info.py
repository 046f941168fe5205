"""What capture did, in a form a user can read and a test can assert on."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections import Counter
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.fx


class Densities(Mapping[str, float]):
    """What -> the last batch's density. Stored as (count tensor, size): counting per call stays on the
    device, and only a read converts (one host synchronisation per read, none per step)."""

    def __init__(self) -> None:
        self._values: Dict[str, Any] = {}

    def record(self, what: str, count: torch.Tensor, size: int) -> None:
        self._values[what] = (count, max(size, 1))

    def __getitem__(self, what: str) -> float:
        value = self._values[what]
        if isinstance(value, tuple):
            count, size = value
            value = self._values[what] = float(count) / size
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return repr(dict(self))


@dataclass
class GraphRecord:
    """One captured graph: the dynamo-level graph, the step made of it and how the runtime runs it."""

    index: int
    mode: str                                   # "train" | "eval" | "no_grad"
    dynamo_graph: Optional[torch.fx.GraphModule]   # None for a step loaded from the cache
    # Why this capture happened ("first call", "new input schema", "guard failed: ...", "after a
    # graph break") and, when the graph ends at a graph break, dynamo's reason and where it is.
    reason: str = ""
    break_site: Optional[Tuple[str, str]] = None
    optimizations: Dict[str, str] = field(default_factory=dict)
    # The captured step (runtime/step.py: CapturedStep) and the runtime built from it (runner.Runtime).
    step: Optional[Any] = field(default=None, repr=False)
    run: Optional[Any] = field(default=None, repr=False)
    # executor="auto": which code runs this capture, since when, and why it stays on the eager
    # executor (runtime/tiered.py: Tier).
    tier: Optional[Any] = field(default=None, repr=False)
    cache_recipe: Optional[Any] = field(default=None, repr=False)   # what the on-disk cache needs
    from_cache: bool = False
    # A capture partitioned on a thread (runtime/pending.py: PendingPartition): until it is done,
    # ``step`` is the unpartitioned one and ``run`` the autograd mode.
    pending: Optional[Any] = field(default=None, repr=False)

    # Read from the step and the runtime, not copied: the aten graphs, the backward's runtime
    # object (the executor's code), an inference pair, Options.memory_budget's plan (MemoryPlan),
    # how the runtime runs the capture ("autograd" | "graph" | "aot") and why.
    forward_graph = property(lambda self: self.step.forward_graph)
    backward_graph = property(lambda self: self.step.backward_graph)
    backward_runner = property(lambda self: self.step.backward)
    inference = property(lambda self: self.step.inference)
    memory_plan = property(lambda self: self.step.memory_plan)
    runtime = property(lambda self: f"{self.run}{' (cache hit)' if self.from_cache else ''}")

@dataclass
class CaptureInfo:
    """Summary returned by ``TrainModule.capture_info()``.

    ``graphs`` counts captures: a forward graph and its backward graph are one capture; a model
    that breaks into k+1 pieces in one call counts k+1 graphs and k breaks. ``break_reasons`` holds
    one line per counted break (``len(break_reasons) == graph_breaks``), and each record's
    ``reason`` says why that capture happened.
    """

    graphs: int = 0
    graph_breaks: int = 0
    python_ops: List[str] = field(default_factory=list)
    # Custom Functions not kept as PythonOps: "module.Qualname: why"; Python runs each between two
    # graphs (a graph break, counted in graph_breaks), so it behaves exactly as in eager.
    python_op_handoffs: List[str] = field(default_factory=list)
    optimizations: Dict[str, str] = field(default_factory=dict)
    fallback_reason: Optional[str] = None
    executor: str = "eager"
    break_reasons: List[str] = field(default_factory=list)
    # The last batch's "label density", "token density": counted on the device per call, read as floats.
    density: Densities = field(default_factory=Densities)
    cache_hits: int = 0                                     # captures loaded from Options.cache_dir
    cache_misses: int = 0
    cache_log: List[str] = field(default_factory=list)     # what the cache did, one line per event
    # Batches a sparsity pass could not serve (runtime/dense_route.py), by reason: they ran the graph
    # without the passes, with eager's numbers.
    dense_batches: Dict[str, int] = field(default_factory=dict)
    records: List[GraphRecord] = field(default_factory=list, repr=False)

    # The one writer of these fields: capture, cache and runtime call these (tests/test_capture_info_writer.py).
    def add(self, record: GraphRecord, cache_hit: bool = False) -> GraphRecord:
        """A capture, live or loaded from the cache."""
        self.records.append(record)
        self.graphs, self.cache_hits = self.graphs + 1, self.cache_hits + cache_hit
        self.optimizations.update(record.optimizations)
        return record

    def note_partition(self, record: GraphRecord, step: Any, run: Any, optimizations: Dict[str, str],
                       tier: Optional[Any]) -> None:
        """A capture's partition, made on a thread, from its first call after it was done."""
        record.step, record.run, record.tier = step, run, tier
        record.optimizations.update(optimizations)
        self.optimizations.update(optimizations)

    def wait_for_partitions(self, timeout: Optional[float] = None) -> bool:
        """Block until every capture partitioned on a thread is (True if all are): ``records``,
        ``optimizations`` and ``tiers`` then describe whole steps. ``TrainModule.capture_info()``
        waits so."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return all(r.pending.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
                   for r in list(self.records) if r.pending is not None)

    def start_partitions(self) -> Callable[[], Optional[float]]:
        """Send the requests of the captures so far still to be partitioned, without waiting; the
        answer reads the CPU seconds the worker spent on them once every one is back (None until)."""
        pending = [r.pending for r in self.records if r.pending is not None]
        for p in pending:
            p.start()
        return lambda: (sum(p.cpu_seconds for p in pending) if all(p.done for p in pending) else None)

    def note_call(self, made: int, why: str, new_schema: bool, breaks: List[str]) -> None:
        """A call that made the last ``made`` captures: why the first happened (dynamo's guard text,
        already on each record, goes after it unless the schema is new), and the breaks it counted."""
        for i, record in enumerate(self.records[len(self.records) - made:] if made else []):
            base = why if i == 0 else "after a graph break"
            guard = record.reason if len(record.reason) <= 160 else record.reason[:157] + "..."
            record.reason = base if not guard or (i == 0 and new_schema) else \
                f"{base}: {guard}" if base == "guard failed" else f"{base}; failed guard: {guard}"
        self.graph_breaks += len(breaks)
        self.break_reasons.extend(breaks)

    def note_cache(self, event: str, miss: bool = False) -> None:
        self.cache_misses += miss
        self.cache_log.append(event)

    def note_python_op(self, name: str, handed_off: Optional[str] = None) -> bool:
        """A Function kept as a PythonOp, or handed to Python (why): whether it is news (a dynamo
        restart meets the same Function again)."""
        entries, entry = ((self.python_op_handoffs, f"{name}: {handed_off}") if handed_off is not None
                          else (self.python_ops, name))
        if entry in entries:
            return False
        entries.append(entry)
        return True

    def note_fallback(self, reason: str) -> None:
        self.fallback_reason = reason

    def count_dense_batch(self, reason: str) -> bool:
        """A batch the dense route took; whether it is the module's first."""
        self.dense_batches[reason] = self.dense_batches.get(reason, 0) + 1
        return sum(self.dense_batches.values()) == 1

    @property
    def memory_plan(self) -> Optional[Any]:
        """The memory budget's plan (``Options.memory_budget``) of the last training graph captured:
        budget, planned peak, peak without recomputation, bytes saved, extra FLOPs (``MemoryPlan``)."""
        plans = [r.memory_plan for r in self.records if r.memory_plan is not None]
        return plans[-1] if plans else None

    @property
    def tiers(self) -> List[str]:
        """executor="auto": per capture, which code runs it, since which of its calls (steps counted
        per capture), how long the compile took, or why it stays on the eager executor ('graph 0
        (train): inductor since step 7 (compiled in 31.2 s)', 'graph 1 (eval): eager: random op ...')."""
        return [f"graph {r.index} ({r.mode}): {r.tier}" for r in self.records if r.tier is not None]

    def wait_for_compiles(self, timeout: Optional[float] = None) -> bool:
        """executor="auto": block until every capture's background compile has finished or failed
        (True if all have); the next call of each capture then runs the compiled graphs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        left = lambda: None if deadline is None else max(deadline - time.monotonic(), 0.0)  # noqa: E731
        return self.wait_for_partitions(left()) and \
            all(r.tier.wait(left()) for r in self.records if r.tier is not None)

    @property
    def runtimes(self) -> List[str]:
        """How each capture's step runs, and why ('graph 0 (train): autograd: no backward pass
        applies: ...'): the backward passes among ``optimizations`` act only on a "graph" one
        (runtime/runner.py)."""
        return [f"graph {r.index} ({r.mode}): {r.runtime}" for r in self.records if r.run is not None]

    @property
    def capture_reasons(self) -> List[str]:
        """Why each capture happened, in order: 'graph 0 (train): first call', ..."""
        return [f"graph {r.index} ({r.mode}): {r.reason or 'loaded from the cache'}" for r in self.records]

    def __str__(self) -> str:
        lines = [f"graphs captured: {self.graphs}", f"graph breaks:    {self.graph_breaks}",
                 f"executor:        {self.executor}",
                 f"fallback:        {self.fallback_reason or 'no'}",
                 f"python ops:      {', '.join(self.python_ops) or '-'}"]
        lines.extend(f"  run by Python:  {handoff}" for handoff in self.python_op_handoffs)
        lines.extend(f"  {name:<22} {why}" for name, why in self.optimizations.items())
        plan = self.memory_plan
        if plan is not None:
            lines.extend(f"  memory plan: {line}" for line in str(plan).splitlines())
        lines.extend(f"  last batch {what}: {d:.3f}" for what, d in self.density.items())
        if self.cache_hits or self.cache_misses or self.cache_log:
            lines.append(f"cache:           {self.cache_hits} hit(s), {self.cache_misses} miss(es)")
            lines.extend(f"  cache {event}" for event in self.cache_log[-5:])
        lines.extend(f"  dense route: {n} batch(es): {reason}" for reason, n in self.dense_batches.items())
        lines.extend(f"  break: {reason}" + (f" (x{n})" if n > 1 else "")
                     for reason, n in Counter(self.break_reasons).items())
        lines.extend(f"  tier {line}" for line in self.tiers)
        for kind, entries in (("runtime", self.runtimes), ("capture", self.capture_reasons)):
            shown = [f"  {kind} {line}" for line in entries]
            if len(shown) > 6:
                shown[3:-3] = [f"  ... {len(shown) - 6} more capture(s)"]
            lines.extend(shown)
        return "\n".join(lines)
