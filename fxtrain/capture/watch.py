"""A watchdog over each dynamo compile: a slow capture is never silent, and a symbolic capture that
sinks into sympy is stopped so that TrainModule can capture those sizes statically instead.

Why sampling: dynamo gives no progress hook, and the one way a capture stalls that we have seen
(HF Swin's window partition on a symbolic image size: ``FloorDiv.eval`` calling ``sympy.simplify``
on ever larger expressions, minutes per recapture, torch.compile too) shows as the compiling
thread's stack sitting in sympy. The share of samples in sympy measures the symbolic reasoning
itself, not the capture's total time, which legitimately grows with the model.

Why a SIGPROF handler, not a thread reading the compiling thread's frames: walking another running
thread's frames (``sys._current_frames()`` then ``f_back``) crashed the interpreter on CPython 3.11
(a segfault in a test worker); a signal handler runs on the compiling thread itself, between
bytecodes, and reads its own stack safely. ``ITIMER_PROF`` (process CPU time) leaves ``SIGALRM`` and
``ITIMER_REAL`` to others (pytest-timeout uses them). Signal handlers can only be installed from the
main thread: a compile on another thread is not sampled (never stopped; still warned about). A
handler the process had is put back after the compile.

Why the compiling thread's CPU time, not wall time, for every measure the stop reads (the sympy
seconds, the window, the first capture that sets the budget): the timer fires per 50 ms of CPU, so
under load the wall gap between two samples grows, and charging a whole gap to sympy made a machine
busy with other work look like a capture sunk in sympy (CI stopped HF Swin's symbolic batch size,
which spends at most 40% of a window in sympy, and the model then captured once per batch size).
Not the process's CPU time either: the process's other threads (a partition's answer unpickled, a
tier's graphs loaded, an earlier module's background work in a long test run) were charged to sympy
whenever a sample found the compiling thread there. ``make test-long`` saw stops in its GPT-2 and
Swin fuzz cases, where Swin's symbolic batch spends 0.96 s of a 6.9 s capture in sympy alone. The
timer still counts the process's CPU (ITIMER_PROF), so a busy process samples more often: finer,
not larger.

Why stop it with an exception raised from the handler: the compile runs inside dynamo, which has no
cancellation. ``ExpensiveSymbolicSizes`` is raised at the compiling thread's current bytecode,
which is sympy's pure-Python code; dynamo unwinds as for any error in a compile, and TrainModule
retries the call with those sizes static. It is only armed while the entry frame compiles (nothing
of the call has run, so the retry runs it exactly once); a later frame that is slow only warns.

Why a stop waits for sympy's own bytecode, and may be raised again: the handler runs between any two
bytecodes, also those of a weakref callback or a ``__del__`` that the garbage collector started
inside sympy (dynamo keeps weak-keyed tables), and Python prints an exception raised there
("Exception ignored in ...") and drops it (the fuzzer's RoBERTa classifier, seed 211, met one in
dynamo's ``ExactWeakKeyDictionary`` callback). So a stop is raised only where the interrupted
bytecode is sympy's; a sample elsewhere leaves it to the next one. A callback may itself run sympy:
the compile then goes on, and if it is still in sympy ``_RESTOP`` seconds of CPU after the stop, the
stop is raised again. Not sooner, so that a stop on its way out is not raised again into the
handlers that unwind it.

Why the compile's warnings are held until it ends: AOTAutograd traces the backward under anomaly
mode, and for an error a backward node raises the autograd engine warns with the forward's traceback
("Error detected in SliceBackward0. Traceback of forward call ..."). A stop that lands in the sympy
work of a backward node is such an error: the fuzzer's Llama, stopped under load, printed one for a
capture that went on to be right. After a stop those warnings are dropped; every other one is shown
at the compile's end as it would have been.

The warning comes from a plain timer thread that reads no frames.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import threading
import time
import warnings
from typing import Any, Callable, Deque, Iterator, List, Optional, Tuple

logger = logging.getLogger("fxtrain")

_SYMPY = f"{os.sep}sympy{os.sep}"
_INTERVAL = 0.05   # seconds of process CPU time between samples (ITIMER_PROF)
# Expensive: past its budget, and sympy most of the time lately. Symbolic captures that end well spend
# 7-25% of their time in sympy (HF Swin with a symbolic batch, ResNet and ViT with symbolic image
# sizes, T5); Swin with symbolic image sizes spends ~80%, for minutes.
WINDOW = 2.0       # seconds
_SHARE = 0.6
_RESTOP = 0.5      # seconds of CPU after a stop the compile did not end with: raised again
_ANOMALY = "Error detected in "   # how the autograd engine's anomaly mode begins its warning


class ExpensiveSymbolicSizes(BaseException):
    """Raised into a compile whose symbolic size reasoning ran past its budget (a control signal
    between the watchdog and TrainModule, never shown to the user). A BaseException, as
    KeyboardInterrupt is, so that dynamo's handlers of ordinary errors (which turn an error in a
    fake-tensor call into an "unsupported" graph break or a TorchRuntimeError) let it through."""


def _runs_sympy(frame: Any) -> bool:
    """The interrupted bytecode is sympy's own: an exception raised there unwinds through sympy."""
    return _SYMPY in frame.f_code.co_filename


def _in_sympy(frame: Any) -> bool:
    while frame is not None:
        if _SYMPY in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class CompileWatch:
    """Watches one compile. ``warn_after``: seconds after which to log once at WARNING what is being
    captured (``describe(elapsed)`` says it) and how to avoid it; ``sympy_budget``: reads the seconds
    of sympy work after which, if sympy also took most of the last ``WINDOW`` seconds, the compile is
    stopped with ExpensiveSymbolicSizes (None: never stopped; the reader's None: not known yet, read
    again at the next sample; capture/sizes.py: sympy_budget)."""

    def __init__(self, describe: Callable[[float], str], warn_after: float,
                 sympy_budget: Optional[Callable[[], Optional[float]]]) -> None:
        self.describe, self.warn_after, self.sympy_budget = describe, warn_after, sympy_budget
        self.sympy_seconds = 0.0
        self.peak_share = 0.0      # the largest share of sympy in any window of WINDOW seconds
        self.stopped = False
        self.stops = 0             # ExpensiveSymbolicSizes raised (more than one: one was swallowed)
        self._stopped_at = 0.0
        self._started = time.perf_counter()
        self._cpu_started = self._last = time.thread_time()
        self._recent: Deque[Tuple[float, float]] = collections.deque()   # (when, seconds in sympy)
        self._recent_sympy = 0.0
        self._done = threading.Event()

    def cpu_seconds(self) -> float:
        """The compiling thread's CPU time since the compile started: the unit of every measure the
        stop reads (``watched`` is entered on the compiling thread, and the handler runs there)."""
        return time.thread_time() - self._cpu_started

    def warn_when_slow(self) -> None:
        if not self._done.wait(self.warn_after):
            logger.warning("fxtrain: %s", self.describe(time.perf_counter() - self._started))

    def sample(self, signum: int, frame: Any) -> None:
        """SIGPROF handler: runs on the compiling thread, ``frame`` is where it was interrupted."""
        if self._done.is_set():
            return
        now = time.thread_time()
        in_sympy = _in_sympy(frame)
        if self.stopped:
            if _runs_sympy(frame) and now - self._stopped_at >= _RESTOP:
                self._stop(now)
            return
        spent = now - self._last if in_sympy else 0.0
        self._last = now
        self.sympy_seconds += spent
        self._recent.append((now, spent))
        self._recent_sympy += spent
        while self._recent and self._recent[0][0] < now - WINDOW:
            self._recent_sympy -= self._recent.popleft()[1]
        if now - self._cpu_started >= WINDOW:
            self.peak_share = max(self.peak_share, self._recent_sympy / WINDOW)
        if self.sympy_budget is None or self._recent_sympy <= _SHARE * WINDOW:
            return
        budget = self.sympy_budget()
        if budget is not None and self.sympy_seconds > budget and _runs_sympy(frame):
            logger.debug("fxtrain: compile stopped after %.1f s of CPU time, %.1f s of it in sympy",
                         now - self._cpu_started, self.sympy_seconds)
            self._stop(now)

    def _stop(self, now: float) -> None:
        self.stopped, self._stopped_at = True, now
        self.stops += 1
        raise ExpensiveSymbolicSizes()


@contextlib.contextmanager
def _sampling(watch: CompileWatch) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGPROF"):
        yield
        return
    previous = signal.signal(signal.SIGPROF, watch.sample)
    old_timer = signal.setitimer(signal.ITIMER_PROF, _INTERVAL, _INTERVAL)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, *old_timer)
        signal.signal(signal.SIGPROF, previous)


@contextlib.contextmanager
def watched(describe: Callable[[float], str], warn_after: float,
            sympy_budget: Optional[Callable[[], Optional[float]]]) -> Iterator[CompileWatch]:
    watch = CompileWatch(describe, warn_after, sympy_budget)
    warner = threading.Thread(target=watch.warn_when_slow, name="fxtrain-compile-watch", daemon=True)
    warner.start()
    try:
        with _sampling(watch), _held_warnings(lambda message: bool(watch.stops) and str(message).startswith(_ANOMALY)):
            yield watch
    finally:
        watch._done.set()
        warner.join()


@contextlib.contextmanager
def _held_warnings(dropped: Callable[[Any], bool]) -> Iterator[None]:
    """Warnings shown in the block are shown at its end, less those ``dropped`` says (read then).
    Through ``warnings.showwarning``, the hook Python calls once its filters let a warning through:
    ``catch_warnings`` would also undo the filters a module imported inside the block adds. On the
    main thread only, where a compile can be stopped: two threads swapping the process-wide hook
    could leave one's in place, and every later warning would go to its list."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: List[Tuple[Any, ...]] = []
    show = warnings.showwarning
    warnings.showwarning = lambda *args, **kwargs: held.append((args, kwargs))   # type: ignore[assignment]
    try:
        yield
    finally:
        warnings.showwarning = show
        for args, kwargs in held:
            if not dropped(args[0]):
                show(*args, **kwargs)
