"""The kernel's view of a step's peak memory, shared by the memory benchmarks.

Tensor counters miss what generated code and allocator caches hold; the resident set does not. With
glibc serving every allocation above 64 kB by mmap (``CHILD_ENV``, set before the measuring process
starts) freed tensors leave the resident set at once, so RSS follows live memory, and resetting the
peak-RSS mark (``/proc/self/clear_refs``) right before a step makes ``VmHWM`` that step's peak.
Linux only.
"""
from __future__ import annotations

import os
from typing import Callable, Dict

CHILD_ENV: Dict[str, str] = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")


def status(field: str) -> int:
    """A byte count from ``/proc/self/status`` (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as s:
        for line in s:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def added_at_peak(run: Callable[[], object]) -> int:
    """Bytes ``run()`` added to the resident set at its highest, over what was resident before it."""
    with open("/proc/self/clear_refs", "w") as c:
        c.write("5")
    before = status("VmRSS")
    run()
    return status("VmHWM") - before
