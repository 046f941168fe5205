"""A watchdog over each dynamo compile: a slow capture is never silent, and a symbolic capture that
sinks into sympy is stopped so that TrainModule can capture those sizes statically instead.

Why a sampling thread: dynamo gives no progress hook, and the one way a capture stalls that we have
seen (HF Swin's window partition on a symbolic image size: ``FloorDiv.eval`` calling
``sympy.simplify`` on ever larger expressions, minutes per recapture, torch.compile too) is visible
from outside as the compiling thread's stack sitting in sympy. Sampling that stack every few tens of
milliseconds costs nothing measurable and measures the symbolic reasoning itself, not the capture's
total time, which legitimately grows with the model.

Why stop it with an asynchronous exception: the compile runs on the caller's thread inside dynamo,
which has no cancellation. ``PyThreadState_SetAsyncExc`` raises ``ExpensiveSymbolicSizes`` at the
compiling thread's next bytecode, which is sympy's pure-Python code; dynamo unwinds as for any error
in a compile, and TrainModule retries the call with those sizes static. It is only used while the
entry frame compiles (nothing of the call has run, so the retry runs it exactly once); a later frame
that is slow only warns. A pending exception is taken back if the compile finishes first.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import sys
import threading
import time
from typing import Callable, Deque, Iterator, Optional, Tuple

logger = logging.getLogger("fxtrain")

_SYMPY = f"{os.sep}sympy{os.sep}"
_INTERVAL = 0.05   # seconds between samples
# Expensive: past its budget, and sympy most of the time lately. Symbolic captures that end well spend
# 7-20% of their time in sympy (HF Swin with a symbolic batch, ResNet and ViT with symbolic image
# sizes); Swin with symbolic image sizes spends ~80%, for minutes.
WINDOW = 2.0      # seconds
_SHARE = 0.6


class ExpensiveSymbolicSizes(BaseException):
    """Raised into a compile whose symbolic size reasoning ran past its budget (a control signal
    between the watchdog and TrainModule, never shown to the user). A BaseException, as
    KeyboardInterrupt is, so that dynamo's handlers of ordinary errors (which turn an error in a
    fake-tensor call into an "unsupported" graph break or a TorchRuntimeError) let it through."""


def _set_async_exc(thread_id: int, exc: Optional[type]) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc) if exc is not None else None)


def _in_sympy(frame) -> bool:
    while frame is not None:
        if _SYMPY in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class CompileWatch:
    """Watches one compile. ``warn_after``: seconds after which to log once at WARNING what is being
    captured (``describe(elapsed)`` says it) and how to avoid it; ``sympy_budget``: seconds of sympy
    work after which, if sympy also took most of the last ``WINDOW`` seconds, the compile is stopped
    with ExpensiveSymbolicSizes (None: never stopped)."""

    def __init__(self, describe: Callable[[float], str], warn_after: float,
                 sympy_budget: Optional[float]) -> None:
        self.describe, self.warn_after, self.sympy_budget = describe, warn_after, sympy_budget
        self.sympy_seconds = 0.0
        self.peak_share = 0.0      # the largest share of sympy in any window of WINDOW seconds
        self.stopped = False
        self._thread_id = threading.get_ident()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._started = time.perf_counter()

    def _run(self) -> None:
        warned = False
        last = time.perf_counter()
        recent: Deque[Tuple[float, float]] = collections.deque()   # (when, seconds in sympy) per sample
        recent_sympy = 0.0
        while not self._done.wait(_INTERVAL):
            now = time.perf_counter()
            frame = sys._current_frames().get(self._thread_id)
            in_sympy = frame is not None and _in_sympy(frame)
            del frame
            spent = now - last if in_sympy else 0.0
            self.sympy_seconds += spent
            recent.append((now, spent))
            recent_sympy += spent
            while recent and recent[0][0] < now - WINDOW:
                recent_sympy -= recent.popleft()[1]
            if now - self._started >= WINDOW:
                self.peak_share = max(self.peak_share, recent_sympy / WINDOW)
            last = now
            elapsed = now - self._started
            if not warned and elapsed >= self.warn_after:
                warned = True
                logger.warning("fxtrain: %s", self.describe(elapsed))
            if (self.sympy_budget is not None and self.sympy_seconds > self.sympy_budget
                    and recent_sympy > _SHARE * WINDOW):
                with self._lock:
                    if not self._done.is_set() and not self.stopped:
                        self.stopped = True
                        logger.debug("fxtrain: compile stopped after %.1f s, %.1f s of it in sympy",
                                     elapsed, self.sympy_seconds)
                        _set_async_exc(self._thread_id, ExpensiveSymbolicSizes)
                return

    def finish(self) -> None:
        with self._lock:
            self._done.set()
            if self.stopped:
                # The compile ended before the exception was delivered: take it back.
                _set_async_exc(self._thread_id, None)


@contextlib.contextmanager
def watched(describe: Callable[[float], str], warn_after: float,
            sympy_budget: Optional[float]) -> Iterator[CompileWatch]:
    watch = CompileWatch(describe, warn_after, sympy_budget)
    thread = threading.Thread(target=watch._run, name="fxtrain-compile-watch", daemon=True)
    thread.start()
    try:
        yield watch
    finally:
        watch.finish()
        thread.join()
