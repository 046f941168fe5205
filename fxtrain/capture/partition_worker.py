"""The partition stage in a worker process, for captures whose first calls run in the autograd mode
(runtime/pending.py). Why a process and not a thread: ``make_fx`` sets FX's tracing flag and patches
``nn.Module.__call__`` for the whole process while it traces, so the training loop's next
TrainModule call (or any ``torch.compile`` of the user's) would refuse to run beside it, and the
trace would hold the GIL the loop's op calls need.

One worker per process, started at the first request and kept: a new one imports torch again
(~3 s). Requests are served one at a time over its stdin and a copy of its stdout: the rewritten
torch-level graph pickled without fake values (placeholders' shapes, strides, dtypes, devices and
requires_grad beside it: the worker makes its own fake inputs, in a shape environment of its own),
the executor's name and the autocast contexts in force at capture; back come the aten graphs, the
ReplaySpec and the pass reports (pickled), or the error's last line. Measured on bert-mlm: 0.05 s to
pickle, 3.2-4.0 s to partition, 0.15 s to load the answer, graphs and spec identical to an
in-process partition (docs/benchmarks.md). It runs at nice 19 (``threads.worker_command``).
"""
from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, List, Optional, Tuple

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from .. import torch_private as tp
from ..runtime import threads
from ..runtime.lean_meta import lean_meta

logger = logging.getLogger("fxtrain")
# A partition still running after this long is stuck (bert-mlm's takes ~4 s): the worker is killed,
# the capture keeps the autograd mode. Not Options.compile_timeout, which bounds code generation.
TIMEOUT = 600.0
Placeholder = Tuple[Tuple[int, ...], Tuple[int, ...], torch.dtype, str, bool]
Autocast = Tuple[Tuple[str, torch.dtype, bool], ...]   # device type, dtype, cache_enabled
_lock = threading.Lock()
_proc: Optional[subprocess.Popen] = None


def placeholders(example_inputs: List[Any]) -> List[Placeholder]:
    return [(tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device), t.requires_grad) for t in example_inputs]


def autocast_now(device_types: List[str]) -> Autocast:
    """The autocast contexts on this thread for ``device_types``. AOTAutograd's trace bakes their
    casts into the aten graphs, and dynamo's guards tie a capture to them, so the worker traces
    under the same ones (its own thread's state would be none)."""
    cache = torch.is_autocast_cache_enabled()
    return tuple((kind, torch.get_autocast_dtype(kind), cache) for kind in sorted(set(device_types))
                 if kind != "meta" and torch.is_autocast_enabled(kind))


def request(graph: torch.fx.GraphModule, example_inputs: List[Any], executor: str) -> Optional[bytes]:
    """What the worker is to partition, or None where the graph does not pickle (an object of the
    user's among its constants) or the worker could not load it (a custom op defined in
    ``__main__``: ``torch_private.only_here``): the capture then partitions in this process."""
    autocast = autocast_now(["cpu", *(t.device.type for t in example_inputs)])
    try:
        with lean_meta(graph, keep_values=False):
            return tp.pickle_graphs((graph, placeholders(example_inputs), executor, autocast), for_another_process=True)
    except Exception as e:
        logger.debug("partitioned at capture: the worker could not load the graph (%s)", e)
        return None


def partition(payload: bytes, timeout: float = TIMEOUT) -> bytes:
    """The worker's answer to ``payload`` (RuntimeError with its message if it failed; a worker
    still at it after ``timeout`` seconds is killed, and the next request starts another)."""
    global _proc
    with _lock:
        if _proc is None or _proc.poll() is not None:
            _close(_proc)
            root = str(Path(__file__).resolve().parents[2])
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
            _proc = subprocess.Popen(threads.worker_command("fxtrain.capture.partition_worker"), env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        proc = _proc
        assert proc.stdin is not None and proc.stdout is not None
        late = threading.Timer(timeout, proc.kill)
        late.daemon = True
        late.start()
        try:
            _send(proc.stdin, payload)
            answer = _receive(proc.stdout)
        except (OSError, EOFError) as e:
            proc.kill()
            why = f"it took over {timeout:g} s" if not late.is_alive() else type(e).__name__
            raise RuntimeError(f"the partition worker ended: {why}") from None
        finally:
            late.cancel()
    if answer[:1] != b"\0":
        raise RuntimeError(answer[1:].decode(errors="replace"))
    return answer[1:]


def _close(proc: Optional[subprocess.Popen]) -> None:
    """Ends ``proc`` and closes its pipes: a worker left with open pipes made Python print
    "ResourceWarning: unclosed file" at the exit of every process that had one."""
    if proc is None:
        return
    proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:   # a write the dead worker never read: nothing to flush to
                pass


def _stop() -> None:
    _close(_proc)


threads.on_exit(_stop)


def _send(stream: BinaryIO, data: bytes) -> None:
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def _receive(stream: BinaryIO) -> bytes:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    return stream.read(int.from_bytes(head, "little"))


def _answer(payload: bytes) -> bytes:
    from ..options import Options
    from ..passes import DynamoExamples
    from ..runtime.executors import executor_named
    from .pipeline import CaptureContext, partition as partition_stage
    mode = tp.FakeTensorMode(shape_env=ShapeEnv())
    graph, metas, executor, autocast = tp.unpickle_graphs(payload, mode)
    tp.forget_dynamo_sources(graph)
    graph.recompile()
    with mode:
        examples = [torch.empty_strided(shape, stride, dtype=dtype, device=device).requires_grad_(grad)
                    for shape, stride, dtype, device, grad in metas]
    started = time.process_time()
    with tp.tracing_context(mode), contextlib.ExitStack() as contexts:
        for kind, dtype, cache in autocast:
            contexts.enter_context(torch.autocast(kind, dtype=dtype, cache_enabled=cache))
        parts = partition_stage(graph, examples, CaptureContext(Options(), executor_named(executor), DynamoExamples()))
    cpu = time.process_time() - started
    fw, bw = parts.forward_graph, parts.backward_graph
    with lean_meta(fw, keep_values=False, every_fake=True), lean_meta(bw, keep_values=True, every_fake=True):
        return tp.pickle_graphs((fw, bw, parts.inference, parts.spec, parts.not_replayable,
                                 parts.forward_reports, parts.backward_reports, cpu))


def _serve() -> None:
    protocol = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)   # whatever prints goes to stderr, not into the answers
    torch.set_num_threads(1)
    while True:
        try:
            payload = _receive(sys.stdin.buffer)
        except EOFError:
            return
        try:
            answer = b"\0" + _answer(payload)
        except Exception as e:
            answer = b"\1" + f"{type(e).__name__}: {(str(e).strip() or '').splitlines()[0] if str(e).strip() else ''}".encode()
        _send(protocol, answer)


if __name__ == "__main__":
    _serve()
