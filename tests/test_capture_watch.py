"""The capture watchdog (fxtrain/capture/watch.py): a slow capture warns once, a compile sunk in
sympy is stopped (and only then), and a stop the compile outran leaves nothing behind."""
import logging
import signal
import sys
import threading
import time
import warnings
import weakref

import pytest
import sympy
import torch
from torch import nn

import fxtrain
from fxtrain.capture import watch as watch_module
from fxtrain.capture.watch import CompileWatch, ExpensiveSymbolicSizes, watched
from utils import train_parity, wrap_pair


# Seconds of this thread's CPU time, as the watch measures (capture/watch.py): wall seconds on a
# loaded machine hold less work (0.098 s of sympy counted for 0.3 wall seconds at load 4).
def _sympy_work(seconds: float) -> None:
    x, y = sympy.symbols("x y", integer=True, positive=True)
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        sympy.simplify((x ** 3 + y * x) / (x + y) + sympy.floor(x / 7) * y)


def _plain_work(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        sum(range(1000))


@pytest.mark.cpu_only(reason="the capture watchdog on plain Python work: no tensors")
def test_watch_stops_a_compile_sunk_in_sympy():
    started = time.perf_counter()
    with pytest.raises(ExpensiveSymbolicSizes):
        with watched(lambda s: "", warn_after=1e9, sympy_budget=lambda: 0.3) as watch:
            _sympy_work(30.0)
    assert watch.stopped and time.perf_counter() - started < 15
    _plain_work(0.3)   # nothing pending is delivered later


@pytest.mark.cpu_only(reason="the capture watchdog on plain Python work: no tensors")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_stop_swallowed_in_a_weakref_callback_is_raised_again():
    """The garbage collector may run a weakref callback in the middle of sympy; a stop raised while it
    runs is printed and dropped by Python. The compile, still in sympy, is stopped again."""
    class Key:
        pass

    key = Key()
    ref = weakref.ref(key, lambda _: _sympy_work(30.0))   # noqa: F841 (kept alive: its callback runs)
    started = time.perf_counter()
    with pytest.raises(ExpensiveSymbolicSizes):
        with watched(lambda s: "", warn_after=1e9, sympy_budget=lambda: 0.3) as watch:
            del key                    # the callback sinks into sympy and is stopped there, silently
            assert watch.stops == 1
            _sympy_work(30.0)
    assert watch.stops == 2 and time.perf_counter() - started < 15


@pytest.mark.cpu_only(reason="the capture watchdog on plain Python work: no tensors")
def test_a_stop_waits_for_sympys_own_code(monkeypatch):
    """A sample that lands in other code sympy is running (a weakref callback the collector started
    there) does not stop the compile: Python would print the exception and drop it. The next sample
    in sympy's own code does."""
    monkeypatch.setattr(watch_module, "_SHARE", 0.01)   # 20 ms of sympy in the window is "most of it"
    frames = {}

    class Callback:
        def _sympy_(self):   # called by sympy.sympify, from sympy's own code
            frames["callback"], frames["sympy"] = sys._getframe(), sys._getframe(1)
            return sympy.Integer(1)

    sympy.sympify(Callback())
    watch = CompileWatch(lambda s: "", warn_after=1e9, sympy_budget=lambda: 0.0)
    _plain_work(0.05)   # charged to sympy by the next sample, whose stack holds sympy's frame
    watch.sample(signal.SIGPROF, frames["callback"])
    assert not watch.stopped and watch.sympy_seconds >= 0.05
    with pytest.raises(ExpensiveSymbolicSizes):
        watch.sample(signal.SIGPROF, frames["sympy"])
    assert watch.stops == 1


@pytest.mark.cpu_only(reason="the capture watchdog on a CPU tensor's backward: no device involved")
def test_a_stop_in_a_backward_leaves_no_anomaly_traceback_and_keeps_other_warnings():
    """AOTAutograd traces the backward under anomaly mode, whose engine warns with the forward's
    traceback for any error a backward node raises: a stop landing in a backward's sympy work printed
    one for a capture that was right (the fuzzer's Llama, under load)."""
    class SympyInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            _sympy_work(30.0)
            return grad * 2

    x = torch.randn(3, requires_grad=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(ExpensiveSymbolicSizes):
            with watched(lambda s: "", warn_after=1e9, sympy_budget=lambda: 0.3), \
                    torch.autograd.detect_anomaly(check_nan=False):
                warnings.warn("the compile's own warning", UserWarning)
                SympyInBackward.apply(x).sum().backward()
    said = [str(w.message) for w in seen]
    assert "the compile's own warning" in said and not [m for m in said if m.startswith("Error detected in")]


@pytest.mark.cpu_only(reason="the capture watchdog on plain Python work: no tensors")
def test_watch_stops_nothing_until_its_budget_is_known():
    """The budget counts the first capture's partition, which the worker may still be making: while
    its reader says None the compile goes on, past what the budget will be, and stops once known."""
    known = threading.Event()
    with pytest.raises(ExpensiveSymbolicSizes):
        with watched(lambda s: "", warn_after=1e9, sympy_budget=lambda: 0.3 if known.is_set() else None) as watch:
            _sympy_work(1.5)
            assert not watch.stopped and watch.sympy_seconds > 1.2   # a known 0.3 stops it by 1.2 s (_SHARE of WINDOW)
            known.set()
            _sympy_work(30.0)
    assert watch.stopped


@pytest.mark.cpu_only(reason="the capture watchdog on plain Python work: no tensors")
def test_watch_leaves_other_work_alone():
    with watched(lambda s: "", warn_after=1e9, sympy_budget=lambda: 0.1) as watch:
        _plain_work(1.5)          # long, but no sympy
        _sympy_work(0.3)          # sympy past the budget, but not most of the recent time
        _plain_work(0.5)
    assert not watch.stopped and watch.sympy_seconds > 0.1


@pytest.mark.cpu_only(reason="the capture watchdog on plain Python work: no tensors")
def test_watch_charges_sympy_only_the_compiling_threads_time():
    """Another thread of the process at work while the compile sits in sympy (a partition's answer
    unpickled, a tier's graphs loaded) is not this compile's sympy work: 0.9 s of it is below the
    stop's 1.2 s of a 2 s window, however much CPU the process spent meanwhile (about twice that
    here, the two threads taking turns at the GIL, which the process's CPU time charged to sympy)."""
    done = threading.Event()

    def busy() -> None:
        while not done.is_set():
            sum(range(1000))
    other = threading.Thread(target=busy, daemon=True)
    process_started = time.process_time()
    try:
        with watched(lambda s: "", warn_after=1e9, sympy_budget=lambda: 0.3) as watch:
            other.start()
            _sympy_work(0.9)
    finally:
        done.set()
        other.join()
    assert time.process_time() - process_started > 1.5      # the busy thread did run beside it
    assert not watch.stopped and 0.5 < watch.sympy_seconds < 1.0, watch.sympy_seconds


@pytest.mark.cpu_only(reason="the capture watchdog on plain Python work: no tensors")
def test_watch_warns_once_after_the_threshold(caplog):
    with caplog.at_level(logging.WARNING, logger="fxtrain"):
        with watched(lambda s: f"capturing X has taken {s:.1f} s", warn_after=0.1, sympy_budget=None):
            _plain_work(0.6)
    warnings = [r.getMessage() for r in caplog.records if "capturing X" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("fxtrain: capturing X has taken")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).tanh().sum()


def test_slow_capture_warning_names_the_capture_and_the_option(caplog):
    torch.manual_seed(0)
    # A threshold every compile passes: a fixed one (0.2 s) failed when a warm test worker captured
    # Tiny faster. Frames dynamo converts besides the entry may warn too (each once: the test above).
    tm, ref = wrap_pair(Tiny(), dynamic=None, capture_warning_seconds=1e-6)
    with caplog.at_level(logging.WARNING, logger="fxtrain"):
        train_parity(tm, ref, [dict(x=torch.randn(4, 8)), dict(x=torch.randn(3, 8))], lambda out, _: out)
    slow = [r.getMessage() for r in caplog.records if "so far" in r.getMessage()]
    first = [m for m in slow if m.startswith("fxtrain: the capture of Tiny has taken")]
    symbolic = [m for m in slow
                if m.startswith("fxtrain: a symbolic capture of Tiny (symbolic: kwargs['x'] dim 0 (4 -> 3))")]
    assert first and all("Options(cache_dir=...)" in m for m in first), slow
    assert symbolic and all("Options(dynamic=False)" in m for m in symbolic), slow


@pytest.mark.cpu_only(reason="option parsing: no tensors")
def test_capture_warning_seconds_must_be_positive():
    with pytest.raises(ValueError, match="capture_warning_seconds"):
        fxtrain.Options(capture_warning_seconds=0)
