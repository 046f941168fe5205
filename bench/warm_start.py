"""Issue 14's warm-start row: the first step of a process that finds an earlier run's captures on
disk, for fxtrain's default-to-be ``executor="auto"`` (the compiled graphs its tier kept) against
eager's first step and torch.compile's with its own caches warm.

    PYTHONPATH=<checkout> python bench/warm_start.py [--workload gpt2-dense] [--runs 2]

Each measurement is a fresh process (the parent only orchestrates): ``fill`` trains until the
compiled tier has won its trial (fxtrain) or the compile is done (torch.compile) and stores what it
made; ``first`` times one process's first step. The fxtrain cache lives in a temporary directory;
inductor's caches are its own (per user, under /tmp), as a user's would be. Modes alternate per run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _child(mode: str, phase: str, workload: str, cache: str) -> None:
    import torch
    import fxtrain
    from fxtrain import bench, models
    workload, _, no_kv = workload.partition(":")
    config = bench.WORKLOADS[workload].config()
    torch.manual_seed(0)
    model = models.build(config.model, seed=config.seed)
    if no_kv:
        model.config.use_cache = False
    batches = bench._batches(config, 3)
    if mode == "fxtrain":
        fn = fxtrain.TrainModule(model, fxtrain.Options(executor="auto", cache_dir=cache))
    elif mode == "compile":
        fn = torch.compile(model)
    else:
        fn = model
    opt = bench._optimizer(model, config.lr)
    started = time.perf_counter()
    bench._step(fn, opt, batches[0])
    first = time.perf_counter() - started
    tier = ""
    if phase == "fill" and mode == "fxtrain":
        info = fn.capture_info()
        bench._step(fn, opt, batches[1])
        info.wait_for_compiles(900)
        for _ in range(3 * fxtrain.runtime.tiered.TRIAL_STEPS):
            bench._step(fn, opt, batches[2])
    if phase == "first" and mode == "fxtrain":   # the stored compiled graphs load meanwhile: when do they run?
        for _ in range(5):
            bench._step(fn, opt, batches[1])
    cache_log = []
    if mode == "fxtrain":
        tier = "; ".join(fn.capture_info().tiers)
        cache_log = fn.capture_info().cache_log
    print(json.dumps({"first": first, "tier": tier, "cache": cache_log}))


def _run(mode: str, phase: str, workload: str, cache: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p))
    out = subprocess.run([sys.executable, __file__, "--child", mode, phase, workload, cache],
                         check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="gpt2-dense")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--no-kv-cache", action="store_true",
                    help="config.use_cache=False (HF causal LMs return their key/value cache otherwise; "
                         "the rows of 2026-11-26 were measured so, before the cache stored it)")
    ap.add_argument("--child", nargs=4)
    a = ap.parse_args()
    if a.child:
        _child(*a.child)
        return
    workload = a.workload + (":no-kv" if a.no_kv_cache else "")
    with tempfile.TemporaryDirectory(prefix="fxtrain-warm-") as cache:
        filled = {m: _run(m, "fill", workload, cache) for m in ("fxtrain", "compile")}
        print(f"cold first step: fxtrain {filled['fxtrain']['first']:.2f} s, torch.compile {filled['compile']['first']:.2f} s")
        print(f"fxtrain tiers after the cold run: {filled['fxtrain']['tier']}; cache: {filled['fxtrain']['cache']}")
        times = {m: [] for m in ("eager", "fxtrain", "compile")}
        for r in range(a.runs):
            for m in (("eager", "fxtrain", "compile") if r % 2 == 0 else ("compile", "fxtrain", "eager")):
                res = _run(m, "first", workload, cache)
                times[m].append(res["first"])
                if m == "fxtrain":
                    print(f"warm fxtrain tiers: {res['tier']}; cache: {res['cache']}")
    print(f"warm first step, {a.workload}, median of {a.runs} ({os.getloadavg()[0]:.1f} load): " + ", ".join(
        f"{m} {statistics.median(v):.2f} s" for m, v in times.items()))


if __name__ == "__main__":
    main()
