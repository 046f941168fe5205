"""The default sizes policy (``Options.dynamic=None``): which sizes a capture makes symbolic.

A call schema runs from a static entry until a call brings other sizes; from then on it runs from a
symbolic entry (``dynamic=True``), whose captures keep symbolic the input dimensions seen to change
and the leading (batch) dimension of every input, and mark every other input dimension static
(``marks``: set only while dynamo compiles, taken back after).

Why not every size: symbolic reasoning about sizes that never change can cost minutes (HF Swin's
window partition on a symbolic image size: sympy simplifying ever larger floor divisions), for a
graph no more general than needed. A dimension whose reasoning proves expensive anyway is stopped
by the watchdog (capture/watch.py) and kept static from then on (``keep_expensive_static``). Why
the batch dimension even unchanged: it is the size most likely to change next (the last batch of an
epoch) and the cheapest to keep symbolic, so one recapture usually serves the run. Why not dynamo's
automatic dynamic shapes on the static entry, which also makes only changed dimensions symbolic: it
works per code object, so a function dynamo first meets later (the code after a graph break that only
symbolic sizes expose) starts static again, and a model with graph breaks recaptures on sizes it has
already run (HF Longformer); under the ``dynamic=True`` entry such later frames are symbolic from
their first capture (only the entry frame's inputs carry static marks).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, FrozenSet, Hashable, List, Optional, Sequence, Tuple

import torch

from ..capture_state import is_entry_frame
from .inputs import call_sizes, call_tensors, changed_dims, describe_dims, leading_dims

Dims = FrozenSet[Tuple[int, int]]   # (input tensor index in call_schema order, dimension)

# Image height and width (every dimension after the channels of a floating input of rank 4 or more)
# stay static for this many distinct sizes: a capture per image size until then. Why: training
# changes image sizes rarely and among few values (multi-scale augmentation, a last odd
# resolution), while symbolic reasoning about them is the costly kind: HF ViT's position-embedding
# interpolation made symbolic took 3.5x its first capture where a static capture at the new size
# took 1.5x, and HF Swin's window partition stalled in sympy. Past this many sizes one symbolic
# capture beats a capture per size (and keeps clear of Options.recompile_limit).
IMAGE_SIZES_STATIC = 3


def image_dims(tensors: Sequence[Tuple[str, torch.Tensor]]) -> Dims:
    """(tensor index, dimension) of the spatial dimensions of image-like inputs (N, C, H, W[, ...])."""
    return frozenset((i, d) for i, (_, t) in enumerate(tensors)
                     if t.dim() >= 4 and t.is_floating_point() for d in range(2, t.dim()))


class SizesPolicy:
    """One per TrainModule. ``switch`` says why the current call captured (for capture_reasons);
    ``call`` is the call dynamo may compile from the symbolic entry, held for that call only."""

    def __init__(self, static_first: bool) -> None:
        self.static_first = static_first
        self.first: Dict[Hashable, Tuple[Tuple[Any, ...], Hashable]] = {}   # key -> (shapes, call_sizes)
        self.symbolic: Dict[Hashable, Dims] = {}     # keys on the symbolic entry -> their symbolic dims
        self.expensive: Dict[Hashable, Dims] = {}    # key -> dims whose symbolic reasoning proved expensive
        self.image_sizes: Dict[Hashable, Dict[Tuple[int, int], set]] = {}   # key -> image dim -> sizes captured
        self.broken: set = set()                     # keys whose captures broke the graph
        # key -> the symbolic entry's captures: their sizes and symbolic dims (``_symbolic_serves``)
        self.captured: Dict[Hashable, List[Tuple[Tuple[Any, ...], Dims]]] = {}
        self.first_compile_seconds: Optional[float] = None
        # The CPU seconds of the first capture's partition, made later by the worker
        # (runtime/pending.py), once every such partition is back; None while one is out.
        self.later_partitions: Optional[Callable[[], Optional[float]]] = None
        self.switch: Optional[str] = None
        self.call: Optional[Tuple[Hashable, Tuple[Any, ...], Tuple[Any, ...], Dict[str, Any]]] = None

    def served(self, key: Hashable, shapes: Tuple[Any, ...], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """A cached graph served this call: its sizes are what a later size change is measured against."""
        if key not in self.first:
            self.first[key] = (shapes, call_sizes(args, kwargs))

    def use_symbolic(self, key: Hashable, shapes: Tuple[Any, ...], args: Tuple[Any, ...], kwargs: Dict[str, Any],
                     resized: bool) -> bool:
        """Whether this call runs from the symbolic entry. ``resized``: a cached graph served the
        first sizes and stopped serving (dynamo never saw them)."""
        self.switch = None
        if not self.static_first:
            return False
        first = self.first.get(key)
        if first is None:
            first = self.first[key] = (shapes, call_sizes(args, kwargs))
        if key not in self.symbolic and (resized or first[0] != shapes):
            self.symbolic[key] = frozenset()
            if first[0] == shapes:
                self.switch = "a cached graph served the first sizes and stopped serving"
        if key not in self.symbolic:
            return False
        # The first sizes go back to the static entry, which captured them, only where no capture
        # on the symbolic entry serves them (``_symbolic_serves``): dynamo specialises sizes 0 and 1,
        # so a symbolic dimension that was 0 or 1 would capture them a second time, and a size that
        # changed but stays static there (an image size among its first few, one whose symbolic
        # reasoning proved expensive) is a capture per size (HF Swin, 4x32 images after 3x48 had
        # captured 4x32 a third time). Where one serves them it does, since the static graph's
        # guards may no longer hold (HF classifiers set config.problem_type on their first call).
        # Never in a schema whose captures broke the graph: the frames it compiled apart were
        # compiled again under the symbolic entry, and their static versions no longer match
        # (dynamo guards each function on the entry it was compiled under; HF Longformer recaptured
        # 19 graphs). A break in another schema's capture does not count: this schema's calls never
        # run the frames it made (HF's output_hidden_states=True breaks at its hooks).
        if (shapes == first[0] and not resized and key not in self.broken
                and not self._symbolic_serves(key, shapes)):
            return False
        self.call = (key, shapes, args, kwargs)
        return True

    def _symbolic_serves(self, key: Hashable, shapes: Tuple[Any, ...]) -> bool:
        """Whether a capture made on the symbolic entry for ``key`` covers ``shapes``: its static
        sizes are these, and each of its symbolic ones is either this one or, both being at least
        2, any (dynamo specialises 0 and 1)."""
        def covers(seen: Tuple[Any, ...], dims: Dims) -> bool:
            return all((v == w or (v >= 2 and w >= 2)) if (i, d) in dims else v == w
                       for i, (now, then) in enumerate(zip(shapes, seen)) for d, (v, w) in enumerate(zip(now, then)))
        return any(covers(seen, dims) for seen, dims in self.captured.get(key, ()))

    def graph_broke(self, key: Hashable) -> None:
        """A capture of this schema broke the graph (see ``use_symbolic``)."""
        self.broken.add(key)

    def end_call(self) -> None:
        self.call = None

    def marks(self) -> Sequence[Tuple[torch.Tensor, List[int]]]:
        """When dynamo compiles for a call from the symbolic entry: the input dimensions that stay
        static (all but the symbolic ones, this call's changes included), and why the capture
        happened if this call changed a size no earlier call had. Nothing to do on calls that run a
        captured graph: dynamo guards the static sizes, so a new change fails a guard and lands here."""
        if self.call is None:
            return ()
        key, shapes, args, kwargs = self.call
        first, paths = self.first[key]
        before = self.symbolic[key]
        expensive = self.expensive.get(key, frozenset())
        changed = changed_dims(first, shapes)
        tensors = call_tensors(args, kwargs)
        waiting = self._image_dims_static(key, tensors, first, shapes, changed | before)
        dims = (before | changed | leading_dims(first)) - expensive - waiting
        self.captured.setdefault(key, []).append((shapes, dims))
        if dims != before:
            self.symbolic[key] = dims
            new = dims - before
            shown = describe_dims(new & changed, paths, first, shapes) or "no size of this call"
            batch = ", and the leading (batch) dimension of every input" if new - changed else ""
            self.switch = (f"{'sizes changed' if not before else 'more sizes changed'}: symbolic "
                           f"{shown}{batch}; every other input size static")
        if expensive & changed:
            kept = ("static, their symbolic reasoning proved expensive: "
                    f"{describe_dims(expensive & changed, paths, first, shapes)}")
            self.switch = f"{self.switch}; {kept}" if self.switch else f"sizes changed; {kept}"
        if waiting & changed:
            kept = (f"image sizes static (a capture per size, symbolic from the {IMAGE_SIZES_STATIC + 1}th distinct "
                    f"size): {describe_dims(waiting & changed, paths, first, shapes)}")
            self.switch = f"{self.switch}; {kept}" if self.switch else f"sizes changed; {kept}"
        return [(t, [d for d in range(t.dim()) if (i, d) not in dims]) for i, (_, t) in enumerate(tensors)]

    def _image_dims_static(self, key: Hashable, tensors: Sequence[Tuple[str, torch.Tensor]],
                           first: Sequence[Sequence[int]], shapes: Sequence[Sequence[int]], seen: Dims) -> Dims:
        """The image dimensions among ``seen`` (changed now or before) that stay static for this
        capture: those captured at no more than IMAGE_SIZES_STATIC distinct sizes, this one included."""
        sizes = self.image_sizes.setdefault(key, {})
        waiting = set()
        for dim in image_dims(tensors) & seen:
            i, d = dim
            values = sizes.setdefault(dim, {first[i][d]})
            values.add(shapes[i][d])
            if len(values) <= IMAGE_SIZES_STATIC:
                waiting.add(dim)
        return frozenset(waiting)

    def sympy_budget(self, code_name: Optional[str]) -> Optional[Callable[[], Optional[float]]]:
        """Seconds of sympy work this compile may spend before its symbolic sizes can count as
        expensive (capture/watch.py adds: and sympy most of the time lately), or None: not stopped.
        Only a symbolic capture of the entry frame is stopped (nothing of the call has run, so the
        call can run again). Half the first (static) capture, at least 1 s: stopped there, the
        retry keeps the total near 3x the first capture (HF Swin with a new image size: 2.9x).
        The whole first capture where only leading (batch) dimensions are symbolic: their retry is
        a capture per batch size, the costlier outcome, and a symbolic batch size that ends well
        can spend over half the first capture in sympy (HF Swin: 1.55 s of a 2.9 s first capture).
        Seconds of the compiling thread's CPU time (capture/watch.py says why).

        The first capture's cost includes its partition, which the worker may still be making when
        the symbolic capture starts (the first size change often comes at the second call, which
        is when the request goes out). The budget is then not known yet: the watchdog reads it
        while it samples and stops nothing until it is (None), instead of the call waiting for the
        worker before it captures (bench/capture_times.py, 2026-11-29: bert-mlm's step 2 took
        13.1-13.8 s waiting, 6.2-6.3 s beside the worker; GPT-2 14.7-16.0 s against 6.3-6.8 s)."""
        if self.call is None or not self.symbolic.get(self.call[0]) or not is_entry_frame(code_name):
            return None
        share = 1.0 if all(d == 0 for _, d in self.symbolic[self.call[0]]) else 0.5
        first, later = self.first_compile_seconds or 0.0, self.later_partitions

        def budget() -> Optional[float]:
            partitions = later() if later is not None else 0.0
            return None if partitions is None else max(1.0, share * (first + partitions))
        return budget

    def compiled(self, code_name: Optional[str], seconds: float) -> None:
        if self.call is None and self.first_compile_seconds is None and is_entry_frame(code_name):
            self.first_compile_seconds = seconds

    def keep_expensive_static(self) -> str:
        """The watchdog stopped a symbolic capture of the entry frame: keep static the dimensions it
        had made symbolic (the caller runs the call again), and say which.

        Which ones: first every symbolic dimension but the leading one of each tensor (image height
        and width, sequence length), since a symbolic batch size is the cheapest and the most
        useful; if the leading ones alone still prove expensive, those too (a capture per size)."""
        assert self.call is not None
        key, shapes = self.call[0], self.call[1]
        self.captured[key].pop()   # the stopped capture serves nothing
        dims = self.symbolic[key]
        static = frozenset(d for d in dims if d[1] != 0) or dims
        self.symbolic[key] = dims - static
        self.expensive[key] = self.expensive.get(key, frozenset()) | static
        first, paths = self.first[key]
        return describe_dims(static, paths, first, shapes)

    def describe_compile(self, name: str) -> Tuple[str, bool]:
        """What is being compiled, for the slow-capture warning, and whether it is symbolic."""
        dims = self.symbolic.get(self.call[0]) if self.call is not None else None
        if not dims:
            return f"the capture of {name}", False
        first, paths = self.first[self.call[0]]
        return f"a symbolic capture of {name} (symbolic: {describe_dims(dims, paths, first, self.call[1])})", True
