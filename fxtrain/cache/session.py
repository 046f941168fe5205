"""One TrainModule's use of the cache: look up before capturing, store after.

Hits and misses land in ``capture_info()`` (``cache_hits``, ``cache_misses``, ``cache_log``) and
in the INFO log. Nothing here may turn a working run into a failing one: an entry that cannot be
read, loaded or called is logged and the module captures as if the cache were empty.
"""
from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Callable, Dict, Hashable, Optional, Tuple

from torch import nn

from ..runtime.info import CaptureInfo, GraphRecord
from ..capture.scalars import ScalarWatch
from ..options import Options
from ..runtime.executors import Executor
from ..runtime.runner import RunContext
from ..runtime.dense_route import DenseRoute
from ..runtime.replay import NotReplayable
from ..runtime.tiered import Tier, TierMaker
from . import entry as entries
from .call import MISS, CachedCall
from ..capture.recipe import changed_files
from .key import Unkeyable, cache_key
from .store import CorruptEntry, Store, warn_once

logger = logging.getLogger("fxtrain")

# Beside an entry, under its key with this suffix: the graphs the compiled tier ran when it won its
# trial (executor="auto"), so that a later process starts on them (runtime/tiered.py,
# ``Tier.start_compiled``). Its header names the entry's payload by digest: a rewritten entry
# orphans it.
TIER = "-tier"


class ModuleCache:
    def __init__(self, options: Options, info: CaptureInfo, owner: str, executor: Executor,
                 context: RunContext, alive: Callable[[], bool]) -> None:
        self.options, self.info, self.owner, self.alive = options, info, owner, alive
        self.store: Optional[Store] = Store.open(options.cache_dir) if options.cache_dir else None
        if options.cache_dir and self.store is None:
            info.note_cache(f"cache off: {options.cache_dir} is missing or not writable")
        self.calls: Dict[Hashable, CachedCall] = {}
        self.disk_keys: Dict[Hashable, str] = {}
        self.modules: Tuple[int, ...] = ()
        self.resized: set = set()   # keys whose entry stopped serving (sizes, a scalar): recapture symbolically
        # The int and float arguments of the calls served by loaded entries and of the calls that
        # keys were computed from: both are part of the disk key and built into the graphs.
        self.scalars = ScalarWatch((int, float))
        self.key_scalars: Dict[Hashable, Tuple[Any, ...]] = {}
        # What compiles a loaded graph (the profiler's executor runs marked copies on fake tensors).
        self.executor, self.context = executor, context

    @property
    def active(self) -> bool:
        return self.store is not None

    def _note(self, text: str, *args: Any, miss: bool = False) -> None:
        message = text % args if args else text
        self.info.note_cache(message, miss)
        logger.info("fxtrain cache: %s", message)

    def _miss(self, text: str, *args: Any) -> object:
        self._note("miss " + text, *args, miss=True)
        return MISS

    # ------------------------------------------------------------------------------------ lookup
    def call(self, key: Hashable, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """The output of a loaded entry for this call, or MISS (then capture as usual)."""
        hit = self.calls.get(key)
        if hit is None:
            return MISS
        if self.scalars and self.scalars.changed(key, args, kwargs):
            # The entry has the int and float arguments of the call it was keyed by built in.
            self._note("entry for this schema no longer used: a scalar argument changed value")
            self.scalars.forget(key)
        elif tuple(map(id, module.modules())) == self.modules:
            out = hit(module, args, kwargs)
            if out is not MISS:
                return out
        # A scalar changed, guards failed or submodules were swapped: capture, replacing the entry.
        del self.calls[key]
        self.resized.add(key)
        return MISS

    def load(self, key: Hashable, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
             mode: str) -> Any:
        """First call with a new schema: look for an entry on disk and run it."""
        assert self.store is not None
        try:
            disk_key = cache_key(module, args, kwargs, mode, self.options)
        except Unkeyable as e:
            self._note("not used for this call: %s", e)
            return MISS
        self.disk_keys[key] = disk_key
        self.key_scalars[key] = self.scalars.values(args, kwargs)
        started = time.perf_counter()
        try:
            found = self.store.read(disk_key)
            if found is None:
                return self._miss("%s (%s): no entry", disk_key[:12], mode)
            header, payload = found
            entry = entries.loads(payload)
        except Exception as e:  # CorruptEntry, or a payload that does not unpickle
            reason = str(e) if isinstance(e, CorruptEntry) else f"{type(e).__name__}: {e}"
            warn_once(f"corrupt:{self.store.path(disk_key)}", "fxtrain: ignoring corrupt cache entry %s (%s); it will be rewritten",
                      self.store.path(disk_key), reason)
            return self._miss("%s (%s): corrupt entry ignored (%s)", disk_key[:12], mode, reason)
        stale = changed_files(entry.recipe.files)
        if stale:
            return self._miss("%s (%s): source changed since it was stored: %s", disk_key[:12], mode,
                              ", ".join(sorted(stale)[:3]))
        index, tiers = len(self.info.records), []

        def tier(step: Any) -> TierMaker:
            tiers.append(TierMaker(step, self.options, f"{self.owner} graph {index}", self.alive))
            return tiers[-1]
        try:
            guard = entry.recipe.guard
            route = DenseRoute(guard, self.info.count_dense_batch, self.options.sparsity_guard, self.owner) \
                if guard is not None and self.context.measures_batches else None
            call = CachedCall(entry, self.executor, self.context, route, self.options.backward,
                              tier if self.executor.compiles_later else None)
            if tiers and tiers[0].made is not None:
                self._warm_start(tiers[0].made, disk_key, hashlib.sha256(payload).hexdigest(), header)
            out = call(module, args, kwargs)
        except Exception as e:
            warn_once(f"unusable:{self.store.path(disk_key)}", "fxtrain: cache entry %s could not be used (%s: %s); capturing instead",
                      self.store.path(disk_key), type(e).__name__, e)
            return self._miss("%s (%s): entry could not be run (%s)", disk_key[:12], mode, type(e).__name__)
        if out is MISS:
            return self._miss("%s (%s): the entry's guards reject this call", disk_key[:12], mode)
        self.calls[key] = call
        self.scalars.record(key, args, kwargs)
        self.modules = tuple(map(id, module.modules()))
        self.info.add(GraphRecord(index=index, mode=mode, dynamo_graph=None,
                                  optimizations=dict(entry.optimizations), step=call.step, run=call.runtime,
                                  tier=tiers[0].made if tiers else None, from_cache=True), cache_hit=True)
        self._note("hit %s (%s): %d graph(s) loaded and run in %.2f s", disk_key[:12], mode,
                   1 + (entry.backward_graph is not None), time.perf_counter() - started)
        return out

    def _warm_start(self, tier: Tier, disk_key: str, digest: str, header: Dict[str, Any]) -> None:
        """Have ``tier`` load the compiled graphs stored beside the entry, if an earlier run kept
        them for this very entry; and have them stored whenever this run's trial keeps some."""
        assert self.store is not None
        try:
            found = self.store.read(disk_key + TIER)
        except CorruptEntry as e:
            self._note("compiled graphs of %s ignored: %s", disk_key[:12], e)
            found = None
        if found is not None and found[0].get("entry") == digest and tier.start_compiled(found[1]):
            self._note("compiled graphs of %s stored by an earlier run: loading them on a thread", disk_key[:12])
        tier.on_kept = lambda kept: self._write_tier(disk_key, digest, header, kept)

    def _write_tier(self, disk_key: str, digest: str, about: Dict[str, Any], tier: Tier) -> None:
        assert self.store is not None and tier.payload is not None
        header = {**about, "mode": f"{about.get('mode', '?')}, inductor's graphs", "created": time.time(),
                  "entry": digest, "compile_seconds": tier.compile_seconds, "step_seconds": tier.step_seconds}
        try:
            self.store.write(disk_key + TIER, header, tier.payload)
        except Exception as e:
            warn_once(f"write:{self.store.root}", "fxtrain: could not write the cache entry in %s (%s: %s)",
                      self.store.root, type(e).__name__, e)
            return
        self._note("stored the compiled graphs of %s (%.1f MB)", disk_key[:12], len(tier.payload) / 1e6)

    # ------------------------------------------------------------------------------------- store
    def stored_after_capture(self, key: Hashable, record: GraphRecord, out: Any, mode: str, model: str,
                             module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Store the entry of a capture that made exactly one graph: now if the capture partitioned
        it, else when the partition worker's answer is back (runtime/pending.py: ``then``), so that
        a cache costs the first step nothing. What only the capturing call shows (how its returned
        object is built from the graph's outputs) is read now. A process that ends (or is killed)
        before the answer stores nothing: the next one misses and captures; the write itself is
        atomic (cache/store.py)."""
        recipe = record.cache_recipe
        disk_key = self.disk_keys.get(key)
        if self.store is None or recipe is None or disk_key is None:
            return
        if self.scalars.values(args, kwargs) != self.key_scalars.get(key):
            # A recapture for other scalar values (a guard on them failed): it belongs under their key.
            try:
                disk_key = cache_key(module, args, kwargs, mode, self.options)
            except Unkeyable:
                return
        about = {"model": model, "mode": mode, "owner": self.owner, "executor": self.options.executor}
        try:
            outputs = entries.outputs_of(recipe, out)
        except NotReplayable as e:
            self._note("not stored (%s): %s", mode, e)
            return
        finally:
            recipe.last_outputs = None
        if record.pending is not None:
            record.pending.then(lambda whole: self._store(disk_key, recipe, outputs, about, whole.step,
                                                          whole.mode, whole.optimizations, whole.tier))
        else:
            self._store(disk_key, recipe, outputs, about, record.step, record.run.mode, record.optimizations,
                        record.tier)

    def _store(self, disk_key: str, recipe: Any, outputs: Tuple[Any, Any], about: Dict[str, Any], step: Any,
               run_mode: str, optimizations: Dict[str, str], tier: Optional[Tier]) -> None:
        assert self.store is not None
        try:
            entry = entries.build(step, run_mode, recipe, outputs, about)
            entry.optimizations = dict(optimizations)
            started = time.perf_counter()
            payload = entries.dumps(entry)
            entry.header["nodes"] = len(entry.forward_graph.graph.nodes) + (
                len(entry.backward_graph.graph.nodes) if entry.backward_graph is not None else 0)
            self.store.write(disk_key, entry.header, payload)
            if tier is not None:
                digest = hashlib.sha256(payload).hexdigest()
                tier.on_kept = lambda kept: self._write_tier(disk_key, digest, entry.header, kept)
        except NotReplayable as e:
            self._note("not stored (%s): %s", about["mode"], e)
            return
        except Exception as e:
            warn_once(f"write:{self.store.root}", "fxtrain: could not write the cache entry in %s (%s: %s)",
                      self.store.root, type(e).__name__, e)
            return
        self._note("stored %s (%s): %.1f MB in %.2f s", disk_key[:12], about["mode"],
                   len(payload) / 1e6, time.perf_counter() - started)
