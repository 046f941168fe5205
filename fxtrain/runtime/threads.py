"""The runtime's background threads (a capture's partition, a tier's compile or load), joined at exit,
and the command that starts their worker processes.

A thread left inside torch's C++ code while the interpreter finalises can end the process with
"terminate called without an active exception": each gets a moment to return (5 s in all).
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, List, Optional, Set

exiting = threading.Event()   # set at exit: what a thread fails at from then on is nobody's problem
_threads: Set[threading.Thread] = set()
_at_exit: List[Callable[[], None]] = []   # run first at exit (the tiers kill their workers)


def start(target: Callable[..., None], *args: Any, name: str) -> threading.Thread:
    def run() -> None:
        try:
            target(*args)
        finally:
            _threads.discard(thread)
    thread = threading.Thread(target=run, daemon=True, name=name)
    _threads.add(thread)
    thread.start()
    return thread


def worker_command(module: str, *args: str, owned: Optional[str] = None) -> List[str]:
    """``python -m module args`` at nice 19, set before the module imports torch (~3 s of a core).
    The training loop's cores first: at the default priority the partition worker took a core from
    the loop's intra-op threads, and 20 bert-mlm steps on 2 cores took 12.4 s instead of 6.4 s
    (docs/architecture.md, "Decisions and why": the partition in a worker process).
    A worker whose parent is gone (killed: no atexit ran to stop it) exits within a second, as
    nobody will read what it makes: a thread watches its parent's pid, since a compile reads no
    pipe that would tell it. An orphaned worker removes the directory ``owned`` (its parent's files
    for it, which the parent's own cleanup would have removed) as it exits, from the watch or after
    finishing its work, and again while it is still there: the work may write its result into it
    while the watch removes it. The parent's pid is written into the command, not read by the worker
    with ``os.getppid()`` as it starts: a parent killed before that (the worker starts at nice 19,
    slowly on a busy machine) would leave the worker reading its new parent's pid, never orphaned,
    and the directory behind once its compile ended (two make test-long runs on 2026-11-29 found it).
    ``sys.argv[1:]`` are ``args``, as with ``-m``. The worker imports this process's fxtrain: its
    folder goes first on the path, before the current directory that ``-c`` puts there (started
    from another checkout's root, a worker imported that checkout's fxtrain, whose payload format
    differed: "JSONDecodeError" in an A/B run of bench/overhead.py)."""
    start = (f"import os, runpy, shutil, sys, threading, time\nif hasattr(os, 'nice'):\n    os.nice(19)\n"
             f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
             f"parent = {os.getpid()}\n"
             f"def _orphaned():\n"
             f"    if os.getppid() == parent:\n        return False\n"
             f"    for _ in range(5 if {owned!r} else 0):\n"
             f"        shutil.rmtree({owned!r}, ignore_errors=True)\n"
             f"        if not os.path.exists({owned!r}):\n            break\n"
             f"        time.sleep(0.1)\n"
             f"    return True\n"
             f"def _watch():\n"
             f"    while not _orphaned():\n        time.sleep(1.0)\n    os._exit(1)\n"
             f"threading.Thread(target=_watch, daemon=True).start()\n"
             f"try:\n    runpy.run_module({module!r}, run_name='__main__')\nfinally:\n    _orphaned()")
    return [sys.executable, "-c", start, *args]


def on_exit(hook: Callable[[], None]) -> None:
    _at_exit.append(hook)


@atexit.register
def _join() -> None:
    exiting.set()
    for hook in _at_exit:
        hook()
    deadline = time.monotonic() + 5.0
    for thread in list(_threads):
        thread.join(max(deadline - time.monotonic(), 0.0))
