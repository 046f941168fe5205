"""executor="auto": each capture starts on the eager executor and moves to inductor's code when ready.

Capture is the eager executor's (first step as fast as executor="eager"). Once the capture has been
in use for ``Options.compile_after`` seconds (10 by default), a thread pickles the
capture's aten forward and backward graphs and starts a worker process (``python -m
fxtrain.runtime.tiered``) at the lowest CPU priority (nice 19, and its C++ compiler children with
it), which re-traces each graph with inductor's decompositions and compiles it, filling inductor's
on-disk FX graph cache. The thread loads the compiled graphs from that cache (hits only) and hands
them to the ``Tier``; its next call runs them, through the same replay as the inductor executor.

Why wait: on a machine whose cores the training loop uses, the worker slows the loop a little, and a
run that ends before the compiled graphs have paid back their compile gains nothing for it (a short
script, a test, an evaluation run). Ten seconds is short against a training run and longer than
most short runs; a run that has lasted that long is likely to last longer. One worker runs at a time
(``_one_worker``): compiles side by side would share the same idle cores and each finish later.

Why a process and not a thread compiling in this one:
- inductor generates code under ``preserve_rng_state``, which sets the global random generator back
  to where it was when the compile began: on a thread, every random number the training loop drew
  meanwhile (dropout, ``randperm`` of a sampler) would be drawn again, a wrong answer;
- its lowering is Python, holding the GIL for tens of seconds on small models, which a nice value
  cannot lower inside one process; the worker's share of the cores can be;
- its config is process-global (``config.patch``), and dynamo may capture in this process meanwhile.
The load in this process is a cache hit only (``torch_private.inductor_compile(cached_only=True)``:
no code generation, so no generator rewind), under dynamo's compile lock.

Why the eager executor's graphs as they are (no re-partition): the compiled tier then takes the same
inputs and saves the same tensors as the eager one (one ``ReplaySpec``), so the switch is a swap of
one callable, and the forward and backward passes already ran on these graphs. Inductor's own
decompositions are applied by re-tracing each graph apart (what it lowers), keeping its signature;
what is lost against executor="inductor" is the min-cut partition's recomputation (docs/benchmarks.md).

A capture stays on the eager executor, with the reason in ``capture_info()``, when the compiled
graphs could not give eager's numbers or cannot be made ahead: random ops other than a chain of
dropouts (inductor's own random code draws other numbers; dropout runs eager's kernel, under
``fallback_random``, and a chain keeps eager's order of draws), custom autograd Functions
(PythonOps: each becomes an opaque call inductor cannot fuse), custom ops defined in ``__main__``
(the worker cannot import them: ``torch_private.only_here``), a memory budget's plan, graphs the
replay does not run; and when the compile fails or outlives ``Options.compile_timeout`` (logged
once).

Symbolic sizes (a capture made dynamic by a change of batch or sequence size, and the row counts of
the sparsity passes, which are data-dependent) compile as they are: inductor's code takes the sizes
at each call. Dynamo's guards were installed at capture, before inductor ran; a size inductor then
specialises on (``Eq(s0, 8)``, a divisibility for vector code) is a guard it records in the graphs'
ShapeEnv, read back when the graphs load (``compiled_from``). Such guards are checked at each call
on the graph inputs (``torch_private.size_guard_check``: one compiled Python expression, a few µs),
and a call whose sizes fail them runs on the eager executor, as the capture would without a tier.
The worker's retrace can pin a size too (a decomposition or meta kernel that reads a whole
``size()``: ``constant_pad_nd``, which an HF causal-LM loss runs on its labels): the graphs it hands
back are then concrete where the capture's were symbolic (``_pinned``), and the same per-call check
sends other sizes to the eager executor. A guard on a size the inputs do not determine (a
data-dependent row count) cannot be checked: that capture stays on the eager executor, with the
guard as the reason. On the CPU, a BERT-MLM capture with padding and sparse labels adds no guard
(its compiled graphs serve every batch and sequence size); the packed Llama's is pinned to its
rows' shape, which packing keeps fixed (tests/test_tiered.py).
"""
from __future__ import annotations

import logging
import functools
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from .. import torch_private as tp
from ..errors import Error
from . import threads
from .absent_grads import AbsentGradBackward, values_read
from .executors import InductorExecutor, inductor_compile_graph
from .replay import replayed

logger = logging.getLogger("fxtrain")

# Steps timed on each tier, back to back, before the compiled graphs are kept, and how much slower
# than the eager executor's they may measure before the capture goes back to it (no margin: where the
# two are as fast, either will do).
TRIAL_STEPS = 5
SLOWER = 1.0
_workers: Set[subprocess.Popen] = set()   # killed at exit: a compile nobody will run is wasted cores
# One worker at a time per process: captures compiled side by side would share the cores the
# training loop leaves idle, each finishing later than in turn (and each worker holds its own torch).
_one_worker = threading.Lock()


# The graphs a tier hands its worker: a directory per compile, named for the training process. A
# process killed mid-compile cannot remove its own; its worker does as it exits (threads.worker_command),
# and the next process to compile removes any whose process is gone (a race the worker can lose).
_TMP_PREFIX = "fxtrain-tier-"


@functools.lru_cache(maxsize=None)
def _sweep_orphans() -> None:
    """Remove the tier directories of processes that no longer exist (once per process). Not on
    Windows, where ``os.kill(pid, 0)`` is no liveness probe."""
    if os.name == "nt":
        return
    for path in Path(tempfile.gettempdir()).glob(f"{_TMP_PREFIX}*-*"):
        pid = path.name[len(_TMP_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive_pid(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive_pid(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:   # another user's process: alive
        return True
    return True


class _OwnerGone(Error):
    """The worker was stopped: the TrainModule it compiled for no longer exists."""


def _stop_workers() -> None:
    # A killed worker wakes its thread at once, which then returns before threads.py joins it.
    for proc in list(_workers):
        proc.kill()


threads.on_exit(_stop_workers)


def stays_eager(step: Any) -> str:
    """Why ``step`` (a CapturedStep) cannot move to compiled graphs ('' if it can)."""
    if step.spec is None or step.not_replayable:
        return f"fxtrain's replay cannot run its aten graphs ({step.not_replayable or 'no spec'})"
    if step.memory_plan is not None:
        return "a memory budget's plan runs the eager executor's graphs"
    if step.forward_graph is None or (step.backward_graph is None and not step.inference):
        return "no aten graphs"
    graphs = [g for g in (step.forward_graph, step.backward_graph) if g is not None]
    only_here = tp.only_here(graphs)
    if only_here:   # the compile is a worker's
        return only_here
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if str(node.target).startswith("fxtrain.python_op"):
                return "custom autograd Functions (PythonOps) would be opaque calls inductor cannot fuse"
            if tp.draws_random_numbers(node) and (gm is not step.forward_graph or node.target not in EAGER_RANDOM):
                return f"random op {node.target}: inductor's generator would not give eager's numbers"
    return _random_order(step.forward_graph)


# Random ops the compiled tier runs as eager's own kernels (torch_private.inductor_eager_random):
# dropout, which inductor keeps whole under that flag. Others (attention with dropout, rand) are
# decomposed or lowered to inductor's own random code, which draws other numbers.
EAGER_RANDOM = (torch.ops.aten.native_dropout.default,)


def _random_order(gm: torch.fx.GraphModule) -> str:
    """Eager's numbers come from the same draws in the same order. Inductor's scheduler may reorder
    kernels that do not depend on each other (for locality, for peak memory): the random ops must
    form a chain, each one's output an ancestor of the next (as the dropouts of a stack of layers
    are). The check is one pass: the newest random op each node depends on."""
    newest: dict = {}
    count = 0
    for node in gm.graph.nodes:
        before = max((newest.get(a, -1) for a in node.all_input_nodes), default=-1)
        if node.op == "call_function" and tp.draws_random_numbers(node):
            if before != count - 1:
                return (f"random op {node.target} does not depend on the one before it: inductor could "
                        f"reorder their draws, which would not give eager's numbers")
            before = count
            count += 1
        newest[node] = before
    return ""


def graphs_device(graphs: Sequence[Optional[torch.fx.GraphModule]]) -> Optional[torch.device]:
    """The accelerator the graphs' inputs live on (the first placeholder off the CPU), None for
    CPU graphs."""
    for gm in graphs:
        for node in (gm.graph.nodes if gm is not None else ()):
            val = node.meta.get("val")
            if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.device.type not in ("cpu", "meta"):
                return val.device
    return None


def use_graphs_device(graphs: Sequence[Optional[torch.fx.GraphModule]]) -> None:
    """Make the graphs' device this thread's current accelerator (``torch.accelerator``, any
    backend): the worker process and the loading thread start on device 0, and inductor creates its
    context, loads its kernels and autotunes on the current device. Under torchrun/DDP, where rank r
    trains on device r, each rank's worker then uses its rank's device, not the first one's memory."""
    device = graphs_device(graphs)
    if device is not None and device.index is not None:
        torch.accelerator.set_device_index(device.index)


def _lean(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy keeping only the fake values the compile needs (placeholders) and the absent-gradient
    specialisation reads (adds and their operands): stack traces and every node's fake value would
    make the pickle several times larger and slower."""
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    env: dict = {}
    graph.output(graph.graph_copy(gm.graph, env))
    keep = values_read(gm)
    for old, new in env.items():
        new.meta = {"val": old.meta["val"]} if old in keep and "val" in old.meta else {}
    return torch.fx.GraphModule(gm, graph)


def _outputs(gm: torch.fx.GraphModule) -> List[torch.fx.Node]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _saved_outputs(spec: Any, fw: torch.fx.GraphModule) -> List[int]:
    """Forward outputs the backward takes first, in its order (runtime/replay.py: sizes, then the
    saved tensors, checked and unchecked)."""
    n = len(_outputs(fw))
    return [i for s in (spec.symints, spec.saved, spec.saved_no_check) for i in range(*s.indices(n))]


def _compile_all(fw: torch.fx.GraphModule, bw: Optional[torch.fx.GraphModule], inference: bool,
                 cached_only: bool) -> Tuple[Callable[..., Any], Optional[AbsentGradBackward]]:
    with tp.inductor_eager_random():
        forward = inductor_compile_graph(fw, "inference" if inference else "forward", cached_only=cached_only)
        if bw is None:
            return forward, None
        backward = AbsentGradBackward(bw, lambda g: inductor_compile_graph(g, "backward", cached_only=cached_only))
        backward.compile_ahead()
    # A pattern not compiled ahead runs as the eager executor would: generating code for it here
    # would stop the training loop (and rewind the random generator off the main thread).
    backward.compile = lambda g: tp.boxed_copy(g).forward
    return forward, backward


class TierMaker:
    """What ``runner.build`` gets as ``tiered`` for one capture, live or a cache hit: it wraps the
    core in a Tier and keeps it (``made``) for the capture's record."""

    def __init__(self, step: Any, options: Any, owner: str, alive: Callable[[], bool]) -> None:
        self.step, self.options, self.owner, self.alive = step, options, owner, alive
        self.made: Optional[Tier] = None

    def __call__(self, core: Callable[..., Any]) -> "Tier":
        self.made = Tier(self.step, core, self.options.compile_timeout, self.owner, self.options.compile_after,
                         self.alive)
        return self.made


class SizeGuards:
    """The sizes inductor specialised the loaded graphs on (module docstring): a check of a call's
    graph inputs, and the guards as text for ``capture_info()``."""

    def __init__(self, check: Callable[[Sequence[Any]], bool], text: str) -> None:
        self.check, self.text = check, text
        self.failed = 0    # calls whose sizes failed them (run on the eager executor)


def _sizes(val: Any) -> Tuple[Any, ...]:
    return tuple(val.shape) if isinstance(val, torch.Tensor) else (val,)


def _pinned(captured: torch.fx.GraphModule, loaded: torch.fx.GraphModule) -> List[Tuple[int, Optional[int], Any, int]]:
    """Sizes symbolic in the capture's graph and concrete in the graph loaded from the worker (the
    worker's retrace or compile specialised them: a decomposition that reads a whole ``size()``
    does): (placeholder index, dimension or None for a SymInt input, the captured size, the value)."""
    pinned = []
    pairs = zip((n for n in captured.graph.nodes if n.op == "placeholder"),
                (n for n in loaded.graph.nodes if n.op == "placeholder"))
    for i, (old, new) in enumerate(pairs):
        was, now = old.meta.get("val"), new.meta.get("val")
        for d, (a, b) in enumerate(zip(_sizes(was), _sizes(now))):
            if isinstance(a, torch.SymInt) and isinstance(b, int):
                pinned.append((i, d if isinstance(was, torch.Tensor) else None, a, b))
    return pinned


def _pinned_check(step: Any, fw: torch.fx.GraphModule, bw: Optional[torch.fx.GraphModule]) -> Tuple[Callable[[Sequence[Any]], bool], str]:
    """A check that a call's forward inputs have the sizes the loaded graphs were specialised to.
    A specialised size of the backward's inputs that the forward's do not pin (a data-dependent
    row count) cannot be checked ahead: RuntimeError."""
    fixed = _pinned(step.forward_graph, fw)
    symbols = {tp.size_expr(size) for _, _, size, _ in fixed}
    if bw is not None and step.backward_graph is not None:
        for _, _, size, value in _pinned(step.backward_graph, bw):
            if not tp.size_expr(size).free_symbols <= {s for e in symbols for s in e.free_symbols}:
                raise RuntimeError(f"the worker specialised a size the graph inputs do not determine ({tp.size_expr(size)} = {value})")
    want = [(i, d, value) for i, d, _, value in fixed]

    def check(args: Sequence[Any]) -> bool:
        return all((args[i] if d is None else args[i].shape[d]) == value for i, d, value in want)
    return check, ", ".join(f"Eq({tp.size_expr(size)}, {value})" for _, _, size, value in fixed)


def compiled_from(payload: bytes, step: Any) -> Tuple[Callable[..., Any], Optional[SizeGuards]]:
    """The compiled core of ``step`` from a worker's payload (its retraced graphs), loaded from
    inductor's on-disk cache only (no code generation here: ``NotInInductorCache`` on a miss), and
    the guards on sizes that loading added (None if none)."""
    fw, bw = tp.unpickle_graphs(payload, tp.FakeTensorMode(shape_env=ShapeEnv()))
    use_graphs_device((fw, bw))     # this runs on a thread of its own
    env = tp.shape_env_of((fw, bw))
    known = len(tp.shape_guards(env)) if env is not None else 0
    with tp.dynamo_compile_lock():
        forward, backward = _compile_all(fw, bw, step.inference, cached_only=True)
    core = replayed(forward, backward, step.spec)
    pinned, pinned_text = _pinned_check(step, fw, bw)
    added = tp.shape_guards(env)[known:] if env is not None else []
    if not added and not pinned_text:
        return core, None
    text = ", ".join(t for t in (pinned_text, ", ".join(str(g.expr) for g in added)) if t)
    guarded = pinned
    if added:
        try:
            shapes = tp.size_guard_check(env, tp.placeholder_examples(fw), added)
        except Exception as e:
            raise RuntimeError(f"inductor specialised sizes the graph inputs do not determine ({text}): "
                               f"{(str(e).strip() or type(e).__name__).splitlines()[0]}") from None
        guarded = lambda args: pinned(args) and shapes(args)   # noqa: E731
    return core, SizeGuards(guarded, text)


class Tier:
    """Which code runs one capture: the eager executor's until the compiled graphs are loaded.

    Runtime state, kept apart from the CapturedStep (which stays what capture made): the live
    callable, the one waiting to replace it, and what ``capture_info()`` reports."""

    def __init__(self, step: Any, eager: Callable[..., Any], timeout: float, owner: str, after: float,
                 alive: Callable[[], bool]) -> None:
        self.state = "eager"            # "eager" | "compiling" | "compiled"
        self.reason = ""                # why it stays on the eager executor
        self.since_step: Optional[int] = None
        self.compile_seconds: Optional[float] = None
        self.calls = 0
        self.owner = owner
        # Whether the TrainModule is still there: dynamo's code cache keeps this Tier (and its
        # graphs) alive after the user drops the module, and a compile for it would only hold the
        # one worker from the captures still in use.
        self._alive = alive
        self.step_seconds: Optional[Tuple[float, float]] = None   # (eager, compiled) medians, once measured
        self._live: Callable[..., Any] = eager
        self._eager: Optional[Callable[..., Any]] = eager
        self._timing = True
        self._last: Optional[float] = None
        self._first: Optional[float] = None   # when the capture first ran (Options.compile_after counts from it)
        self._after = after
        self._eager_times: Optional[List[float]] = None   # from when the compiled graphs are ready
        self._pending: Optional[Tuple[Any, float]] = None   # (step, timeout) until the thread starts
        self._compiled_times: List[float] = []
        self._next: Optional[Callable[..., Any]] = None
        self._done = threading.Event()
        # The worker's graphs once compiled, and who keeps them when the compiled tier wins its trial
        # (cache/session.py stores them beside the cache entry: a later process starts on them).
        self.payload: Optional[bytes] = None
        self._stored: Optional[bytes] = None   # an earlier run's payload, loaded instead of compiling
        self.on_kept: Optional[Callable[["Tier"], None]] = None
        self.size_guards: Optional[SizeGuards] = None   # what inductor specialised the loaded graphs on
        self.from_cache = False
        why = stays_eager(step)
        if why:
            self.reason = why
            self._timing = False
            self._done.set()
            return
        self.reason = f"its compile starts {after:g} s after its first call (Options.compile_after)"
        # Started at the second call at the earliest: the first step (capture included) stays the
        # eager executor's, with no thread pickling graphs or process starting beside it.
        self._pending = (step, timeout)

    def __call__(self, *args: Any) -> Any:
        if self._timing:
            self._tick()
        self.calls += 1
        return self._live(*args)

    def _start(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self.state, self.reason = "compiling", ""
        if pending is not None and self._stored is not None:
            self._thread(self._load_stored, (self._stored, *pending), "load")
        elif pending is not None:
            logger.info("%s: compiling its graphs with inductor in the background (call %d)", self.owner, self.calls)
            self._thread(self._compile, pending, "compile")

    def _thread(self, target: Callable[..., None], args: Tuple[Any, ...], what: str) -> None:
        threads.start(target, *args, name=f"fxtrain-{what}-{self.owner}")

    def _tick(self) -> None:
        """Time between this capture's calls (a training step) on each tier, back to back once the
        compiled graphs are ready (same load, no pause for the compile in the eager sample): they
        stay only if they are not slower (a code generator loses on some small models: the MLP in
        docs/benchmarks.md)."""
        now = time.perf_counter()
        if self._first is None:
            self._first = now
        # A stored payload loads without a worker: at once. A compile waits Options.compile_after.
        if self._pending is not None and self.calls >= 1 and (self._stored is not None or now - self._first >= self._after):
            self._start()
        if self._last is not None and self._eager_times is not None:
            (self._compiled_times if self.state == "compiled" else self._eager_times).append(now - self._last)
        self._last = now
        if self._next is None:
            if self.state == "compiled" and len(self._compiled_times) > TRIAL_STEPS:
                self._decide()
            return
        if self.from_cache:                           # an earlier run's trial kept them: no second one
            self._live, self._next = self._next, None
            self.state, self.since_step, self._timing = "compiled", self.calls, False
            logger.info("%s: step %d runs an earlier run's compiled graphs", self.owner, self.calls)
        elif self._eager_times is None:               # ready: time the eager executor from here
            self._eager_times = []
        elif len(self._eager_times) >= TRIAL_STEPS:
            self._live, self._next = self._next, None
            self.state, self.since_step = "compiled", self.calls
            self._compiled_times = [-1.0]   # the first compiled step warms up: not counted
            logger.info("%s: step %d runs inductor's graphs (compiled in %.1f s)", self.owner, self.calls,
                        self.compile_seconds or 0.0)

    def _decide(self) -> None:
        eager = statistics.median(self._eager_times or [0.0])
        compiled = statistics.median(self._compiled_times[1:])
        self._timing = False
        self.step_seconds = (eager, compiled)
        self._eager_times = self._compiled_times = []
        if compiled > eager * SLOWER:
            self._live, self._eager = self._eager, None
            self.state = "eager"
            self.reason = (f"inductor's graphs measured slower: {compiled * 1e3:.3g} ms per step against "
                           f"{eager * 1e3:.3g} ms (median of {TRIAL_STEPS} steps each)")
            logger.info("%s: %s; back on the eager executor", self.owner, self.reason)
        elif self.on_kept is not None:
            self.on_kept(self)

    def start_compiled(self, payload: bytes) -> bool:
        """A warm start: the compiled graphs an earlier process kept after its trial (``payload``:
        that worker's graphs, stored beside the cache entry) are loaded from inductor's on-disk cache
        on a thread, with no worker, and run from the call after they are ready, with no second
        trial. The thread starts at the second call, as the worker would: loading costs seconds
        (importing inductor alone is ~2 s) and, beside the first step, would slow it by more than
        that (GIL and cores shared: gpt2-dense's warm first step 15 s against eager's 9 s at load 5).
        Where inductor's cache no longer has them (another machine, a cleared /tmp, another torch),
        the usual compile."""
        if self._pending is None:
            return False
        self._stored, self.from_cache = payload, True
        self.state, self.reason = "compiling", ""
        return True

    def _load_stored(self, payload: bytes, step: Any, timeout: float) -> None:
        started = time.perf_counter()
        try:
            core = self._guarded(*compiled_from(payload, step))
        except Exception as e:
            logger.info("%s: an earlier run's compiled graphs could not be loaded (%s); compiling them again",
                        self.owner, (str(e).strip() or type(e).__name__).splitlines()[0])
            self.from_cache = False
            self._compile(step, timeout)
            return
        self.payload, self.compile_seconds, self._next = payload, time.perf_counter() - started, core
        self._done.set()

    def _guarded(self, core: Callable[..., Any], guards: Optional[SizeGuards]) -> Callable[..., Any]:
        """``core``, or where loading added guards on sizes, a callable that runs it on the calls
        whose sizes meet them and the eager executor's core on the others."""
        self.size_guards = guards
        if guards is None:
            return core
        eager, check = self._eager, guards.check

        def run(*args: Any) -> Any:
            if check(args):
                return core(*args)
            guards.failed += 1
            return eager(*args)
        return run

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the compile has finished (or failed); True if it has. The switch itself
        happens at the next call."""
        self._start()
        return self._done.wait(timeout)

    def __str__(self) -> str:
        guarded = "" if self.size_guards is None else \
            f"; sizes outside its guards ({self.size_guards.text}) run eagerly: {self.size_guards.failed} call(s) so far"
        if self.state == "compiled" and self.from_cache:
            return (f"inductor since step {self.since_step} (an earlier run's compiled graphs, loaded in "
                    f"{self.compile_seconds:.2f} s{guarded})")
        if self.state == "compiled":
            measured = "" if self.step_seconds is None else \
                f"; {self.step_seconds[1] * 1e3:.3g} ms per step against eager's {self.step_seconds[0] * 1e3:.3g} ms"
            return f"inductor since step {self.since_step} (compiled in {self.compile_seconds:.1f} s{measured}{guarded})"
        if self.state == "compiling":
            return ("eager, compiled graphs ready for the next step" if self._next is not None
                    else "eager, loading an earlier run's compiled graphs" if self.from_cache
                    else "eager, compiling in the background")
        return f"eager: {self.reason}"

    def _compile(self, step: Any, timeout: float) -> None:
        with _one_worker:
            if not self._alive():
                self._gone()
                return
            self._compile_alone(step, timeout)

    def _gone(self) -> None:
        self.state, self.reason, self._timing = "eager", "its TrainModule is gone: compile not run", False
        logger.info("%s: %s", self.owner, self.reason)
        self._done.set()

    def _compile_alone(self, step: Any, timeout: float) -> None:
        start = time.perf_counter()
        try:
            _sweep_orphans()
            with tempfile.TemporaryDirectory(prefix=f"{_TMP_PREFIX}{os.getpid()}-") as tmp:
                given, made = Path(tmp) / "graphs.in", Path(tmp) / "graphs.out"
                bw = step.backward_graph if not step.inference else None
                given.write_bytes(tp.pickle_graphs((_lean(step.forward_graph), _lean(bw) if bw is not None else None,
                                                    _saved_outputs(step.spec, step.forward_graph)),
                                                   for_another_process=True))
                self._run_worker(given, made, step.inference, timeout - (time.perf_counter() - start), self._alive)
                payload = made.read_bytes()
            core = self._guarded(*compiled_from(payload, step))
            self.payload = payload
        except Exception as e:   # never the training loop's problem: it goes on eagerly
            if threads.exiting.is_set():
                return
            if isinstance(e, _OwnerGone):
                self._gone()
                return
            self.state, self.reason = "eager", f"the background compile failed: {(str(e).strip() or type(e).__name__).splitlines()[0]}"
            self._timing = False
            logger.warning("fxtrain: %s: %s; this capture stays on the eager executor", self.owner, self.reason)
        else:
            self.compile_seconds = time.perf_counter() - start
            self._next = core
        finally:
            self._done.set()

    @staticmethod
    def _run_worker(given: Path, made: Path, inference: bool, timeout: float, alive: Callable[[], bool]) -> None:
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]))
        # Inductor's cache key holds the intra-op thread count its C++ code is generated for.
        cmd = threads.worker_command("fxtrain.runtime.tiered", str(given), str(made), "1" if inference else "0",
                                     str(torch.get_num_threads()), owned=str(given.parent))
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        _workers.add(proc)
        deadline = time.perf_counter() + max(timeout, 0.0)
        try:
            while True:   # polled each second: a worker whose TrainModule is gone is stopped
                try:
                    _, err = proc.communicate(timeout=max(min(1.0, deadline - time.perf_counter()), 0.0))
                    break
                except subprocess.TimeoutExpired:
                    gone = not alive()
                    if gone or time.perf_counter() >= deadline:
                        proc.kill()
                        proc.communicate()
                        if gone:
                            raise _OwnerGone() from None
                        raise TimeoutError(f"compile_timeout exceeded ({timeout:.3g} s)") from None
        finally:
            _workers.discard(proc)
        if proc.returncode != 0:
            lines = [ln for ln in err.decode(errors="replace").splitlines() if ln.strip()]
            raise RuntimeError(f"worker exited with {proc.returncode}: {_exception_line(lines)}")


def _exception_line(lines: Sequence[str]) -> str:
    """The worker's exception as Python printed it (``module.Type: message``) from its stderr:
    torch's errors end with advice ("Use tlparse to see full graph."), which said nothing of why."""
    said = [ln for ln in lines if re.match(r"[A-Za-z_][\w.]*: \S", ln)]
    return said[-1] if said else lines[-1] if lines else "no message"


# Ops the worker's retrace keeps whole (inductor lowers each itself): the backward ops fxtrain's
# passes rewrite around, and constant_pad_nd, whose decomposition reads its input's whole size()
# and so pinned a symbolic capture to its sample sizes (the shifted labels of an HF causal-LM loss:
# the packed Llama compiled for its first batch's [2, 24] only). The passes ran at capture: what
# they left whole is then decomposed call by call, where the batch's sizes allow
# (``tp.decompose_calls``; passes/__init__.py: run_backward_passes says why).
RETRACE_KEEPS = (*tp.BACKWARD_PASS_OPS, torch.ops.aten.constant_pad_nd.default)


def _zero_pads_as_copies(gm: torch.fx.GraphModule) -> None:
    """``constant_pad_nd`` with every pad 0 is a copy (its kernel returns ``clone``): HF Swin pads
    its feature maps to whole windows, by 0 where they already fit. Kept whole in the retrace
    (``RETRACE_KEEPS``), its kernel reads the input's sizes as integers on fake tensors, which pinned
    Swin's symbolic batch to the sample's; as ``clone`` it stays symbolic."""
    for node in gm.graph.nodes:
        if (node.op == "call_function" and node.target is torch.ops.aten.constant_pad_nd.default
                and all(isinstance(p, int) and p == 0 for p in node.args[1])):
            node.target, node.args, node.kwargs = torch.ops.aten.clone.default, (node.args[0],), {}
    gm.recompile()


def _worker(argv: Sequence[str]) -> None:
    """The worker process: retrace with inductor's decompositions, compile, write the graphs the
    parent is to load (pickled, then compiled as unpickled, so its cache keys are the parent's)."""
    given, made, inference = Path(argv[0]), Path(argv[1]), argv[2] == "1"
    torch.set_num_threads(int(argv[3]))
    fw, bw, saved = tp.unpickle_graphs(given.read_bytes(), tp.FakeTensorMode(shape_env=ShapeEnv()))
    use_graphs_device((fw, bw))
    with tp.inductor_eager_random():   # dropout kept whole, to run eager's kernel
        whole = InductorExecutor().decompositions(keep=())
    table = {op: fn for op, fn in whole.items() if op not in RETRACE_KEEPS}
    random = [n.target for n in fw.graph.nodes if n.op == "call_function" and tp.draws_random_numbers(n)]
    _zero_pads_as_copies(fw)
    fw = tp.retrace(fw, table)
    now = [n.target for n in fw.graph.nodes if n.op == "call_function" and tp.draws_random_numbers(n)]
    if now != random or _random_order(fw):
        raise RuntimeError(f"the retrace changed the random ops ({random} -> {now}): not eager's numbers")
    if bw is not None:
        # Inductor gives the forward's outputs the strides of the retraced graph's values
        # (decompositions may lay them out otherwise than the aten ops did): the backward is traced
        # and compiled for the saved tensors as the compiled forward will hand them over.
        # A size the retrace pinned (``_pinned``) comes out as a plain int.
        outs = [o.meta.get("val") if isinstance(o, torch.fx.Node) else o for o in _outputs(fw)]
        examples = tp.placeholder_examples(bw)
        examples[:len(saved)] = [outs[i] for i in saved]
        _zero_pads_as_copies(bw)
        bw = tp.retrace(bw, table, examples)
        tp.decompose_calls(bw, tp.BACKWARD_PASS_OPS, whole)
    payload = tp.pickle_graphs((_lean(fw), _lean(bw) if bw is not None else None))
    fw, bw = tp.unpickle_graphs(payload, tp.FakeTensorMode(shape_env=ShapeEnv()))
    _compile_all(fw, bw, inference, cached_only=False)
    made.write_bytes(payload)


if __name__ == "__main__":   # at nice 19 (threads.worker_command): its C++ compiler processes inherit it
    _worker(sys.argv[1:])
