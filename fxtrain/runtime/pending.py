"""A capture's first calls run in the autograd mode while a worker process partitions it.

Why: AOTAutograd's partition (capture/pipeline.py: ``partition``, a joint trace on fake tensors) is
most of a cold first step, and on the graphs the sparsity passes leave, whose sizes are
data-dependent, it costs 2.5x what it costs on dense ones: bert-mlm 3.6-4.3 s of a 6 s first step
(docs/benchmarks.md, "First step, and the on-disk cache"). The autograd mode (runtime/runner.py) needs none of it:
the torch-level graph after fxtrain's forward passes runs under PyTorch's own autograd, with eager's
numbers, about as fast as the aten graphs on these workloads. So dynamo gets that runtime at once,
and the call after the partition is back runs what the whole step makes (the graph mode where the
backward passes pay, the tier that compiles it, ...), as a capture made in one go would.

The request goes out at the capture's second call, not at capture: the first step then has the
cores to itself (a worker's first start imports torch, ~3 s of a core). ``wait`` sends it at once
(``capture_info()`` waits for whole steps); so does ``start``, without waiting (the first size
change: its symbolic capture goes on beside the worker, capture/sizes.py: sympy_budget). Where the
partition fails, the capture keeps the autograd mode (logged once): never a crash, never another
answer.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional

from . import threads

logger = logging.getLogger("fxtrain")


class Ready(NamedTuple):
    """What the partition returns: the core to run from the next call, what to record of the whole
    step (called on the caller's thread, at the switch), and the whole step itself for those that
    wait for it (``PendingPartition.then``: the cache stores it)."""
    core: Callable[..., Any]
    record: Callable[[], None]
    step: Any
    mode: str                         # the runtime mode the whole step runs in
    optimizations: Dict[str, str]     # the backward passes' reports
    tier: Optional[Any]               # runtime/tiered.py's Tier of the whole step, if it has one


class PendingPartition:
    """``runner.build``'s ``later`` for one capture: its core is the autograd mode's until the
    partition's is ready. Runtime state, kept apart from the steps (which stay what capture made)."""

    def __init__(self, owner: str, job: Callable[[], Ready]) -> None:
        self.owner = owner
        self.seconds: Optional[float] = None   # from the request to the answer's core
        self.cpu_seconds = 0.0                 # the partition's own, in the worker
        self.error = ""                        # why it failed: the capture keeps the autograd mode
        self.calls = 0
        self._job: Optional[Callable[[], Ready]] = job
        self._live: Optional[Callable[..., Any]] = None
        self._ready: Optional[Ready] = None
        self._done = threading.Event()
        self._start_lock = threading.Lock()
        self._then: List[Callable[[Ready], None]] = []
        self._answer: Optional[Ready] = None   # kept for a ``then`` registered after the answer

    def __call__(self, core: Callable[..., Any]) -> Callable[..., Any]:
        self._live = core
        return self._run

    def _run(self, *args: Any) -> Any:
        if self._ready is not None:
            self._switch()   # before this call counts: ``calls`` is then the calls made before the switch
        self.calls += 1
        if self.calls == 2:
            self.start()
        assert self._live is not None
        return self._live(*args)

    def start(self) -> None:
        """Send the request if it has not gone yet (no wait)."""
        with self._start_lock:
            job, self._job = self._job, None
        if job is not None:
            threads.start(self._partition, job, name=f"fxtrain-partition-{self.owner}")

    def _partition(self, job: Callable[[], Ready]) -> None:
        started = time.perf_counter()
        try:
            ready = job()
        except Exception as e:   # the autograd mode runs on, with eager's numbers
            if not threads.exiting.is_set():
                self.error = (str(e).strip() or type(e).__name__).splitlines()[0]
                logger.warning("fxtrain: %s: its partition failed (%s); it keeps running in the autograd mode",
                               self.owner, self.error)
        else:
            self.seconds = time.perf_counter() - started
            # Before the switch can happen: what ``then`` runs (the cache pickling the graphs) reads
            # graphs no other thread runs yet.
            with self._start_lock:
                hooks, self._then, self._answer = self._then, [], ready
            for hook in hooks:
                self._run_hook(hook, ready)
            self._ready = ready
            logger.info("%s: partitioned by the worker in %.2f s", self.owner, self.seconds)
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        """The partition has finished or failed (its ``cpu_seconds`` are then final)."""
        return self._done.is_set()

    def then(self, hook: Callable[[Ready], None]) -> None:
        """Run ``hook`` with the whole step once the partition is back, on the partition's thread,
        before the step runs it (at once if it is back already); never if the partition fails."""
        with self._start_lock:
            answer = self._answer
            if answer is None:
                self._then.append(hook)
        if answer is not None:
            self._run_hook(hook, answer)

    def _run_hook(self, hook: Callable[[Ready], None], ready: Ready) -> None:
        try:
            hook(ready)
        except Exception as e:   # the step runs on whatever a listener failed at
            if not threads.exiting.is_set():
                logger.warning("fxtrain: %s: after its partition: %s: %s", self.owner, type(e).__name__, e)

    def _switch(self) -> None:
        ready, self._ready = self._ready, None
        if ready is not None:
            self._live = ready.core
            ready.record()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Send the request if it has not gone yet and block until the partition has finished or
        failed (True if it has); the whole step is then recorded, and runs from the next call."""
        self.start()
        done = self._done.wait(timeout)
        if done:
            self._switch()
        return done

    def __str__(self) -> str:
        if self.error:
            return f"autograd mode: the partition failed ({self.error})"
        if not self._done.is_set():
            return "autograd mode until the worker's partition is back"
        return f"partitioned by the worker in {self.seconds:.2f} s"
